"""Runtime activation against the real catalog service (``catalog_svc``, in-process over
gRPC): the catalog artifacts a plan pins are retained through the catalog's own API while
the activation lives (§7.4, §8.4), and a generation of another scope never satisfies a
compile even when the generation ids collide.

The catalog database is SQLite; the runtime database runs on each backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.proto import catalog_v1, common_v1, runtime_v1
from tests.integration.catalog.harness import (
    KEY_ID as CATALOG_KEY_ID,
)
from tests.integration.catalog.harness import (
    CatalogServer,
    Scope,
    demo_entries,
    running_catalog,
)
from tests.integration.catalog.harness import (
    Client as CatalogClient,
)
from tests.integration.definitions.fake_catalog import Published
from tests.integration.definitions.harness import Client, Servers, new_org, new_request_id


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CatalogServer]:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('catalog') / 'catalog.db'}"
    with running_catalog(url, Path(tmp_path_factory.mktemp("catalog-data"))) as server:
        yield server


@pytest.fixture(scope="module")
def catalog_client(catalog: CatalogServer) -> Iterator[CatalogClient]:
    channel = grpc.insecure_channel(catalog.target)
    try:
        yield CatalogClient(channel, catalog.private_key)
    finally:
        channel.close()


@pytest.fixture(scope="module")
def runtime(
    module_db_url: str, catalog: CatalogServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Client]:
    servers = Servers(
        module_db_url,
        Path(tmp_path_factory.mktemp("runtime-data")),
        catalog_target=catalog.target,
        catalog_signer=(catalog.private_key, CATALOG_KEY_ID),
    ).start()
    client = servers.client()
    try:
        yield client
    finally:
        client.channel.close()
        servers.stop()


def _sealed(cat: CatalogClient, org: str, **kwargs: Any) -> Published:
    scope: Scope = cat.tenant(org, **kwargs)
    generation = cat.build(scope, demo_entries())
    assert generation.state == catalog_v1.GenerationState.GENERATION_STATE_SEALED
    view = generation.runtime_work_binding.runtime_metadata_view_digest
    key = (
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )
    return Published(
        key,
        generation.runtime_work_binding,
        view,
        generation.catalog_generation_id,
        generation.catalog_digest,
    )


def _welcome() -> dict[str, Any]:
    """Record-triggered on the demo view's ``Welcome`` subscription; sends an e-mail."""
    return {
        "api_name": "Welcome",
        "version": 1,
        "process_type": "record_triggered",
        "trigger": {"object": "Contact", "timing": "after_save", "events": ["create"]},
        "variables": [{"name": "msgId", "type": "string"}],
        "start": "mail",
        "elements": [
            {
                "api_name": "mail",
                "type": "ActionCall",
                "action_type": "core.send_email",
                "inputs": {"to": "$Record.Email"},
                "output_variable": "msgId",
                "fault": "failed",
            },
            {"api_name": "failed", "type": "Fault", "code": "MAIL", "message": "no mail"},
        ],
    }


def _delete_generation(cat: CatalogClient, pub: Published) -> Any:
    scope = Scope(*pub.scope)
    return cat.call(
        "DeleteGeneration",
        catalog_v1.DeleteGenerationRequest(
            request_id=new_request_id(),
            scope=scope.proto(),
            catalog_generation_id=pub.generation_id,
            catalog_digest=pub.catalog_digest,
        ),
        cat.scoped(scope),
    )


def test_activation_retains_the_pinned_generation_and_view_in_the_catalog(
    runtime: Client, catalog_client: CatalogClient
) -> None:
    org = new_org()
    pub = _sealed(catalog_client, org)
    fv = runtime.register(org, _welcome())
    compiled = runtime.compile(pub, fv.flow_version_id)
    assert compiled.compiled, [d.message for d in compiled.diagnostics]
    plan = compiled.plan
    assert (
        plan.execution_profile == common_v1.ExecutionProfile.EXECUTION_PROFILE_DURABLE_ORCHESTRATION
    )
    full = runtime.get_plan(org, plan.plan_id)
    (pin,) = full.payload.action_bindings
    assert pin.action_type == "core.send_email" and pin.binding_fingerprint

    runtime.activate(pub, fv.flow_version_id, plan)
    # The catalog refuses to delete what the active plan pins.
    with pytest.raises(grpc.RpcError) as err:
        _delete_generation(catalog_client, pub)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    scope = Scope(*pub.scope)
    with pytest.raises(grpc.RpcError) as err:
        catalog_client.call(
            "DeleteMetadataView",
            catalog_v1.DeleteMetadataViewRequest(
                request_id=new_request_id(),
                org_id=org,
                app_installation_id=scope.app_installation_id,
                runtime_metadata_view_digest=pub.view_digest,
            ),
            catalog_client.md(org, scope.app_installation_id),
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # Deactivation releases the references: the generation can go.
    ended = runtime.deactivate(pub, fv.flow_version_id)
    assert ended.state == runtime_v1.ActivationState.ACTIVATION_STATE_DEACTIVATED
    assert _delete_generation(catalog_client, pub).deleted
    # The plan row outlives nothing it needs to run: re-activation cannot silently rebind.
    with pytest.raises(grpc.RpcError) as err:
        runtime.activate(pub, fv.flow_version_id, plan)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_colliding_generation_id_of_another_scope_never_satisfies_a_compile(
    runtime: Client, catalog: CatalogServer, catalog_client: CatalogClient
) -> None:
    org = new_org()
    shared = f"gen-shared-{new_request_id()[:8]}"
    catalog.generation_ids.extend([shared, shared])
    mine = _sealed(catalog_client, org)
    theirs = _sealed(catalog_client, org, inst="inst-2")
    assert mine.generation_id == theirs.generation_id == shared
    assert mine.scope != theirs.scope
    fv = runtime.register(org, _welcome())
    # The digest of the other scope's generation does not match under my scope.
    with pytest.raises(grpc.RpcError) as err:
        runtime.compile(mine, fv.flow_version_id, catalog_digest=theirs.catalog_digest)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    ok = runtime.compile(mine, fv.flow_version_id)
    assert ok.compiled
    assert ok.plan.catalog_generation.scope.runtime_work_binding_digest == mine.scope[3]
