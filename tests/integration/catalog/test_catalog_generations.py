"""The §8.2 builder protocol and the §8.1 digest chain through a running catalog."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from sqlalchemy import select, update

from catalog_svc import schema
from catalog_svc.domain import (
    ActionOwner,
    HandlerBinding,
    OwnerKind,
    compute_binding_fingerprint,
    compute_catalog_digest,
    compute_entry_digest,
)
from catalog_svc.domain import RuntimeWorkBindingDigest as Rwbd
from services import db
from services.digest import versioned_digest
from services.proto import catalog_v1, common_v1
from tests.integration.catalog.harness import (
    SOURCE,
    Client,
    Scope,
    demo_entries,
    effect_descriptor,
    entry,
    error_detail,
    mutation_descriptor,
    new_id,
    pure_descriptor,
)

SEALED = catalog_v1.GenerationState.GENERATION_STATE_SEALED
OPEN = catalog_v1.GenerationState.GENERATION_STATE_OPEN


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _entries(client: Client, scope: Scope, gen: catalog_v1.CatalogGeneration) -> dict[str, Any]:
    listed = client.list_entries(scope, gen.catalog_generation_id, gen.catalog_digest)
    return {e.action_type: e for e in listed}


def test_open_submit_seal_builds_a_sealed_generation_with_sorted_entries(client: Client) -> None:
    scope = client.tenant()
    opened = client.open(scope)
    assert opened.state == OPEN and opened.catalog_digest == "" and opened.entry_count == 0
    assert opened.scope == scope.proto()
    assert opened.runtime_work_binding.org_id == scope.org_id

    for e in demo_entries():
        resp = client.submit(scope, opened.catalog_generation_id, e)
        assert not resp.already_present
    sealed = client.seal(scope, opened.catalog_generation_id)

    assert sealed.state == SEALED and sealed.entry_count == 3
    assert sealed.HasField("sealed_at") and sealed.catalog_digest.startswith("catalog/v1:")
    listed = client.list_entries(scope, sealed.catalog_generation_id, sealed.catalog_digest)
    assert [e.action_type for e in listed] == sorted(e.action_type for e in demo_entries())
    assert client.get_generation(scope, sealed.catalog_generation_id) == sealed


def test_digest_chain_is_the_versioned_non_circular_construction(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    mail = _entries(client, scope, gen)["core.send_email"]

    d = mail.descriptor
    descriptor_digest = mail.descriptor_digest
    assert descriptor_digest.startswith("capability_descriptor/v1:")
    handler = HandlerBinding(
        mail.handler_binding.owner_registration_id,
        mail.handler_binding.handler_ref,
        mail.handler_binding.handler_implementation_version,
    )
    fingerprint = compute_binding_fingerprint(handler, descriptor_digest)
    assert mail.binding_fingerprint == fingerprint
    owner = ActionOwner(OwnerKind.EXTENSION, "ext:mail")
    assert mail.entry_digest == compute_entry_digest(
        "core.send_email",
        owner,
        descriptor_digest,
        handler,
        fingerprint,
    )
    entries = _entries(client, scope, gen)
    assert gen.catalog_digest == compute_catalog_digest(
        Rwbd(scope.runtime_work_binding_digest), [e.entry_digest for e in entries.values()]
    )
    assert d.execution_class == common_v1.ExecutionClass.EXECUTION_CLASS_EXTERNAL_EFFECT


def test_catalog_digest_is_independent_of_entry_submission_order(client: Client) -> None:
    scope = client.tenant()
    forward = client.build(scope, demo_entries())
    backward = client.build(scope, demo_entries()[::-1])

    assert forward.catalog_generation_id != backward.catalog_generation_id
    assert forward.catalog_digest == backward.catalog_digest
    a, b = _entries(client, scope, forward), _entries(client, scope, backward)
    assert {k: v.entry_digest for k, v in a.items()} == {k: v.entry_digest for k, v in b.items()}


def test_digests_are_independent_of_the_order_of_set_valued_descriptor_fields(
    client: Client,
) -> None:
    scope = client.tenant()
    shuffled = mutation_descriptor()
    keys = list(shuffled.lock_plan_contract.static_keys)[::-1]
    del shuffled.lock_plan_contract.static_keys[:]
    shuffled.lock_plan_contract.static_keys.extend(keys)
    shuffled.lock_plan_contract.resource_classes[:] = ["parent", "record"]

    one = client.build(scope, [entry("core.update_record", mutation_descriptor())])
    two = client.build(scope, [entry("core.update_record", shuffled)])

    e1 = _entries(client, scope, one)["core.update_record"]
    e2 = _entries(client, scope, two)["core.update_record"]
    assert (e1.descriptor_digest, e1.binding_fingerprint, e1.entry_digest) == (
        e2.descriptor_digest,
        e2.binding_fingerprint,
        e2.entry_digest,
    )
    assert one.catalog_digest == two.catalog_digest


def test_changed_handler_implementation_version_changes_fingerprint_entry_and_catalog_digest(
    client: Client,
) -> None:
    scope = client.tenant()
    old = client.build(
        scope, [*demo_entries()[:2], entry("core.send_email", effect_descriptor(), version="2.3.0")]
    )
    new = client.build(
        scope, [*demo_entries()[:2], entry("core.send_email", effect_descriptor(), version="2.3.1")]
    )

    a, b = _entries(client, scope, old), _entries(client, scope, new)
    assert a["core.send_email"].descriptor_digest == b["core.send_email"].descriptor_digest
    assert a["core.send_email"].binding_fingerprint != b["core.send_email"].binding_fingerprint
    assert a["core.send_email"].entry_digest != b["core.send_email"].entry_digest
    assert old.catalog_digest != new.catalog_digest
    # the untouched entries keep their digests
    assert a["core.format_name"].entry_digest == b["core.format_name"].entry_digest


def test_changed_capability_descriptor_changes_the_whole_digest_chain(client: Client) -> None:
    scope = client.tenant()
    wider = mutation_descriptor()
    wider.fanout_bound.static_maximum = 20
    one = client.build(scope, [entry("core.update_record", mutation_descriptor())])
    two = client.build(scope, [entry("core.update_record", wider)])
    e1 = _entries(client, scope, one)["core.update_record"]
    e2 = _entries(client, scope, two)["core.update_record"]
    assert e1.descriptor_digest != e2.descriptor_digest
    assert e1.binding_fingerprint != e2.binding_fingerprint
    assert e1.entry_digest != e2.entry_digest
    assert one.catalog_digest != two.catalog_digest


def test_service_release_digest_can_stand_in_for_the_implementation_version(
    client: Client,
) -> None:
    scope = client.tenant()
    release = versioned_digest("service_release", {"image": "mail:2.3.0"})
    gen = client.build(
        scope, [entry("core.format_name", pure_descriptor(), release_digest=release)]
    )
    e = _entries(client, scope, gen)["core.format_name"]
    assert e.handler_binding.service_release_digest == release
    assert e.handler_binding.handler_implementation_version == ""


def test_identical_resubmission_is_idempotent_before_sealing(client: Client) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    first = client.submit(scope, gen.catalog_generation_id, demo_entries()[0])
    again = client.submit(scope, gen.catalog_generation_id, demo_entries()[0])

    assert not first.already_present and again.already_present
    assert again.entry == first.entry
    assert client.get_generation(scope, gen.catalog_generation_id).entry_count == 1


def test_sealed_generation_is_immutable_and_sealing_again_is_idempotent(client: Client) -> None:
    scope = client.tenant()
    sealed = client.build(scope, demo_entries()[:1])

    err = _fails(lambda: client.submit(scope, sealed.catalog_generation_id, demo_entries()[1]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).code == "generation_sealed"
    assert client.seal(scope, sealed.catalog_generation_id) == sealed
    assert client.get_generation(scope, sealed.catalog_generation_id).entry_count == 1


def test_open_generation_needs_a_registered_binding(client: Client) -> None:
    scope = client.tenant()
    unregistered = Scope(
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        versioned_digest("runtime_work_binding", {"never": "registered"}),
    )
    err = _fails(lambda: client.open(unregistered))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_open_generation_refuses_an_unsupported_contract_version(client: Client) -> None:
    scope = client.tenant()
    err = _fails(
        lambda: client.call(
            "OpenGeneration",
            catalog_v1.OpenGenerationRequest(
                request_id=new_id("req"), scope=scope.proto(), contract_version=2
            ),
            client.scoped(scope),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == "contract_version"


def test_get_entry_by_its_exact_read_key(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    mail = _entries(client, scope, gen)["core.send_email"]

    def get(**changes: str) -> catalog_v1.CatalogEntry:
        key = {
            "catalog_digest": gen.catalog_digest,
            "action_type": "Core.Send_Email ",  # normalized by the server
            "entry_digest": mail.entry_digest,
            "binding_fingerprint": mail.binding_fingerprint,
            **changes,
        }
        return client.call(
            "GetEntry",
            catalog_v1.GetEntryRequest(
                scope=scope.proto(), catalog_generation_id=gen.catalog_generation_id, **key
            ),
            client.scoped(scope),
        ).entry

    assert get() == mail
    other = _entries(client, scope, gen)["core.format_name"]
    for field, value, code in (
        ("entry_digest", other.entry_digest, grpc.StatusCode.FAILED_PRECONDITION),
        ("binding_fingerprint", other.binding_fingerprint, grpc.StatusCode.FAILED_PRECONDITION),
        ("catalog_digest", versioned_digest("catalog", {"x": 1}), grpc.StatusCode.NOT_FOUND),
        ("action_type", "core.unknown", grpc.StatusCode.NOT_FOUND),
    ):
        err = _fails(lambda field=field, value=value: get(**{field: value}))
        assert err.code() == code, field
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            assert error_detail(err).field_path == field


def test_list_entries_pages_in_action_type_order(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    paged = client.list_entries(scope, gen.catalog_generation_id, gen.catalog_digest, page_size=1)
    assert [e.action_type for e in paged] == sorted(e.action_type for e in demo_entries())

    err = _fails(
        lambda: client.call(
            "ListEntries",
            catalog_v1.ListEntriesRequest(
                scope=scope.proto(),
                catalog_generation_id=gen.catalog_generation_id,
                catalog_digest=gen.catalog_digest,
                page_token="garbage",
            ),
            client.scoped(scope),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == "page_token"


def test_list_entries_refuses_a_negative_page_size(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    err = _fails(
        lambda: client.list_entries(
            scope, gen.catalog_generation_id, gen.catalog_digest, page_size=-1
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == "page_size"


def test_a_tampered_stored_entry_is_never_served(client: Client, catalog_db_url: str) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())

    async def tamper() -> None:
        engine = db.create_engine(catalog_db_url, pool_size=1)
        e = schema.capability_catalog_entries
        try:
            async with db.transaction(engine) as conn:
                row = (
                    await conn.execute(
                        select(e.c.entry_payload).where(
                            e.c.org_id == scope.org_id, e.c.action_type == "core.format_name"
                        )
                    )
                ).one()
                payload = row.entry_payload.replace('"1.0.0"', '"6.6.6"')
                await conn.execute(
                    update(e)
                    .where(e.c.org_id == scope.org_id, e.c.action_type == "core.format_name")
                    .values(entry_payload=payload)
                )
        finally:
            await engine.dispose()

    asyncio.run(tamper())
    err = _fails(lambda: client.get_generation(scope, gen.catalog_generation_id))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert error_detail(err).code == "artifact_integrity"


def test_an_open_generation_has_no_readable_entries(client: Client) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    client.submit(scope, gen.catalog_generation_id, demo_entries()[0])
    err = _fails(
        lambda: client.list_entries(
            scope, gen.catalog_generation_id, versioned_digest("catalog", {"open": True})
        )
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND


def _no_fanout_kind(d: common_v1.CapabilityDescriptor) -> None:
    d.fanout_bound.kind = 0


def _unknown_execution_class(d: common_v1.CapabilityDescriptor) -> None:
    d.execution_class = 99


def _constant_key(d: common_v1.CapabilityDescriptor) -> None:
    d.idempotency_policy.key_shape = "always-the-same"


def _undeclared_input(d: common_v1.CapabilityDescriptor) -> None:
    d.idempotency_policy.key_shape = "mail:${run.id}:${input.nope}"


def _effect_without_owner(d: common_v1.CapabilityDescriptor) -> None:
    d.effect_owner.owner_class = common_v1.EffectOwnerClass.EFFECT_OWNER_CLASS_NONE
    d.effect_owner.effect_owner_kind = ""


def _no_minimum_version(d: common_v1.CapabilityDescriptor) -> None:
    d.minimum_capability_version = 0


@pytest.mark.parametrize(
    ("mutate", "field", "code"),
    [
        (_no_fanout_kind, "descriptor.fanout_bound.kind", "missing_field"),
        (_unknown_execution_class, "descriptor.execution_class", "unknown_enum_value"),
        (_constant_key, "descriptor.idempotency_policy.key_shape", "invalid_format"),
        (_undeclared_input, "descriptor.idempotency_policy.key_shape", "undeclared_input"),
        (_effect_without_owner, "descriptor.effect_owner.owner_class", "inconsistent"),
        (_no_minimum_version, "descriptor.minimum_capability_version", "out_of_range"),
    ],
)
def test_invalid_descriptor_is_refused_naming_entry_and_field(
    client: Client,
    mutate: Callable[[common_v1.CapabilityDescriptor], None],
    field: str,
    code: str,
) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    descriptor = effect_descriptor()
    mutate(descriptor)
    bad = entry(
        "core.send_email", descriptor, source=SOURCE.ENTRY_SOURCE_EXTENSION, owner="ext:mail"
    )

    err = _fails(lambda: client.submit(scope, gen.catalog_generation_id, bad))

    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(err)
    assert (detail.field_path, detail.code) == (field, code)
    if code != "unknown_enum_value":  # decoded before the builder sees the entry
        assert detail.attributes["entry"] == "core.send_email"
    # A refused submission leaves the generation open and unchanged.
    assert client.get_generation(scope, gen.catalog_generation_id).state == OPEN


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda e: e.ClearField("handler_binding"), "handler_binding.owner_registration_id"),
        (lambda e: setattr(e.handler_binding, "handler_ref", ""), "handler_binding.handler_ref"),
        (lambda e: setattr(e, "source", 0), "source"),
        (lambda e: setattr(e, "action_type", "Not An Action"), "action_type"),
        (
            lambda e: setattr(
                e.handler_binding, "service_release_digest", versioned_digest("release", {})
            ),
            "handler_binding.service_release_digest",
        ),
        (
            lambda e: setattr(e.handler_binding, "handler_ref", "python:0xdeadbeef"),
            "handler_binding.handler_ref",
        ),
        (lambda e: e.ClearField("descriptor"), "descriptor"),
    ],
)
def test_invalid_entry_fields_are_refused_naming_the_field(
    client: Client, mutate: Callable[[catalog_v1.SubmitEntryRequest], None], field: str
) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    bad = entry("core.format_name", pure_descriptor())
    mutate(bad)
    err = _fails(lambda: client.submit(scope, gen.catalog_generation_id, bad))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == field


def test_contract_version_and_descriptor_are_echoed_normalized(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, [entry("core.update_record", mutation_descriptor())])
    e = _entries(client, scope, gen)["core.update_record"]
    assert gen.contract_version == 1
    # set-valued fields come back in their normalized (sorted) order
    assert list(e.descriptor.lock_plan_contract.resource_classes) == ["parent", "record"]
