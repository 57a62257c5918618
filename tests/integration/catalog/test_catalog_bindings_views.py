"""RuntimeWorkBinding and RuntimeMetadataView RPCs through a running catalog (§7.1, §10.0)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from catalog_svc.domain import RuntimeWorkBinding
from services.auth import WorkloadClaims, bearer_metadata, generate_keypair, mint_credential
from services.config import ServiceName
from services.proto import catalog_v1
from tests.integration.catalog.harness import (
    KEY_ID,
    Client,
    binding_proto,
    demo_view,
    error_detail,
    new_id,
)

F = catalog_v1.FieldType


def _fails(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


# -- bindings ---------------------------------------------------------------------------


def test_register_work_binding_returns_the_canonical_digest_and_is_idempotent(
    client: Client,
) -> None:
    org = new_id("org")
    view = client.publish_view(org, "inst-1")
    first = client.register_binding(org, "inst-1", "cap-flow", view.runtime_metadata_view_digest)
    again = client.register_binding(org, "inst-1", "cap-flow", view.runtime_metadata_view_digest)

    b = first.binding
    expected = RuntimeWorkBinding(
        b.org_id,
        b.app_installation_id,
        b.runtime_capability_id,
        b.catalog_revision,
        b.schema_generation,
        b.engine_generation,
        b.catalog_snapshot_digest,
        b.runtime_metadata_view_digest,
    ).digest()
    assert first.runtime_work_binding_digest == expected
    assert again == first  # same digest, same first registration time
    other = client.register_binding(
        org, "inst-1", "cap-flow", view.runtime_metadata_view_digest, catalog_revision=8
    )
    assert other.runtime_work_binding_digest != first.runtime_work_binding_digest


def test_get_work_binding_reads_by_the_complete_scope(client: Client) -> None:
    scope = client.tenant()
    got = client.call(
        "GetWorkBinding",
        catalog_v1.GetWorkBindingRequest(scope=scope.proto()),
        client.scoped(scope),
    ).work_binding
    assert got.runtime_work_binding_digest == scope.runtime_work_binding_digest
    assert got.binding.org_id == scope.org_id
    assert got.HasField("registered_at")


def test_register_binding_refuses_a_view_the_installation_never_published(client: Client) -> None:
    org = new_id("org")
    view = client.publish_view(org, "inst-1")
    # inst-2 of the same org never published it: the binding cannot be verified.
    err = _fails(
        lambda: client.register_binding(org, "inst-2", "cap", view.runtime_metadata_view_digest)
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err).field_path == "binding.runtime_metadata_view_digest"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"catalog_revision": 0}, "binding.catalog_revision"),
        ({"engine_generation": -1}, "binding.engine_generation"),
        ({"catalog_snapshot_digest": "not-a-digest"}, "binding.catalog_snapshot_digest"),
        ({"runtime_metadata_view_digest": ""}, "binding.runtime_metadata_view_digest"),
        ({"runtime_capability_id": "bad id"}, "binding.runtime_capability_id"),
        ({"runtime_capability_id": "c" * 65}, "binding.runtime_capability_id"),
    ],
)
def test_register_binding_invalid_fields_name_the_field(
    client: Client, override: dict[str, Any], field: str
) -> None:
    org = new_id("org")
    view = client.publish_view(org, "inst-1")
    cap = override.get("runtime_capability_id", "cap")
    binding = binding_proto(org, "inst-1", "cap", view.runtime_metadata_view_digest, **override)
    err = _fails(
        lambda: client.call(
            "RegisterWorkBinding",
            catalog_v1.RegisterWorkBindingRequest(
                request_id=new_id("req"), org_id=org, binding=binding
            ),
            client.md(org, "inst-1", cap),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == field


def test_register_binding_for_another_org_is_permission_denied(client: Client) -> None:
    org, other = new_id("org"), new_id("org")
    view = client.publish_view(org, "inst-1")
    binding = binding_proto(other, "inst-1", "cap", view.runtime_metadata_view_digest)
    err = _fails(
        lambda: client.call(
            "RegisterWorkBinding",
            catalog_v1.RegisterWorkBindingRequest(
                request_id=new_id("req"), org_id=org, binding=binding
            ),
            client.md(org, "inst-1", "cap"),
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_detail(err).field_path == "binding.org_id"


def test_register_binding_needs_installation_and_capability_in_the_credential(
    client: Client,
) -> None:
    org = new_id("org")
    view = client.publish_view(org, "inst-1")
    binding = binding_proto(org, "inst-1", "cap", view.runtime_metadata_view_digest)
    request = catalog_v1.RegisterWorkBindingRequest(
        request_id=new_id("req"), org_id=org, binding=binding
    )
    for md in (client.md(org), client.md(org, "inst-1")):
        err = _fails(lambda md=md: client.call("RegisterWorkBinding", request, md))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_detail(err).code == "scope_mismatch"


# -- metadata views ---------------------------------------------------------------------


def test_publish_view_is_content_addressed_and_idempotent(client: Client) -> None:
    org = new_id("org")
    first = client.publish_view(org, "inst-1")

    reordered = demo_view()
    reordered.objects[0].label = "Customer account"  # a display label is not content
    objects = list(reordered.objects)[::-1]
    del reordered.objects[:]
    reordered.objects.extend(objects)
    fields = list(reordered.objects[0].fields)[::-1]
    del reordered.objects[0].fields[:]
    reordered.objects[0].fields.extend(fields)
    again = client.publish_view(org, "inst-1", reordered)

    assert again.runtime_metadata_view_digest == first.runtime_metadata_view_digest
    assert again == first  # the stored artifact, including its first publication time
    changed = demo_view()
    changed.objects[0].fields[0].max_length = 81
    assert (
        client.publish_view(org, "inst-1", changed).runtime_metadata_view_digest
        != first.runtime_metadata_view_digest
    )


def test_identical_content_for_another_schema_generation_is_refused(client: Client) -> None:
    """The catalog never answers a publication for generation 4 with the stored
    publication of generation 3 (issue 10 item 8)."""
    org = new_id("org")
    first = client.publish_view(org, "inst-1")
    assert first.schema_generation == 3
    newer = demo_view()
    newer.schema_generation = 4
    err = _fails(lambda: client.publish_view(org, "inst-1", newer))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(err)
    assert detail.code == "metadata_view_schema_generation_conflict"
    assert detail.field_path == "view.schema_generation"
    assert detail.attributes["published_schema_generation"] == "3"
    # The same generation stays idempotent; another installation publishes freely.
    assert client.publish_view(org, "inst-1") == first
    assert client.publish_view(org, "inst-2", newer).schema_generation == 4


def test_get_metadata_view_returns_the_published_artifact(client: Client) -> None:
    org = new_id("org")
    published = client.publish_view(org, "inst-1")
    got = client.call(
        "GetMetadataView",
        catalog_v1.GetMetadataViewRequest(
            org_id=org,
            app_installation_id="inst-1",
            runtime_metadata_view_digest=published.runtime_metadata_view_digest,
        ),
        client.md(org, "inst-1"),
    ).view
    assert got == published
    assert [o.api_name for o in got.objects] == ["Account", "Contact"]
    assert got.relationships[0].lock_relevant
    assert got.trigger_subscriptions[0].entry_condition == "ISCHANGED(Email)"
    assert got.schema_generation == 3


def _bad_reference(v: catalog_v1.MetadataView) -> None:
    v.objects[1].fields[0].reference_object_api_name = "Nope"


def _unknown_type(v: catalog_v1.MetadataView) -> None:
    v.objects[0].fields[0].type = 77  # type: ignore[assignment]


def _multi_picklist_without_values(v: catalog_v1.MetadataView) -> None:
    v.objects[0].fields[1].type = F.FIELD_TYPE_MULTI_PICKLIST
    v.objects[0].fields[1].ClearField("precision")
    v.objects[0].fields[1].ClearField("scale")


def _required_read_only(v: catalog_v1.MetadataView) -> None:
    v.objects[0].fields[0].read_only = True


def _not_lock_relevant(v: catalog_v1.MetadataView) -> None:
    v.relationships[0].lock_relevant = False


def _no_schema_generation(v: catalog_v1.MetadataView) -> None:
    v.schema_generation = 0


def _duplicate_field(v: catalog_v1.MetadataView) -> None:
    v.objects[0].fields.add(api_name="name", type=F.FIELD_TYPE_STRING)


@pytest.mark.parametrize(
    ("mutate", "field", "code"),
    [
        (
            _bad_reference,
            "view.objects[1].fields[0].reference_object_api_name",
            "dangling_reference",
        ),
        (_unknown_type, "view.objects[0].fields[0].type", "unknown_enum_value"),
        (
            _multi_picklist_without_values,
            "view.objects[0].fields[1].picklist_values",
            "missing_field",
        ),
        (_required_read_only, "view.objects[0].fields[0].read_only", "inconsistent"),
        (_not_lock_relevant, "view.relationships[0].lock_relevant", "unknown_field"),
        (_no_schema_generation, "view.schema_generation", "out_of_range"),
        (_duplicate_field, "view.objects[0].fields[2]", "duplicate_name"),
    ],
)
def test_publish_view_invalid_content_names_the_field(
    client: Client, mutate: Callable[[catalog_v1.MetadataView], None], field: str, code: str
) -> None:
    org = new_id("org")
    view = demo_view()
    mutate(view)
    err = _fails(lambda: client.publish_view(org, "inst-1", view))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(err)
    assert (detail.field_path, detail.code) == (field, code)


def test_view_of_another_installation_answers_like_a_missing_view(client: Client) -> None:
    org = new_id("org")
    published = client.publish_view(org, "inst-1")

    def get(digest: str) -> grpc.RpcError:
        return _fails(
            lambda: client.call(
                "GetMetadataView",
                catalog_v1.GetMetadataViewRequest(
                    org_id=org, app_installation_id="inst-2", runtime_metadata_view_digest=digest
                ),
                client.md(org, "inst-2"),
            )
        )

    other = get(published.runtime_metadata_view_digest)
    changed = demo_view()
    changed.schema_generation = 4
    changed.objects[0].fields[0].max_length = 99
    missing_digest = client.publish_view(new_id("org"), "x", changed).runtime_metadata_view_digest
    missing = get(missing_digest)
    assert other.code() == missing.code() == grpc.StatusCode.NOT_FOUND
    assert other.details() == missing.details()
    assert error_detail(other).code == error_detail(missing).code == "not_found"
    # inst-2 may publish the identical content itself and then read it.
    assert (
        client.publish_view(org, "inst-2").runtime_metadata_view_digest
        == published.runtime_metadata_view_digest
    )


def test_view_request_outside_the_credential_scope_is_permission_denied(client: Client) -> None:
    org = new_id("org")
    published = client.publish_view(org, "inst-1")
    err = _fails(
        lambda: client.call(
            "GetMetadataView",
            catalog_v1.GetMetadataViewRequest(
                org_id=org,
                app_installation_id="inst-2",
                runtime_metadata_view_digest=published.runtime_metadata_view_digest,
            ),
            client.md(org, "inst-1"),
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_detail(err).field_path == "app_installation_id"

    view = demo_view()
    view.org_id, view.app_installation_id = new_id("org"), "inst-1"
    err = _fails(
        lambda: client.call(
            "PublishMetadataView",
            catalog_v1.PublishMetadataViewRequest(request_id=new_id("req"), org_id=org, view=view),
            client.md(org, "inst-1"),
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_detail(err).field_path == "view.org_id"


def test_unauthenticated_calls_are_refused(client: Client) -> None:
    request = catalog_v1.GetMetadataViewRequest(org_id="org-x", app_installation_id="inst-1")
    missing = _fails(lambda: client.stub.GetMetadataView(request, timeout=30))
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED

    untrusted, _ = generate_keypair()
    forged = bearer_metadata(
        mint_credential(
            untrusted,
            KEY_ID,
            WorkloadClaims("intruder", (ServiceName.CATALOG,), "org-x", "inst-1"),
            ttl_s=300,
        )
    )
    bad = _fails(lambda: client.stub.GetMetadataView(request, metadata=forged, timeout=30))
    assert bad.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_detail(bad).code == "credential_bad_signature"


def test_missing_request_fields_are_invalid_argument_naming_the_field(client: Client) -> None:
    org = new_id("org")
    view = client.publish_view(org, "inst-1")
    digest = view.runtime_metadata_view_digest
    binding = binding_proto(org, "inst-1", "cap", digest)
    cases: list[tuple[str, Any, Any, str]] = [
        (
            "RegisterWorkBinding",
            catalog_v1.RegisterWorkBindingRequest(request_id=new_id("r"), binding=binding),
            client.md(org, "inst-1", "cap"),
            "org_id",
        ),
        (
            "RegisterWorkBinding",
            catalog_v1.RegisterWorkBindingRequest(request_id=new_id("r"), org_id=org),
            client.md(org, "inst-1", "cap"),
            "binding",
        ),
        (
            "PublishMetadataView",
            catalog_v1.PublishMetadataViewRequest(request_id=new_id("r"), org_id=org),
            client.md(org, "inst-1"),
            "view",
        ),
        (
            "GetMetadataView",
            catalog_v1.GetMetadataViewRequest(org_id=org, runtime_metadata_view_digest=digest),
            client.md(org, "inst-1"),
            "app_installation_id",
        ),
        (
            "GetMetadataView",
            catalog_v1.GetMetadataViewRequest(
                org_id=org, app_installation_id="inst-1", runtime_metadata_view_digest="abc"
            ),
            client.md(org, "inst-1"),
            "runtime_metadata_view_digest",
        ),
        (
            "DeleteMetadataView",
            catalog_v1.DeleteMetadataViewRequest(
                request_id="x" * 201,
                org_id=org,
                app_installation_id="inst-1",
                runtime_metadata_view_digest=digest,
            ),
            client.md(org, "inst-1"),
            "request_id",
        ),
    ]
    for rpc, request, md, field in cases:
        err = _fails(lambda rpc=rpc, request=request, md=md: client.call(rpc, request, md))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, field)
        assert error_detail(err).field_path == field, rpc
