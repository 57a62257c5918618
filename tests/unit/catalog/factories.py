"""Builders of valid catalog-domain values for the unit tests (each test overrides a little)."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

from catalog_svc.domain import (
    Accepted,
    ActionOwner,
    CapabilityDescriptor,
    CatalogEntrySubmission,
    GenerationDraft,
    OwnerKind,
    RuntimeMetadataView,
    RuntimeWorkBinding,
    open_generation,
    submit_entry,
)
from services.digest import versioned_digest

PACK = ActionOwner(OwnerKind.PACK, "pack:acme.billing")
OTHER_PACK = ActionOwner(OwnerKind.PACK, "pack:globex.billing")
PLATFORM = ActionOwner(OwnerKind.PLATFORM, "platform:core")

INVOICE = "acme.send_invoice"
UPDATE = "core.update_record"


def view_dict() -> dict[str, Any]:
    """A small valid view: two objects, one relationship, two triggers, two actions."""
    return {
        "objects": [
            {
                "api_name": "Account",
                "fields": [
                    {"api_name": "Name", "type": "string", "required": True, "max_length": 80},
                    {"api_name": "Balance", "type": "decimal", "precision": 18, "scale": 2},
                    {
                        "api_name": "Tier",
                        "type": "picklist",
                        "picklist_values": ["gold", "silver", "bronze"],
                    },
                ],
            },
            {
                "api_name": "Contact",
                "fields": [
                    {
                        "api_name": "AccountId",
                        "type": "reference",
                        "reference_object_api_name": "Account",
                    },
                    {"api_name": "Email", "type": "text", "max_length": 320},
                    {"api_name": "Id", "type": "id"},
                ],
            },
        ],
        "relationships": [
            {
                "child_object_api_name": "Contact",
                "child_field_api_name": "AccountId",
                "parent_object_api_name": "Account",
            }
        ],
        "trigger_subscriptions": [
            {
                "flow_api_name": "Welcome",
                "object_api_name": "Contact",
                "timing": "after_save",
                "events": ["update", "create"],
                "entry_condition": "ISCHANGED(Email)",
            },
            {
                "flow_api_name": "Normalize",
                "object_api_name": "Account",
                "timing": "before_save",
                "events": ["create"],
            },
        ],
        "actions": [
            {
                "action_type": INVOICE,
                "label": "Send invoice",
                "description": "Sends an invoice e-mail",
                "inputs": [
                    {"name": "invoice_id", "type": "id", "required": True},
                    {"name": "cc", "type": "string", "is_collection": True},
                ],
                "outputs": [{"name": "message_id", "type": "string"}],
            },
            {
                "action_type": UPDATE,
                "label": "Update record",
                "inputs": [{"name": "record_id", "type": "id"}],
            },
        ],
    }


def make_view() -> RuntimeMetadataView:
    return RuntimeMetadataView.from_dict(view_dict())


def make_binding(**overrides: Any) -> RuntimeWorkBinding:
    values: dict[str, Any] = {
        "org_id": "org-1",
        "app_installation_id": "inst-1",
        "runtime_capability_id": "cap-flow",
        "catalog_revision": 7,
        "schema_generation": 3,
        "engine_generation": 2,
        "catalog_snapshot_digest": versioned_digest("catalog_snapshot", {"rev": 7}),
        "runtime_metadata_view_digest": make_view().digest(),
    }
    values.update(overrides)
    return RuntimeWorkBinding(**values)


def mutation_descriptor_dict() -> dict[str, Any]:
    """A valid record-mutation descriptor touching every field."""
    return {
        "execution_class": "record_mutation",
        "transaction_policy": "profile_dependent",
        "replay_policy": "deterministic_replay",
        "fanout_bound": {"kind": "static_maximum", "static_maximum": 10},
        "read_contract": "current_transactional",
        "lock_plan_contract": {
            "kind": "static_keys",
            "static_keys": [
                {
                    "resource_class": "record",
                    "namespace": "Account",
                    "record_identity": "$trigger.Id",
                    "ordering_version": 1,
                },
                {"resource_class": "parent", "namespace": "Account", "ordering_version": 1},
            ],
            "resource_classes": ["record", "parent"],
            "max_keys": 4,
        },
        "effect_owner": {"owner_class": "none"},
        "idempotency_policy": {"key_required": False},
        "output_durability": "checkpointed",
        "security_policy": {
            "principal_mode": "initiating_principal",
            "reauthorization_policy": "fault_path",
        },
        "minimum_capability_version": 2,
    }


def effect_descriptor_dict() -> dict[str, Any]:
    """A valid external-effect descriptor (idempotent by key)."""
    return {
        "execution_class": "external_effect",
        "transaction_policy": "transaction_forbidden",
        "replay_policy": "idempotent_by_key",
        "fanout_bound": {"kind": "metadata_derived_maximum", "metadata_path": "input.cc"},
        "read_contract": "checkpoint_only",
        "lock_plan_contract": {"kind": "unknown"},
        "effect_owner": {"owner_class": "integration_work", "effect_owner_kind": "email.smtp"},
        "idempotency_policy": {
            "key_required": True,
            "key_shape": "invoice:${input.invoice_id}:${step.invocation}",
            "uniqueness_scope": "runtime_work_scope",
        },
        "output_durability": "owner_receipt",
        "security_policy": {
            "principal_mode": "initiating_principal",
            "reauthorization_policy": "terminal_failure",
        },
        "minimum_capability_version": 1,
    }


def patch(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """Deep copy of ``base`` with dotted-path ``changes`` applied (``...`` deletes the key)."""
    out = copy.deepcopy(dict(base))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node[key]
        if value is ...:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


def descriptor(
    changes: Mapping[str, Any] | None = None, *, effect: bool = True
) -> CapabilityDescriptor:
    base = effect_descriptor_dict() if effect else mutation_descriptor_dict()
    return CapabilityDescriptor.from_dict(patch(base, changes or {}))


def submission_dict(
    action_type: str = INVOICE,
    owner: ActionOwner = PACK,
    *,
    descriptor_changes: Mapping[str, Any] | None = None,
    effect: bool = True,
    handler: bool = True,
    handler_ref: str = "python:acme.billing.handlers:send_invoice",
    version: str | None = "1.4.0",
    release_digest: str | None = None,
    handler_owner: str | None = None,
    asserted: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    base = effect_descriptor_dict() if effect else mutation_descriptor_dict()
    desc = patch(base, descriptor_changes or {})
    out: dict[str, Any] = {
        "action_type": action_type,
        "owner": {"kind": owner.kind.name.lower(), "registration_id": owner.registration_id},
        "descriptor": desc,
        "handler_binding": None,
    }
    if handler:
        out["handler_binding"] = {
            "owner_registration_id": handler_owner or owner.registration_id,
            "handler_ref": handler_ref,
            "handler_implementation_version": version,
            "service_release_digest": release_digest,
            "asserted_capability": None if asserted is None else patch(desc, asserted),
        }
    return out


def submission(
    action_type: str = INVOICE, owner: ActionOwner = PACK, **kwargs: Any
) -> CatalogEntrySubmission:
    return CatalogEntrySubmission.from_dict(submission_dict(action_type, owner, **kwargs))


def open_draft(
    binding: RuntimeWorkBinding | None = None, generation_id: str = "gen-1"
) -> GenerationDraft:
    return open_generation(binding or make_binding(), generation_id)


def accept(
    draft: GenerationDraft,
    sub: CatalogEntrySubmission,
    platform_owned: Mapping[str, ActionOwner] | None = None,
) -> GenerationDraft:
    decision = submit_entry(draft, sub, platform_owned or {}, source_scope=draft.scope)
    assert isinstance(decision, Accepted), decision
    return decision.draft


def shuffled(value: Any, rnd: random.Random) -> Any:
    """Recursively re-insert dict keys in a random order (list order untouched)."""
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: shuffled(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value
