"""Retention (§7.4, §8.4): a generation or metadata view held by an activated plan, a
non-terminal run or the diagnostic-retention window cannot be deleted."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from services.digest import versioned_digest
from services.proto import catalog_v1
from tests.integration.catalog.harness import (
    Client,
    Scope,
    demo_entries,
    demo_view,
    error_detail,
    new_id,
)

H = catalog_v1.ReferenceHolderKind
PLAN = H.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN
RUN = H.REFERENCE_HOLDER_KIND_NON_TERMINAL_RUN
DIAGNOSTIC = H.REFERENCE_HOLDER_KIND_DIAGNOSTIC_RETENTION


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _ts(delta: timedelta) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(datetime.now(UTC) + delta)
    return ts


def _generation_ref(
    gen: catalog_v1.CatalogGeneration, kind: int, holder: str, retain: Timestamp | None = None
) -> catalog_v1.ArtifactReference:
    ref = catalog_v1.ArtifactReference(
        catalog_generation=catalog_v1.GenerationTarget(
            catalog_generation_id=gen.catalog_generation_id, catalog_digest=gen.catalog_digest
        ),
        holder_kind=kind,
        holder_id=holder,
    )
    if retain is not None:
        ref.retain_until.CopyFrom(retain)
    return ref


def _view_ref(
    digest: str, kind: int = PLAN, holder: str = "plan-1"
) -> catalog_v1.ArtifactReference:
    return catalog_v1.ArtifactReference(
        metadata_view=catalog_v1.MetadataViewTarget(runtime_metadata_view_digest=digest),
        holder_kind=kind,
        holder_id=holder,
    )


def _register(client: Client, scope: Scope, ref: catalog_v1.ArtifactReference) -> Any:
    return client.call(
        "RegisterReference",
        catalog_v1.RegisterReferenceRequest(
            request_id=new_id("req"), scope=scope.proto(), reference=ref
        ),
        client.scoped(scope),
    ).reference


def _release(client: Client, scope: Scope, ref: catalog_v1.ArtifactReference) -> bool:
    released: bool = client.call(
        "ReleaseReference",
        catalog_v1.ReleaseReferenceRequest(
            request_id=new_id("req"), scope=scope.proto(), reference=ref
        ),
        client.scoped(scope),
    ).released
    return released


def _delete(client: Client, scope: Scope, gen: catalog_v1.CatalogGeneration) -> bool:
    deleted: bool = client.call(
        "DeleteGeneration",
        catalog_v1.DeleteGenerationRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            catalog_generation_id=gen.catalog_generation_id,
            catalog_digest=gen.catalog_digest,
        ),
        client.scoped(scope),
    ).deleted
    return deleted


def _delete_view(client: Client, scope: Scope, digest: str) -> bool:
    deleted: bool = client.call(
        "DeleteMetadataView",
        catalog_v1.DeleteMetadataViewRequest(
            request_id=new_id("req"),
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_metadata_view_digest=digest,
        ),
        client.md(scope.org_id, scope.app_installation_id),
    ).deleted
    return deleted


def _assert_held(client: Client, scope: Scope, gen: catalog_v1.CatalogGeneration) -> None:
    err = _fails(lambda: _delete(client, scope, gen))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).code == "artifact_referenced"
    assert client.get_generation(scope, gen.catalog_generation_id) == gen


@pytest.mark.parametrize(("kind", "holder"), [(PLAN, "plan-7"), (RUN, "run-42")])
def test_plan_or_run_reference_blocks_generation_delete_until_released(
    client: Client, kind: int, holder: str
) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    ref = _generation_ref(gen, kind, holder)
    stored = _register(client, scope, ref)
    assert stored.holder_kind == kind and stored.catalog_generation.catalog_digest == (
        gen.catalog_digest
    )

    _assert_held(client, scope, gen)
    assert _release(client, scope, ref) is True
    assert _delete(client, scope, gen) is True
    assert _delete(client, scope, gen) is False  # idempotent repeat
    err = _fails(lambda: client.get_generation(scope, gen.catalog_generation_id))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_diagnostic_retention_window_blocks_delete_while_it_lasts(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    _register(client, scope, _generation_ref(gen, DIAGNOSTIC, "retention", _ts(timedelta(hours=1))))
    _assert_held(client, scope, gen)


def test_expired_diagnostic_retention_window_no_longer_blocks_delete(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    stored = _register(
        client, scope, _generation_ref(gen, DIAGNOSTIC, "retention", _ts(-timedelta(hours=1)))
    )
    assert stored.HasField("retain_until")
    assert _delete(client, scope, gen) is True


def test_diagnostic_retention_reference_needs_retain_until(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    err = _fails(lambda: _register(client, scope, _generation_ref(gen, DIAGNOSTIC, "retention")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == "reference.retain_until"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r, "holder_kind", 0), "reference.holder_kind"),
        (lambda r: setattr(r, "holder_id", ""), "reference.holder_id"),
        (lambda r: r.ClearField("catalog_generation"), "reference.target"),
        (
            lambda r: setattr(r.catalog_generation, "catalog_digest", "nope"),
            "reference.catalog_generation.catalog_digest",
        ),
    ],
)
def test_malformed_reference_is_invalid_argument(
    client: Client, mutate: Callable[[catalog_v1.ArtifactReference], None], field: str
) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    ref = _generation_ref(gen, PLAN, "plan-1")
    mutate(ref)
    err = _fails(lambda: _register(client, scope, ref))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == field


def test_reference_registration_is_idempotent_and_release_reports_absence(
    client: Client,
) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())
    ref = _generation_ref(gen, PLAN, "plan-1")
    assert _register(client, scope, ref) == _register(client, scope, ref)
    assert _release(client, scope, ref) is True
    assert _release(client, scope, ref) is False
    assert _delete(client, scope, gen) is True


def test_reference_to_an_open_generation_or_another_digest_is_not_found(client: Client) -> None:
    scope = client.tenant()
    opened = client.open(scope)
    sealed = client.build(scope, demo_entries())
    wrong_digest = catalog_v1.CatalogGeneration()
    wrong_digest.CopyFrom(sealed)
    wrong_digest.catalog_digest = versioned_digest("catalog", {"other": True})
    for target in (opened, wrong_digest):
        opened_ref = _generation_ref(target, PLAN, "plan-1")
        if not opened_ref.catalog_generation.catalog_digest:
            opened_ref.catalog_generation.catalog_digest = versioned_digest("catalog", {})
        err = _fails(lambda ref=opened_ref: _register(client, scope, ref))
        assert err.code() == grpc.StatusCode.NOT_FOUND


def test_sealed_generation_delete_needs_its_catalog_digest(client: Client) -> None:
    scope = client.tenant()
    gen = client.build(scope, demo_entries())

    def delete(digest: str) -> Any:
        return client.call(
            "DeleteGeneration",
            catalog_v1.DeleteGenerationRequest(
                request_id=new_id("req"),
                scope=scope.proto(),
                catalog_generation_id=gen.catalog_generation_id,
                catalog_digest=digest,
            ),
            client.scoped(scope),
        )

    missing = _fails(lambda: delete(""))
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(missing).field_path == "catalog_digest"
    other = _fails(lambda: delete(versioned_digest("catalog", {"x": 1})))
    assert other.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(other).field_path == "catalog_digest"
    assert delete(gen.catalog_digest).deleted


def test_open_generation_can_be_deleted_without_a_digest(client: Client) -> None:
    scope = client.tenant()
    gen = client.open(scope)
    client.submit(scope, gen.catalog_generation_id, demo_entries()[0])
    deleted = client.call(
        "DeleteGeneration",
        catalog_v1.DeleteGenerationRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            catalog_generation_id=gen.catalog_generation_id,
        ),
        client.scoped(scope),
    ).deleted
    assert deleted


def test_referenced_metadata_view_cannot_be_deleted_until_released(client: Client) -> None:
    scope = client.tenant()  # its binding pins the demo view
    other = demo_view()
    other.objects[0].fields[0].max_length = 120
    digest = client.publish_view(
        scope.org_id, scope.app_installation_id, other
    ).runtime_metadata_view_digest
    ref = _view_ref(digest, RUN, "run-9")
    _register(client, scope, ref)

    err = _fails(lambda: _delete_view(client, scope, digest))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).code == "artifact_referenced"
    assert _release(client, scope, ref) is True
    assert _delete_view(client, scope, digest) is True


def test_metadata_view_bound_by_a_registered_binding_cannot_be_deleted(client: Client) -> None:
    scope = client.tenant()
    digest = demo_view_digest(client, scope)
    err = _fails(lambda: _delete_view(client, scope, digest))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).attributes["holder_kinds"] == "runtime_work_binding"


def demo_view_digest(client: Client, scope: Scope) -> str:
    got = client.call(
        "GetWorkBinding",
        catalog_v1.GetWorkBindingRequest(scope=scope.proto()),
        client.scoped(scope),
    ).work_binding
    digest: str = got.binding.runtime_metadata_view_digest
    return digest


def test_unreferenced_metadata_view_is_deleted_once_per_installation(client: Client) -> None:
    org = new_id("org")
    digest = client.publish_view(org, "inst-1").runtime_metadata_view_digest
    client.publish_view(org, "inst-2")
    inst1 = Scope(org, "inst-1", "", "")
    inst2 = Scope(org, "inst-2", "", "")

    assert _delete_view(client, inst1, digest) is True
    assert _delete_view(client, inst1, digest) is False
    # inst-2's publication of the same content is untouched.
    got = client.call(
        "GetMetadataView",
        catalog_v1.GetMetadataViewRequest(
            org_id=org, app_installation_id="inst-2", runtime_metadata_view_digest=digest
        ),
        client.md(org, "inst-2"),
    ).view
    assert got.runtime_metadata_view_digest == digest
    assert _delete_view(client, inst2, digest) is True
    err = _fails(
        lambda: client.call(
            "GetMetadataView",
            catalog_v1.GetMetadataViewRequest(
                org_id=org, app_installation_id="inst-2", runtime_metadata_view_digest=digest
            ),
            client.md(org, "inst-2"),
        )
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_generation_reference_does_not_hold_another_scope(client: Client) -> None:
    org = new_id("org")
    first = client.tenant(org, "inst-1", "cap-flow")
    second = client.tenant(org, "inst-1", "cap-other")
    a = client.build(first, demo_entries())
    b = client.build(second, demo_entries())
    _register(client, first, _generation_ref(a, PLAN, "plan-1"))
    assert _delete(client, second, b) is True  # a reference in another scope holds nothing
    _assert_held(client, first, a)


def test_reference_to_a_view_the_installation_never_published_is_not_found(
    client: Client,
) -> None:
    scope = client.tenant()
    foreign = demo_view()
    foreign.objects[0].fields[0].max_length = 77
    digest = client.publish_view(new_id("org"), "inst-1", foreign).runtime_metadata_view_digest
    err = _fails(lambda: _register(client, scope, _view_ref(digest)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
