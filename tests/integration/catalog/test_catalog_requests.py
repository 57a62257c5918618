"""Request deduplication on ``(trusted org, rpc, request_id)`` (request_response.proto):
a retry returns the original response; a reuse with another body is INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from services.proto import catalog_v1
from tests.integration.catalog.harness import (
    Client,
    demo_entries,
    demo_view,
    entry,
    error_detail,
    new_id,
    pure_descriptor,
)


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def test_retried_open_generation_returns_the_original_generation(client: Client) -> None:
    scope = client.tenant()
    request = catalog_v1.OpenGenerationRequest(
        request_id=new_id("req"), scope=scope.proto(), contract_version=1
    )
    first = client.call("OpenGeneration", request, client.scoped(scope))
    client.submit(scope, first.generation.catalog_generation_id, demo_entries()[0])
    retry = client.call("OpenGeneration", request, client.scoped(scope))

    assert retry == first  # the original response, byte for byte (entry_count still 0)
    fresh = client.open(scope)
    assert fresh.catalog_generation_id != first.generation.catalog_generation_id


def test_request_id_reused_for_another_body_is_invalid_argument(client: Client) -> None:
    scope = client.tenant()
    rid = new_id("req")
    client.call(
        "OpenGeneration",
        catalog_v1.OpenGenerationRequest(request_id=rid, scope=scope.proto(), contract_version=1),
        client.scoped(scope),
    )
    # The same id on another RPC is another key.
    sealed = client.call(
        "SealGeneration",
        catalog_v1.SealGenerationRequest(
            request_id=rid,
            scope=scope.proto(),
            catalog_generation_id=client.open(scope).catalog_generation_id,
        ),
        client.scoped(scope),
    ).generation
    assert sealed.state == catalog_v1.GenerationState.GENERATION_STATE_SEALED
    gen = client.open(scope)
    submit = demo_entries()[0]
    submit.request_id = new_id("req")
    client.submit(scope, gen.catalog_generation_id, submit)
    other = demo_entries()[1]
    other.request_id = submit.request_id
    reused = _fails(lambda: client.submit(scope, gen.catalog_generation_id, other))
    assert reused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error_detail(reused).code, error_detail(reused).field_path) == (
        "request_id_reused",
        "request_id",
    )


def test_retried_submit_and_delete_return_the_original_responses(client: Client) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    submit = demo_entries()[0]
    submit.request_id = new_id("req")
    first = client.submit(scope, gen.catalog_generation_id, submit)
    assert client.submit(scope, gen.catalog_generation_id, submit) == first  # not already_present

    delete = catalog_v1.DeleteGenerationRequest(
        request_id=new_id("req"),
        scope=scope.proto(),
        catalog_generation_id=gen.catalog_generation_id,
    )
    assert client.call("DeleteGeneration", delete, client.scoped(scope)).deleted
    assert client.call("DeleteGeneration", delete, client.scoped(scope)).deleted  # the original


def test_request_ids_are_scoped_by_the_trusted_org(client: Client) -> None:
    a, b = client.tenant(), client.tenant()
    rid = new_id("req")
    opened = [
        client.call(
            "OpenGeneration",
            catalog_v1.OpenGenerationRequest(request_id=rid, scope=s.proto(), contract_version=1),
            client.scoped(s),
        ).generation
        for s in (a, b)
    ]
    assert opened[0].scope.org_id == a.org_id and opened[1].scope.org_id == b.org_id
    assert opened[0].catalog_generation_id != opened[1].catalog_generation_id


def test_mutating_request_without_a_request_id_is_invalid_argument(client: Client) -> None:
    scope = client.tenant()
    err = _fails(
        lambda: client.call(
            "OpenGeneration",
            catalog_v1.OpenGenerationRequest(scope=scope.proto(), contract_version=1),
            client.scoped(scope),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == "request_id"


def test_concurrent_retries_of_one_open_generation_create_one_generation(client: Client) -> None:
    scope = client.tenant()
    request = catalog_v1.OpenGenerationRequest(
        request_id=new_id("req"), scope=scope.proto(), contract_version=1
    )
    md = client.scoped(scope)
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda _: client.call("OpenGeneration", request, md), range(6)))
    assert len({r.generation.catalog_generation_id for r in results}) == 1


def test_concurrent_submissions_into_one_generation_all_land(client: Client) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    names = [f"core.action_{i}" for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(
            pool.map(
                lambda n: client.submit(
                    scope, gen.catalog_generation_id, entry(n, pure_descriptor())
                ),
                names,
            )
        )
    assert not any(r.already_present for r in responses)
    sealed = client.seal(scope, gen.catalog_generation_id)
    assert sealed.entry_count == len(names)
    listed = client.list_entries(scope, sealed.catalog_generation_id, sealed.catalog_digest)
    assert [e.action_type for e in listed] == sorted(names)


def test_retried_release_returns_the_original_response_not_a_re_execution(
    client: Client,
) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    ref = catalog_v1.ArtifactReference(
        catalog_generation=catalog_v1.GenerationTarget(
            catalog_generation_id=gen.catalog_generation_id, catalog_digest=gen.catalog_digest
        ),
        holder_kind=catalog_v1.ReferenceHolderKind.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN,
        holder_id="plan-1",
    )
    register = catalog_v1.RegisterReferenceRequest(
        request_id=new_id("req"), scope=scope.proto(), reference=ref
    )
    first = client.call("RegisterReference", register, client.scoped(scope))
    release = catalog_v1.ReleaseReferenceRequest(
        request_id=new_id("req"), scope=scope.proto(), reference=ref
    )
    assert client.call("ReleaseReference", release, client.scoped(scope)).released
    # The retry answers what the first call answered (a re-execution would say False) ...
    assert client.call("ReleaseReference", release, client.scoped(scope)).released
    # ... and a retried registration replays its original response without re-registering.
    assert client.call("RegisterReference", register, client.scoped(scope)) == first
    deleted = client.call(
        "DeleteGeneration",
        catalog_v1.DeleteGenerationRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            catalog_generation_id=gen.catalog_generation_id,
            catalog_digest=gen.catalog_digest,
        ),
        client.scoped(scope),
    )
    assert deleted.deleted


def test_request_ids_are_scoped_by_the_complete_work_scope(client: Client) -> None:
    """Two installations of one org reusing a request id never see each other's request."""
    org = new_id("org")
    a = client.tenant(org, inst="inst-a")
    b = client.tenant(org, inst="inst-b")
    rid = new_id("req")
    opened = [
        client.call(
            "OpenGeneration",
            catalog_v1.OpenGenerationRequest(request_id=rid, scope=s.proto(), contract_version=1),
            client.scoped(s),
        ).generation
        for s in (a, b)
    ]
    assert [g.scope.app_installation_id for g in opened] == ["inst-a", "inst-b"]
    assert opened[0].catalog_generation_id != opened[1].catalog_generation_id
    # And a view publication of the same id by each installation is its own request.
    views = [
        client.call(
            "PublishMetadataView",
            catalog_v1.PublishMetadataViewRequest(
                request_id=rid + "-view",
                org_id=org,
                view=_view_of(org, s.app_installation_id),
            ),
            client.md(org, s.app_installation_id),
        ).view
        for s in (a, b)
    ]
    assert [v.app_installation_id for v in views] == ["inst-a", "inst-b"]


def _view_of(org: str, inst: str) -> catalog_v1.MetadataView:
    view = demo_view()
    view.org_id, view.app_installation_id = org, inst
    return view
