"""Catalog protos built from the compiler's JSON input documents (the reverse of
``runtime_svc.catalog_client``'s ``*_doc`` functions), so tests can publish the shared
corpus inputs (``tests/flows/_inputs``) through a catalog service."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from services.digest import versioned_digest
from services.proto import catalog_v1, common_v1

INPUTS = Path(__file__).resolve().parents[2] / "flows" / "_inputs"

_FIELD = {
    "string": catalog_v1.FieldType.FIELD_TYPE_STRING,
    "number": catalog_v1.FieldType.FIELD_TYPE_DECIMAL,
    "boolean": catalog_v1.FieldType.FIELD_TYPE_BOOLEAN,
    "date": catalog_v1.FieldType.FIELD_TYPE_DATE,
    "datetime": catalog_v1.FieldType.FIELD_TYPE_DATETIME,
    "reference": catalog_v1.FieldType.FIELD_TYPE_REFERENCE,
}
_TIMING = {
    "before_save": common_v1.TriggerTiming.TRIGGER_TIMING_BEFORE_SAVE,
    "after_save": common_v1.TriggerTiming.TRIGGER_TIMING_AFTER_SAVE,
}
_EVENT = {
    "create": common_v1.TriggerEvent.TRIGGER_EVENT_CREATE,
    "update": common_v1.TriggerEvent.TRIGGER_EVENT_UPDATE,
    "delete": common_v1.TriggerEvent.TRIGGER_EVENT_DELETE,
}


def read_input(name: str) -> Any:
    return json.loads((INPUTS / name).read_text(encoding="utf-8"))


def _enum(wrapper: Any, prefix: str, value: str | None) -> Any:
    if value is None:
        return 0
    return wrapper.Value(f"{prefix}_{value.upper()}")


def descriptor_proto(c: Mapping[str, Any]) -> Any:
    """``common_v1.CapabilityDescriptor`` of a compiler capability document."""
    d = common_v1.CapabilityDescriptor(
        execution_class=_enum(
            common_v1.ExecutionClass, "EXECUTION_CLASS", c.get("execution_class")
        ),
        transaction_policy=_enum(
            common_v1.TransactionPolicy, "TRANSACTION_POLICY", c.get("transaction_policy")
        ),
        replay_policy=_enum(common_v1.ReplayPolicy, "REPLAY_POLICY", c.get("replay_policy")),
        read_contract=_enum(common_v1.ReadContract, "READ_CONTRACT", c.get("read_contract")),
        output_durability=_enum(
            common_v1.OutputDurability, "OUTPUT_DURABILITY", c.get("output_durability")
        ),
        minimum_capability_version=c.get("minimum_capability_version") or 0,
    )
    fb = c.get("fanout_bound")
    if fb:
        kind = {"static": 1, "metadata_derived": 2, "unknown": 3}[fb["kind"]]
        d.fanout_bound.CopyFrom(
            common_v1.FanoutBound(
                kind=kind,  # type: ignore[arg-type]
                static_maximum=fb.get("max") or 0,
                metadata_path=fb.get("relationship") or "",
            )
        )
    lp = c.get("lock_plan")
    if lp:
        kind = {"static_keys": 1, "metadata_derived": 2, "late_discovery_allowed": 3}.get(
            lp["kind"], 4
        )
        classes = lp.get("resource_classes") or []
        d.lock_plan_contract.CopyFrom(
            common_v1.LockPlanContract(
                kind=kind,  # type: ignore[arg-type]
                resource_classes=classes,
                static_keys=[
                    common_v1.ResourceKey(resource_class=rc, namespace=obj, ordering_version=1)
                    for rc in classes
                    for obj in lp.get("objects") or []
                ],
            )
        )
    eo = c.get("effect_owner")
    if eo:
        d.effect_owner.CopyFrom(
            common_v1.EffectOwnerContract(
                owner_class=_enum(common_v1.EffectOwnerClass, "EFFECT_OWNER_CLASS", eo["kind"]),
                effect_owner_kind=eo.get("owner_id") or "",
            )
        )
    idem = c.get("idempotency")
    if idem:
        scope = {"flow_run": 2, "runtime_work_scope": 3, "installation": 3, "org": 4}
        keyed = idem.get("scope") not in (None, "none")
        d.idempotency_policy.CopyFrom(
            common_v1.IdempotencyPolicy(
                key_required=keyed,
                key_shape=idem.get("key_shape") if keyed else "",
                uniqueness_scope=scope.get(idem.get("scope"), 0) if keyed else 0,  # type: ignore[arg-type]
            )
        )
    sec = c.get("security")
    if sec:
        # The corpus uses free-form modes; the proto closes them over three values. Only
        # an explicit "system" is system mode (it needs a declared identity, §17).
        system = sec.get("principal_mode") == "system"
        d.security_policy.CopyFrom(
            common_v1.SecurityPolicy(
                principal_mode=common_v1.PrincipalMode.PRINCIPAL_MODE_SYSTEM
                if system
                else common_v1.PrincipalMode.PRINCIPAL_MODE_INITIATING_PRINCIPAL,
                reauthorization_policy=common_v1.ReauthorizationPolicy.REAUTHORIZATION_POLICY_FAULT_PATH,
            )
        )
    return d


def entry_proto(e: Mapping[str, Any], generation_id: str) -> Any:
    """``catalog_v1.CatalogEntry`` of a compiler entry document."""
    return catalog_v1.CatalogEntry(
        catalog_generation_id=generation_id,
        action_type=e["action_type"],
        source=catalog_v1.EntrySource.ENTRY_SOURCE_PLATFORM,
        handler_binding=common_v1.HandlerBinding(
            owner_registration_id=e.get("owner_id", ""),
            handler_ref=e.get("handler_ref", ""),
            handler_implementation_version=e.get("handler_version", ""),
        ),
        contract_only=bool(e.get("contract_only")),
        descriptor=descriptor_proto(e.get("capabilities") or {}),
        binding_fingerprint=e.get("binding_fingerprint", ""),
        entry_digest=e["entry_digest"],
    )


def view_proto(
    view: Mapping[str, Any],
    org_id: str,
    app_installation_id: str,
    *,
    schema_generation: int = 1,
    extra_subscriptions: Sequence[Mapping[str, Any]] = (),
) -> Any:
    """``catalog_v1.MetadataView`` of a compiler view document (without its digest)."""
    subs = [*view.get("trigger_subscriptions", ()), *extra_subscriptions]
    return catalog_v1.MetadataView(
        org_id=org_id,
        app_installation_id=app_installation_id,
        schema_generation=schema_generation,
        objects=[
            catalog_v1.ObjectSchema(
                api_name=o["api_name"],
                fields=[
                    catalog_v1.FieldSchema(
                        api_name=f["name"],
                        type=_FIELD.get(f["type"], catalog_v1.FieldType.FIELD_TYPE_STRING),
                        reference_object_api_name=f.get("reference_to") or "",
                    )
                    for f in o["fields"]
                    if f["type"] != "id"
                ],
            )
            for o in view.get("objects", ())
        ],
        relationships=[
            catalog_v1.Relationship(
                name=r["name"],
                kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_LOOKUP,
                parent_object_api_name=r["parent_object"],
                child_object_api_name=r["child_object"],
                child_field_api_name=r["field"],
                lock_relevant=bool(r.get("lock_parent")),
            )
            for r in view.get("relationships", ())
        ],
        trigger_subscriptions=[
            catalog_v1.TriggerSubscription(
                flow_api_name=s["flow_api_name"],
                object_api_name=s["object"],
                timing=_TIMING[s["timing"]],
                events=[_EVENT[e] for e in s["events"]],
            )
            for s in subs
        ],
        actions=[
            catalog_v1.ActionMetadata(
                action_type=a["action_type"],
                inputs=[
                    catalog_v1.ActionParameter(
                        name=p["name"],
                        type=_FIELD.get(p["type"], catalog_v1.FieldType.FIELD_TYPE_STRING),
                        required=bool(p.get("required")),
                    )
                    for p in a.get("inputs", ())
                ],
                outputs=[
                    catalog_v1.ActionParameter(
                        name=p["name"],
                        type=_FIELD.get(p["type"], catalog_v1.FieldType.FIELD_TYPE_STRING),
                    )
                    for p in a.get("outputs", ())
                ],
            )
            for a in view.get("actions", ())
        ],
    )


def view_digest(view: Any) -> str:
    """A content digest for a view (what a catalog computes on publication)."""
    content = json_format.MessageToDict(view, preserving_proto_field_name=True)
    content.pop("runtime_metadata_view_digest", None)
    return versioned_digest("runtime_metadata_view", content)


def binding_digest(binding: Any) -> str:
    return versioned_digest(
        "runtime_work_binding", json_format.MessageToDict(binding, preserving_proto_field_name=True)
    )
