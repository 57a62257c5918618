"""The §8.3 conflict policy through a running catalog: one rule per test.

A conflicting submission rejects the *entire* generation: the REJECTED state is
committed, the call answers FAILED_PRECONDITION with the conflict code, the entry and
the request field, and the generation can never be sealed or changed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

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

REJECTED = catalog_v1.GenerationState.GENERATION_STATE_REJECTED
OPEN = catalog_v1.GenerationState.GENERATION_STATE_OPEN


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _assert_rejects_generation(
    client: Client,
    scope: Scope,
    generation_id: str,
    second: catalog_v1.SubmitEntryRequest,
    code: str,
    field: str,
    entry_name: str,
) -> None:
    err = _fails(lambda: client.submit(scope, generation_id, second))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(err)
    assert (detail.code, detail.field_path, detail.attributes["entry"]) == (code, field, entry_name)
    assert detail.attributes["generation_state"] == "REJECTED"

    generation = client.get_generation(scope, generation_id)
    assert generation.state == REJECTED
    assert code in generation.rejection_reasons
    assert generation.catalog_digest == ""
    sealed = _fails(lambda: client.seal(scope, generation_id))
    assert sealed.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(sealed).code == "generation_rejected"


def _with_first(client: Client, first: catalog_v1.SubmitEntryRequest) -> tuple[Scope, str]:
    scope = client.tenant()
    gen = client.open(scope)
    client.submit(scope, gen.catalog_generation_id, first)
    return scope, gen.catalog_generation_id


def test_same_action_type_from_another_owner_rejects_the_generation(client: Client) -> None:
    first = entry(
        "acme.archive", pure_descriptor(), source=SOURCE.ENTRY_SOURCE_PACK, owner="pack:acme"
    )
    scope, gid = _with_first(client, first)
    second = entry(
        "acme.archive", pure_descriptor(), source=SOURCE.ENTRY_SOURCE_PACK, owner="pack:globex"
    )
    _assert_rejects_generation(
        client, scope, gid, second, "owner_conflict", "source", "acme.archive"
    )


def test_same_action_type_with_another_handler_reference_rejects_the_generation(
    client: Client,
) -> None:
    scope, gid = _with_first(client, entry("core.format_name", pure_descriptor()))
    second = entry("core.format_name", pure_descriptor(), handler_ref="python:other:format")
    _assert_rejects_generation(
        client,
        scope,
        gid,
        second,
        "handler_ref_conflict",
        "handler_binding.handler_ref",
        "core.format_name",
    )


def test_same_action_type_with_another_handler_version_rejects_the_generation(
    client: Client,
) -> None:
    scope, gid = _with_first(client, entry("core.format_name", pure_descriptor()))
    second = entry("core.format_name", pure_descriptor(), version="1.0.1")
    _assert_rejects_generation(
        client,
        scope,
        gid,
        second,
        "handler_version_conflict",
        "handler_binding.handler_implementation_version",
        "core.format_name",
    )


def test_same_action_type_with_another_descriptor_rejects_the_generation(
    client: Client,
) -> None:
    scope, gid = _with_first(client, entry("core.update_record", mutation_descriptor()))
    changed = mutation_descriptor()
    changed.minimum_capability_version = 3
    second = entry("core.update_record", changed)
    _assert_rejects_generation(
        client, scope, gid, second, "descriptor_conflict", "descriptor", "core.update_record"
    )


def test_rejected_generation_refuses_every_later_submission(client: Client) -> None:
    scope, gid = _with_first(client, entry("core.format_name", pure_descriptor()))
    _fails(
        lambda: client.submit(scope, gid, entry("core.format_name", pure_descriptor(), version="9"))
    )
    # Even a valid, unrelated entry: no precedence, no last-writer-wins (§8.3).
    err = _fails(lambda: client.submit(scope, gid, demo_entries()[1]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).code == "generation_rejected"
    assert client.get_generation(scope, gid).entry_count == 1


def test_pack_metadata_cannot_override_a_platform_owned_action(client: Client) -> None:
    scope, gid = _with_first(client, entry("core.update_record", mutation_descriptor()))
    pack = entry(
        "core.update_record",
        mutation_descriptor(),
        source=SOURCE.ENTRY_SOURCE_PACK,
        owner="pack:acme",
    )
    _assert_rejects_generation(
        client, scope, gid, pack, "platform_owned_override", "source", "core.update_record"
    )


def _contract() -> catalog_v1.SubmitEntryRequest:
    return entry("core.update_record", mutation_descriptor(), contract_only=True)


def _distribution(
    descriptor: common_v1.CapabilityDescriptor | None = None,
    owner: str = "platform:core",
    handler_ref: str = "python:dist:update",
) -> catalog_v1.SubmitEntryRequest:
    return entry(
        "core.update_record",
        descriptor or mutation_descriptor(),
        source=SOURCE.ENTRY_SOURCE_DISTRIBUTION,
        owner=owner,
        handler_ref=handler_ref,
    )


def test_reserved_contract_only_action_is_not_executable_until_its_owner_binds_one_handler(
    client: Client,
) -> None:
    scope = client.tenant()
    contract_only = client.build(scope, [_contract()])
    listed = client.list_entries(
        scope, contract_only.catalog_generation_id, contract_only.catalog_digest
    )
    assert [(e.contract_only, e.binding_fingerprint) for e in listed] == [(True, "")]
    assert listed[0].handler_binding.owner_registration_id == "platform:core"
    assert listed[0].handler_binding.handler_ref == ""

    bound = client.build(scope, [_contract(), _distribution()])
    listed = client.list_entries(scope, bound.catalog_generation_id, bound.catalog_digest)
    assert [e.contract_only for e in listed] == [False]
    assert listed[0].binding_fingerprint.startswith("binding_fingerprint/v1:")
    assert listed[0].handler_binding.handler_ref == "python:dist:update"
    # Binding the contract through the distribution or by the owner itself is one entry.
    direct = client.build(
        scope,
        [entry("core.update_record", mutation_descriptor(), handler_ref="python:dist:update")],
    )
    assert direct.catalog_digest == bound.catalog_digest


def test_contract_bound_by_a_handler_of_another_owner_rejects_the_generation(
    client: Client,
) -> None:
    scope, gid = _with_first(client, _contract())
    _assert_rejects_generation(
        client,
        scope,
        gid,
        _distribution(owner="pack:acme"),
        "handler_owner_mismatch",
        "handler_binding.owner_registration_id",
        "core.update_record",
    )


def test_second_handler_for_a_bound_contract_rejects_the_generation(client: Client) -> None:
    scope, gid = _with_first(client, _contract())
    client.submit(scope, gid, _distribution())
    _assert_rejects_generation(
        client,
        scope,
        gid,
        _distribution(handler_ref="python:dist:update_v2"),
        "handler_ref_conflict",
        "handler_binding.handler_ref",
        "core.update_record",
    )


def test_distribution_binding_without_the_owners_declaration_is_refused(client: Client) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    err = _fails(lambda: client.submit(scope, gen.catalog_generation_id, _distribution()))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (error_detail(err).code, error_detail(err).field_path) == (
        "dangling_reference",
        "source",
    )
    assert client.get_generation(scope, gen.catalog_generation_id).state == OPEN


def test_handler_cannot_broaden_its_owners_declared_capability(client: Client) -> None:
    scope, gid = _with_first(client, _contract())
    broader = mutation_descriptor()
    broader.fanout_bound.static_maximum = 11  # the owner declared at most 10
    _assert_rejects_generation(
        client,
        scope,
        gid,
        _distribution(broader),
        "capability_broadened",
        "descriptor.fanout_bound",
        "core.update_record",
    )


def test_handler_may_assert_a_narrower_capability_than_declared(client: Client) -> None:
    scope = client.tenant()
    narrower = mutation_descriptor()
    narrower.fanout_bound.static_maximum = 5
    gen = client.build(scope, [_contract(), _distribution(narrower)])
    listed = client.list_entries(scope, gen.catalog_generation_id, gen.catalog_digest)
    assert not listed[0].contract_only
    # The plan compiles against the owner's declaration (fan-out 10), not the assertion;
    # the asserted capability is still committed through the entry digest.
    assert listed[0].descriptor.fanout_bound.static_maximum == 10
    exact = client.build(scope, [_contract(), _distribution()])
    same = client.list_entries(scope, exact.catalog_generation_id, exact.catalog_digest)[0]
    assert same.descriptor_digest == listed[0].descriptor_digest
    assert same.entry_digest != listed[0].entry_digest


def test_identical_entries_in_another_org_or_installation_do_not_alias_the_artifact(
    client: Client,
) -> None:
    org = new_id("org")
    scopes = [
        client.tenant(org, "inst-1"),
        client.tenant(new_id("org"), "inst-1"),  # another org
        client.tenant(org, "inst-2"),  # another installation of the same org
        client.tenant(org, "inst-1", "cap-other"),  # another capability
    ]
    built = [client.build(scope, demo_entries()) for scope in scopes]

    entry_digests = [
        sorted(
            e.entry_digest
            for e in client.list_entries(s, g.catalog_generation_id, g.catalog_digest)
        )
        for s, g in zip(scopes, built, strict=True)
    ]
    assert all(d == entry_digests[0] for d in entry_digests)  # identical entries ...
    assert len({s.runtime_work_binding_digest for s in scopes}) == len(scopes)
    assert len({g.catalog_digest for g in built}) == len(scopes)  # ... never alias
    assert [g.scope for g in built] == [s.proto() for s in scopes]


def test_effect_owner_is_part_of_the_entry(client: Client) -> None:
    scope, gid = _with_first(
        client,
        entry(
            "core.send_email",
            effect_descriptor(),
            source=SOURCE.ENTRY_SOURCE_EXTENSION,
            owner="ext:mail",
        ),
    )
    other_owner = effect_descriptor()
    other_owner.effect_owner.effect_owner_kind = "email.sendgrid"
    second = entry(
        "core.send_email", other_owner, source=SOURCE.ENTRY_SOURCE_EXTENSION, owner="ext:mail"
    )
    _assert_rejects_generation(
        client, scope, gid, second, "descriptor_conflict", "descriptor", "core.send_email"
    )
