"""The runtime (FlowDefinitionService, FlowRunService, RecordService) and the real catalog
service on loopback port 0, in one background event loop.

Both use the production bootstrap (``services.grpc_server.start_server``: error mapping,
credential verification, request-scope checks). The catalog is wired by
``catalog_svc.app.build_services`` over its own migrated database; the runtime services by
their ``build_*_service`` functions, reaching the catalog over gRPC with scope-bound
credentials. One key pair signs every credential; each test client's key id is trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.struct_pb2 import Struct
from sqlalchemy.ext.asyncio import AsyncEngine

from catalog_svc.app import build_services as build_catalog_services
from runtime_svc.api.definitions import build_definition_service
from runtime_svc.api.records import CatalogRecordViews, build_record_service
from runtime_svc.api.runs import build_run_service
from runtime_svc.catalog_client import ScopedCredentials
from services import db
from services.auth import CredentialVerifier, generate_keypair
from services.config import ServiceName
from services.grpc_server import start_server
from services.proto import catalog_v1, runtime_v1
from tests.integration.catalog.harness import KEY_ID as CATALOG_KEY_ID
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.catalog.harness import Scope, demo_entries
from tests.integration.definitions.fake_catalog import Published
from tests.integration.definitions.harness import KEY_ID as DEFINITIONS_KEY_ID
from tests.integration.definitions.harness import new_org
from tests.integration.runs.harness import RunClient
from tests.support.servers import BackgroundServers

__all__ = ["TriggerServers", "record_stub", "sealed_tenant", "struct"]


class TriggerServers(BackgroundServers):
    """Catalog + runtime in a background event loop; :meth:`stop` is idempotent."""

    def __init__(self, runtime_db_url: str, catalog_db_url: str, data_dir: Path) -> None:
        super().__init__(
            data_dir,
            {"FLOW_RUNTIME_DB_URL": runtime_db_url, "FLOW_CATALOG_DB_URL": catalog_db_url},
            name="trigger-servers",
        )
        self.runtime_db_url = runtime_db_url
        self.catalog_db_url = catalog_db_url
        self.private_key: Ed25519PrivateKey
        self.private_key, public = generate_keypair()
        keys = {CATALOG_KEY_ID: public, DEFINITIONS_KEY_ID: public}
        self._runtime_verifier = CredentialVerifier(keys, ServiceName.RUNTIME)
        self._catalog_verifier = CredentialVerifier(keys, ServiceName.CATALOG)
        self.runtime_port = 0
        self.catalog_port = 0
        #: The runtime's engine (tests count its transactions; set once started).
        self.runtime_engine: AsyncEngine | None = None

    async def serve(self) -> None:
        catalog_engine = db.create_engine(self.catalog_db_url, pool_size=4)
        runtime_engine = db.create_engine(self.runtime_db_url, pool_size=8)
        self.runtime_engine = runtime_engine
        try:
            catalog_cfg = self.cfg(ServiceName.CATALOG)
            catalog = await start_server(
                catalog_cfg,
                await build_catalog_services(catalog_cfg, catalog_engine),
                verifier=self._catalog_verifier,
            )
            self.catalog_port = catalog.port
            target = f"127.0.0.1:{catalog.port}"
            cfg = self.cfg(ServiceName.RUNTIME)
            registrations = [
                await build_definition_service(
                    cfg,
                    runtime_engine,
                    catalog_target=target,
                    credentials=ScopedCredentials(self.private_key, CATALOG_KEY_ID),
                ),
                await build_run_service(
                    cfg,
                    runtime_engine,
                    max_wait_s=2.0,
                    views=CatalogRecordViews(
                        grpc.aio.insecure_channel(target),
                        ScopedCredentials(self.private_key, CATALOG_KEY_ID),
                    ),
                ),
                await build_record_service(
                    cfg,
                    runtime_engine,
                    catalog_target=target,
                    credentials=ScopedCredentials(self.private_key, CATALOG_KEY_ID),
                ),
            ]
            runtime = await start_server(cfg, registrations, verifier=self._runtime_verifier)
            self.runtime_port = runtime.port
            await self.serving()
            await runtime.stop(0)
            await catalog.stop(0)
        finally:
            await runtime_engine.dispose()
            await catalog_engine.dispose()

    def run_client(self) -> RunClient:
        return RunClient(grpc.insecure_channel(f"127.0.0.1:{self.runtime_port}"), self.private_key)

    def catalog_client(self) -> CatalogClient:
        return CatalogClient(
            grpc.insecure_channel(f"127.0.0.1:{self.catalog_port}"), self.private_key
        )


def sealed_tenant(catalog: CatalogClient, view: catalog_v1.MetadataView | None = None) -> Published:
    """A fresh org with a published view (default: the demo view), a registered binding
    and a sealed generation of the demo entries; what a runtime request is bound to."""
    org = new_org()
    inst, cap = "inst-1", "cap-flow"
    published = catalog.publish_view(org, inst, view)
    registered = catalog.register_binding(org, inst, cap, published.runtime_metadata_view_digest)
    scope = Scope(org, inst, cap, registered.runtime_work_binding_digest)
    generation = catalog.build(scope, demo_entries())
    assert generation.state == catalog_v1.GenerationState.GENERATION_STATE_SEALED
    return Published(
        (org, inst, cap, scope.runtime_work_binding_digest),
        generation.runtime_work_binding,
        generation.runtime_work_binding.runtime_metadata_view_digest,
        generation.catalog_generation_id,
        generation.catalog_digest,
    )


def struct(**values: Any) -> Struct:
    """A ``google.protobuf.Struct`` of ``values`` (record fields of a request)."""
    s = Struct()
    s.update(values)
    return s


def record_stub(channel: grpc.Channel) -> Any:
    """The RecordService stub on ``channel``."""
    return runtime_v1.RecordServiceStub(channel)
