"""The catalog-proto → compiler-input adapter (``runtime_svc.catalog_client``): what the
catalog declares reaches the compiler unchanged, and what it leaves undeclared stays
unknown, so it fails closed (§8.4)."""

from __future__ import annotations

import pytest

from runtime_svc.catalog_client import (
    binding_doc,
    descriptor_doc,
    entry_doc,
    generation_doc,
    metadata_view_doc,
)
from runtime_svc.compiler import CapabilityEntryView, MetadataViewInput, compile_plan
from runtime_svc.definitions import CatalogSnapshot, build_compiler_inputs
from runtime_svc.definitions.inputs import pin_subscription_versions
from services.proto import catalog_v1, common_v1
from tests.integration.definitions.catalog_protos import (
    entry_proto,
    read_input,
    view_digest,
    view_proto,
)
from tests.unit.definitions import corpus

ENTRIES = read_input("catalog.json")["entries"]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["action_type"] for e in ENTRIES])
def test_catalog_entries_keep_their_declared_capabilities(entry: dict) -> None:
    original = CapabilityEntryView.from_dict(entry, "entry")
    mapped = CapabilityEntryView.from_dict(entry_doc(entry_proto(entry, "gen-1")), "entry")
    a, b = original.capabilities, mapped.capabilities
    assert b.unknown_fields() == a.unknown_fields()
    assert (b.execution_class, b.transaction_policy, b.replay_policy) == (
        a.execution_class,
        a.transaction_policy,
        a.replay_policy,
    )
    assert (b.fanout_bound, b.read_contract, b.output_durability) == (
        a.fanout_bound,
        a.read_contract,
        a.output_durability,
    )
    assert (b.lock_plan.kind, b.effect_owner) == (a.lock_plan.kind, a.effect_owner)
    assert (mapped.entry_digest, mapped.binding_fingerprint) == (
        original.entry_digest,
        original.binding_fingerprint,
    )


def test_an_empty_descriptor_is_entirely_unknown() -> None:
    doc = descriptor_doc(common_v1.CapabilityDescriptor())
    assert doc == {}
    view = CapabilityEntryView.from_dict({"action_type": "x", "entry_digest": "d"}, "e")
    assert len(view.capabilities.unknown_fields()) == 11
    # A required key without shape or scope keeps the idempotency capability unknown.
    keyed = common_v1.CapabilityDescriptor(
        idempotency_policy=common_v1.IdempotencyPolicy(key_required=True)
    )
    assert descriptor_doc(keyed)["idempotency"] == {"key_shape": None, "scope": None}


def test_metadata_view_keeps_schema_relationships_triggers_and_actions() -> None:
    source = read_input("metadata_view.json")
    proto = view_proto(source, "org-1", "inst-1")
    proto.runtime_metadata_view_digest = view_digest(proto)
    doc = metadata_view_doc(proto)
    view = MetadataViewInput.from_dict(pin_subscription_versions(doc, {}))
    assert view.digest == proto.runtime_metadata_view_digest
    assert [o.api_name for o in view.objects] == [o["api_name"] for o in source["objects"]]
    contact = view.object("Contact")
    assert contact is not None and contact.field("Id") is not None
    account_id = contact.field("AccountId")
    assert account_id is not None and account_id.reference_to == "Account"
    rel = view.relationship("Opportunity_LineItems")
    assert rel is not None and rel.lock_parent and rel.max_children is None  # not in the proto
    assert {a.action_type for a in view.actions} == {a["action_type"] for a in source["actions"]}
    assert len(view.trigger_subscriptions) == len(source["trigger_subscriptions"])
    assert {s.flow_version for s in view.trigger_subscriptions} == {0}
    pinned = pin_subscription_versions(doc, {"durable_send_email": 3})
    versions = {s["flow_api_name"]: s["flow_version"] for s in pinned["trigger_subscriptions"]}
    assert versions["durable_send_email"] == 3 and versions["atomic_close_won"] == 0


def test_a_flow_compiles_through_the_adapter_as_from_json() -> None:
    """The durable e-mail Flow compiles to the same profile and steps via catalog protos."""
    org, app = "org-acme", "inst-crm-1"
    proto = view_proto(read_input("metadata_view.json"), org, app)
    proto.runtime_metadata_view_digest = view_digest(proto)
    binding = common_v1.RuntimeWorkBinding(
        org_id=org,
        app_installation_id=app,
        runtime_capability_id="cap",
        catalog_revision=1,
        schema_generation=1,
        engine_generation=1,
        catalog_snapshot_digest="snap",
        runtime_metadata_view_digest=proto.runtime_metadata_view_digest,
    )
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=org, app_installation_id=app, runtime_capability_id="cap",
        runtime_work_binding_digest="bd",
    )  # fmt: skip
    generation = catalog_v1.CatalogGeneration(
        scope=scope,
        runtime_work_binding=binding,
        catalog_generation_id="gen-1",
        catalog_digest="cd",
        state=catalog_v1.GenerationState.GENERATION_STATE_SEALED,
    )
    snapshot = CatalogSnapshot(
        binding=binding_doc(binding, "bd"),
        generation=generation_doc(generation),
        entries=tuple(entry_doc(entry_proto(e, "gen-1")) for e in ENTRIES),
        metadata_view=metadata_view_doc(proto),
    )
    inputs = build_compiler_inputs(
        snapshot,
        corpus.read(corpus.INPUTS / "policy.json"),
        flow_versions={"durable_send_email": 1},
    )
    via_proto = compile_plan(corpus.flow("durable_send_email"), inputs)
    direct = corpus.plan("durable_send_email")
    assert via_proto.profile is direct.profile
    assert via_proto.step_keys == direct.step_keys
    assert [s.kind for s in via_proto.steps] == [s.kind for s in direct.steps]
    assert via_proto.binding.binding_digest == "bd"
    assert via_proto.catalog.generation_id == "gen-1" and via_proto.catalog.sealed
