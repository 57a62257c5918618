"""Runtime handler availability and the §8.4 release rule ("a candidate binary must prove
support for every generation used by work it can claim") through a running catalog."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc
import pytest

from services.proto import catalog_v1
from tests.integration.catalog.harness import (
    Client,
    Scope,
    demo_entries,
    effect_descriptor,
    entry,
    error_detail,
    new_id,
)

GAP = catalog_v1.BindingGapReason
H = catalog_v1.ReferenceHolderKind


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _tuples(
    scope: Scope, gen: catalog_v1.CatalogGeneration, entries: Iterable[catalog_v1.CatalogEntry]
) -> list[catalog_v1.HandlerAvailabilityTuple]:
    return [
        catalog_v1.HandlerAvailabilityTuple(
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            catalog_generation_id=gen.catalog_generation_id,
            action_type=e.action_type,
            handler_ref=e.handler_binding.handler_ref,
            entry_digest=e.entry_digest,
            binding_fingerprint=e.binding_fingerprint,
        )
        for e in entries
        if not e.contract_only
    ]


def _publish(
    client: Client,
    scope: Scope,
    release: str,
    tuples: list[catalog_v1.HandlerAvailabilityTuple],
    version: int = 5,
) -> int:
    accepted: int = client.call(
        "PublishHandlerAvailability",
        catalog_v1.PublishHandlerAvailabilityRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            runtime_release_id=release,
            supported_capability_version=version,
            tuples=tuples,
        ),
        client.scoped(scope),
    ).accepted_count
    return accepted


def _verify(
    client: Client, scope: Scope, release: str, ids: list[str] | None = None
) -> catalog_v1.VerifyRuntimeBinaryResponse:
    return client.call(
        "VerifyRuntimeBinary",
        catalog_v1.VerifyRuntimeBinaryRequest(
            scope=scope.proto(), runtime_release_id=release, catalog_generation_ids=ids or []
        ),
        client.scoped(scope),
    )


def _sealed(client: Client) -> tuple[Scope, catalog_v1.CatalogGeneration, list[Any]]:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    return scope, gen, client.list_entries(scope, gen.catalog_generation_id, gen.catalog_digest)


def test_binary_publishing_every_tuple_supports_the_generation(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    assert _publish(client, scope, "rt-1.0", _tuples(scope, gen, entries)) == 3

    verdict = _verify(client, scope, "rt-1.0", [gen.catalog_generation_id])
    assert verdict.supported
    assert [
        (g.catalog_generation_id, g.catalog_digest, g.supported) for g in verdict.generations
    ] == [(gen.catalog_generation_id, gen.catalog_digest, True)]


def test_missing_handler_is_a_gap(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    tuples = [t for t in _tuples(scope, gen, entries) if t.action_type != "core.send_email"]
    _publish(client, scope, "rt-1.0", tuples)

    verdict = _verify(client, scope, "rt-1.0", [gen.catalog_generation_id])
    assert not verdict.supported
    (gap,) = verdict.generations[0].gaps
    assert (gap.action_type, gap.reason) == (
        "core.send_email",
        GAP.BINDING_GAP_REASON_HANDLER_MISSING,
    )


def test_binding_fingerprint_mismatch_is_a_gap_never_a_fallback(client: Client) -> None:
    scope = client.tenant()
    old = client.build(scope, demo_entries())
    new_entries = [
        *demo_entries()[:2],
        entry("core.send_email", effect_descriptor(), version="9.9.9"),
    ]
    new = client.build(scope, new_entries)
    old_listed = client.list_entries(scope, old.catalog_generation_id, old.catalog_digest)
    # The binary carries the *old* handler implementation for the new generation.
    stale = _tuples(scope, new, old_listed)
    _publish(client, scope, "rt-old", stale)

    verdict = _verify(client, scope, "rt-old", [new.catalog_generation_id])
    gaps = {g.action_type: g.reason for g in verdict.generations[0].gaps}
    assert gaps == {"core.send_email": GAP.BINDING_GAP_REASON_FINGERPRINT_MISMATCH}


def test_entry_digest_mismatch_is_a_gap(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    tuples = _tuples(scope, gen, entries)
    other = next(e for e in entries if e.action_type == "core.format_name")
    for t in tuples:
        if t.action_type == "core.update_record":
            t.entry_digest = other.entry_digest  # right fingerprint, wrong entry
    _publish(client, scope, "rt-1.0", tuples)

    verdict = _verify(client, scope, "rt-1.0", [gen.catalog_generation_id])
    gaps = {g.action_type: g.reason for g in verdict.generations[0].gaps}
    assert gaps == {"core.update_record": GAP.BINDING_GAP_REASON_ENTRY_DIGEST_MISMATCH}


def test_binary_supporting_a_lower_capability_version_has_a_gap(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    _publish(client, scope, "rt-0.9", _tuples(scope, gen, entries), version=1)

    verdict = _verify(client, scope, "rt-0.9", [gen.catalog_generation_id])
    gaps = {g.action_type: g.reason for g in verdict.generations[0].gaps}
    # core.update_record needs capability version 2
    assert gaps == {"core.update_record": GAP.BINDING_GAP_REASON_CAPABILITY_VERSION_TOO_LOW}


def test_without_ids_the_generations_held_by_plans_and_runs_are_verified(client: Client) -> None:
    scope = client.tenant()
    planned, running, diagnostic, idle = (client.build(scope, demo_entries()) for _ in range(4))
    for gen, kind in (
        (planned, H.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN),
        (running, H.REFERENCE_HOLDER_KIND_NON_TERMINAL_RUN),
    ):
        client.call(
            "RegisterReference",
            catalog_v1.RegisterReferenceRequest(
                request_id=new_id("req"),
                scope=scope.proto(),
                reference=catalog_v1.ArtifactReference(
                    catalog_generation=catalog_v1.GenerationTarget(
                        catalog_generation_id=gen.catalog_generation_id,
                        catalog_digest=gen.catalog_digest,
                    ),
                    holder_kind=kind,
                    holder_id=new_id("holder"),
                ),
            ),
            client.scoped(scope),
        )
    del diagnostic, idle
    listed = client.list_entries(scope, planned.catalog_generation_id, planned.catalog_digest)
    _publish(client, scope, "rt-2", _tuples(scope, planned, listed))

    verdict = _verify(client, scope, "rt-2")
    checked = {g.catalog_generation_id: g.supported for g in verdict.generations}
    assert checked == {planned.catalog_generation_id: True, running.catalog_generation_id: False}
    assert [g.catalog_generation_id for g in verdict.generations] == sorted(checked)
    assert not verdict.supported


def test_republication_replaces_the_release_tuples(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    _publish(client, scope, "rt-1", _tuples(scope, gen, entries))
    assert _verify(client, scope, "rt-1", [gen.catalog_generation_id]).supported
    assert _publish(client, scope, "rt-1", []) == 0
    verdict = _verify(client, scope, "rt-1", [gen.catalog_generation_id])
    assert len(verdict.generations[0].gaps) == 3


def test_contract_only_entries_need_no_handler(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(
        scope,
        [
            demo_entries()[0],
            entry("core.update_record", demo_entries()[1].descriptor, contract_only=True),
        ],
    )
    listed = client.list_entries(scope, gen.catalog_generation_id, gen.catalog_digest)
    _publish(client, scope, "rt-1", _tuples(scope, gen, listed))
    assert _verify(client, scope, "rt-1", [gen.catalog_generation_id]).supported


def test_unknown_release_or_generation_is_not_found(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    err = _fails(lambda: _verify(client, scope, "never-published", [gen.catalog_generation_id]))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    _publish(client, scope, "rt-1", _tuples(scope, gen, entries))
    err = _fails(lambda: _verify(client, scope, "rt-1", ["gen-nope"]))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_tuples_for_an_unsealed_generation_are_not_accepted(client: Client) -> None:
    scope, gen, entries = _sealed(client)
    opened = client.open(scope)
    tuples = _tuples(scope, gen, entries)
    tuples[0].catalog_generation_id = opened.catalog_generation_id
    err = _fails(lambda: _publish(client, scope, "rt-1", tuples))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_verifying_against_an_unsealed_generation_is_a_failed_precondition(
    client: Client,
) -> None:
    scope, gen, entries = _sealed(client)
    opened = client.open(scope)
    _publish(client, scope, "rt-1", _tuples(scope, gen, entries))
    err = _fails(
        lambda: _verify(
            client, scope, "rt-1", [gen.catalog_generation_id, opened.catalog_generation_id]
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).field_path == "catalog_generation_ids[1]"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r, "runtime_release_id", ""), "runtime_release_id"),
        (lambda r: setattr(r, "supported_capability_version", 0), "supported_capability_version"),
        (lambda r: setattr(r.tuples[0], "entry_digest", "x"), "tuples[0].entry_digest"),
        (lambda r: r.tuples.append(r.tuples[0]), "tuples[3].action_type"),
    ],
)
def test_malformed_publication_is_invalid_argument(
    client: Client,
    mutate: Callable[[catalog_v1.PublishHandlerAvailabilityRequest], None],
    field: str,
) -> None:
    scope, gen, entries = _sealed(client)
    request = catalog_v1.PublishHandlerAvailabilityRequest(
        request_id=new_id("req"),
        scope=scope.proto(),
        runtime_release_id="rt-1",
        supported_capability_version=3,
        tuples=_tuples(scope, gen, entries),
    )
    mutate(request)
    err = _fails(lambda: client.call("PublishHandlerAvailability", request, client.scoped(scope)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == field
