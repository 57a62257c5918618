"""Scope discipline (§8.4, §10.0, §22.1, §22.6): every read and write is keyed by the
complete trusted scope, another scope answers exactly like a missing row, and a body
scope that disagrees with the credential is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from catalog_svc.domain import RuntimeWorkBindingDigest, compute_catalog_digest
from services.digest import versioned_digest
from services.proto import catalog_v1
from tests.integration.catalog.harness import (
    CatalogServer,
    Client,
    Scope,
    demo_entries,
    error_detail,
    new_id,
)


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _answer(fn: Callable[[], Any]) -> tuple[str, str, bytes]:
    """``(status, details, serialized ErrorDetail)`` of a call, or its response bytes."""
    try:
        response = fn()
    except grpc.RpcError as err:
        return (err.code().name, err.details() or "", error_detail(err).SerializeToString())
    return ("OK", "", response.SerializeToString())


_VARIANTS = {
    "other_org": lambda c, org: c.tenant(new_id("org"), "inst-1", "cap-flow"),
    "other_installation": lambda c, org: c.tenant(org, "inst-2", "cap-flow"),
    "other_capability": lambda c, org: c.tenant(org, "inst-1", "cap-other"),
    "other_binding": lambda c, org: c.tenant(org, "inst-1", "cap-flow", catalog_revision=8),
}


def _lookups(
    client: Client, scope: Scope, gid: str, digest: str, entry: catalog_v1.CatalogEntry
) -> dict[str, tuple[str, str, bytes]]:
    """Every lookup and write of generation ``gid`` from ``scope``."""
    sp, md = scope.proto(), client.scoped(scope)

    def call(rpc: str, request: Any) -> tuple[str, str, bytes]:
        return _answer(lambda: client.call(rpc, request, md))

    return {
        "GetGeneration": call(
            "GetGeneration", catalog_v1.GetGenerationRequest(scope=sp, catalog_generation_id=gid)
        ),
        "GetEntry": call(
            "GetEntry",
            catalog_v1.GetEntryRequest(
                scope=sp,
                catalog_generation_id=gid,
                catalog_digest=digest,
                action_type=entry.action_type,
                entry_digest=entry.entry_digest,
                binding_fingerprint=entry.binding_fingerprint,
            ),
        ),
        "ListEntries": call(
            "ListEntries",
            catalog_v1.ListEntriesRequest(
                scope=sp, catalog_generation_id=gid, catalog_digest=digest
            ),
        ),
        "SubmitEntry": call(
            "SubmitEntry",
            catalog_v1.SubmitEntryRequest(
                request_id=new_id("req"),
                scope=sp,
                catalog_generation_id=gid,
                action_type=demo_entries()[0].action_type,
                source=demo_entries()[0].source,
                descriptor=demo_entries()[0].descriptor,
                handler_binding=demo_entries()[0].handler_binding,
            ),
        ),
        "SealGeneration": call(
            "SealGeneration",
            catalog_v1.SealGenerationRequest(
                request_id=new_id("req"), scope=sp, catalog_generation_id=gid
            ),
        ),
        "RegisterReference": call(
            "RegisterReference",
            catalog_v1.RegisterReferenceRequest(
                request_id=new_id("req"),
                scope=sp,
                reference=catalog_v1.ArtifactReference(
                    catalog_generation=catalog_v1.GenerationTarget(
                        catalog_generation_id=gid, catalog_digest=digest
                    ),
                    holder_kind=catalog_v1.ReferenceHolderKind.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN,
                    holder_id="plan-1",
                ),
            ),
        ),
        "DeleteGeneration": call(
            "DeleteGeneration",
            catalog_v1.DeleteGenerationRequest(
                request_id=new_id("req"),
                scope=sp,
                catalog_generation_id=gid,
                catalog_digest=digest,
            ),
        ),
    }


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_generation_and_entry_lookups_from_another_scope_answer_exactly_like_missing_rows(
    client: Client, catalog_server: CatalogServer, variant: str
) -> None:
    org = new_id("org")
    owner = client.tenant(org, "inst-1", "cap-flow")
    other = _VARIANTS[variant](client, org)
    twin = client.tenant(new_id("org"), "inst-1", "cap-flow")  # holds the same id too
    # Entry digests do not depend on the scope: learn them from a throwaway tenant, so the
    # "missing" answers can be recorded before the owner's rows exist at all.
    probe = client.build(client.tenant(), demo_entries())
    probe_entries = {e.action_type: e for e in _probe_entries(client, probe)}
    mail = probe_entries["core.send_email"]
    digest = compute_catalog_digest(
        RuntimeWorkBindingDigest(owner.runtime_work_binding_digest),
        [e.entry_digest for e in probe_entries.values()],
    )
    shared = new_id("gen-shared")

    before = _lookups(client, other, shared, digest, mail)

    catalog_server.generation_ids[:] = [shared, shared]
    mine = client.build(owner, demo_entries())
    theirs = client.build(twin, demo_entries())
    assert mine.catalog_generation_id == theirs.catalog_generation_id == shared
    assert mine.catalog_digest == digest != theirs.catalog_digest

    after = _lookups(client, other, shared, digest, mail)

    assert after == before
    assert before["GetGeneration"][0] == "NOT_FOUND"
    assert before["GetEntry"][0] == "NOT_FOUND"
    assert before["RegisterReference"][0] == "NOT_FOUND"
    # Nothing leaked into or out of the owner's scope.
    assert client.get_generation(owner, shared) == mine
    assert client.get_generation(twin, shared) == theirs


def _probe_entries(
    client: Client, generation: catalog_v1.CatalogGeneration
) -> list[catalog_v1.CatalogEntry]:
    s = generation.scope
    scope = Scope(
        s.org_id, s.app_installation_id, s.runtime_capability_id, s.runtime_work_binding_digest
    )
    return client.list_entries(scope, generation.catalog_generation_id, generation.catalog_digest)


def test_binding_lookup_from_another_scope_answers_like_a_missing_binding(client: Client) -> None:
    owner = client.tenant()
    other = client.tenant()

    def get(digest: str) -> grpc.RpcError:
        scope = Scope(other.org_id, other.app_installation_id, other.runtime_capability_id, digest)
        return _fails(
            lambda: client.call(
                "GetWorkBinding",
                catalog_v1.GetWorkBindingRequest(scope=scope.proto()),
                client.scoped(scope),
            )
        )

    foreign = get(owner.runtime_work_binding_digest)
    missing = get(versioned_digest("runtime_work_binding", {"nobody": True}))
    assert foreign.code() == missing.code() == grpc.StatusCode.NOT_FOUND
    assert foreign.details() == missing.details()
    assert error_detail(foreign).code == error_detail(missing).code


@pytest.mark.parametrize(
    "component",
    ["org_id", "app_installation_id", "runtime_capability_id", "runtime_work_binding_digest"],
)
def test_body_scope_that_differs_from_the_credential_is_permission_denied(
    client: Client, component: str
) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    forged = scope.proto()
    setattr(
        forged,
        component,
        versioned_digest("runtime_work_binding", {"forged": 1})
        if component == "runtime_work_binding_digest"
        else "forged",
    )
    err = _fails(
        lambda: client.call(
            "GetGeneration",
            catalog_v1.GetGenerationRequest(
                scope=forged, catalog_generation_id=gen.catalog_generation_id
            ),
            client.scoped(scope),
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    detail = error_detail(err)
    assert (detail.code, detail.field_path) == ("scope_mismatch", f"scope.{component}")


def test_work_scoped_rpcs_need_the_complete_work_scope_in_the_credential(client: Client) -> None:
    scope = client.tenant()
    request = catalog_v1.OpenGenerationRequest(
        request_id=new_id("req"), scope=scope.proto(), contract_version=1
    )
    partial = client.md(scope.org_id, scope.app_installation_id, scope.runtime_capability_id)
    err = _fails(lambda: client.call("OpenGeneration", request, partial))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_detail(err).field_path == "scope.runtime_work_binding_digest"


def test_scope_components_are_required_in_the_body(client: Client) -> None:
    scope = client.tenant()
    partial = scope.proto()
    partial.runtime_capability_id = ""
    err = _fails(
        lambda: client.call(
            "OpenGeneration",
            catalog_v1.OpenGenerationRequest(
                request_id=new_id("req"), scope=partial, contract_version=1
            ),
            client.scoped(scope),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == "scope.runtime_capability_id"


def test_handler_tuples_of_another_binding_are_permission_denied(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    mail = {e.action_type: e for e in _probe_entries(client, gen)}["core.send_email"]
    err = _fails(
        lambda: client.call(
            "PublishHandlerAvailability",
            catalog_v1.PublishHandlerAvailabilityRequest(
                request_id=new_id("req"),
                scope=scope.proto(),
                runtime_release_id="rt-1",
                supported_capability_version=2,
                tuples=[
                    catalog_v1.HandlerAvailabilityTuple(
                        runtime_work_binding_digest=versioned_digest("runtime_work_binding", {}),
                        catalog_generation_id=gen.catalog_generation_id,
                        action_type=mail.action_type,
                        handler_ref=mail.handler_binding.handler_ref,
                        entry_digest=mail.entry_digest,
                        binding_fingerprint=mail.binding_fingerprint,
                    )
                ],
            ),
            client.scoped(scope),
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_detail(err).field_path == "tuples[0].runtime_work_binding_digest"
