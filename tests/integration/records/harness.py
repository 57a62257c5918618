"""The runtime's RecordService and the real catalog service on loopback port 0.

Both run with the production bootstrap (``services.grpc_server.start_server``: error
mapping, credential verification, request-scope checks) in one background thread with its
own event loop, so tests call them with plain synchronous stubs. The catalog is wired by
``catalog_svc.app.build_services`` over its own migrated database; the record service by
:func:`runtime_svc.api.records.build_record_service` in its production shape (no view
source injected: it reaches the catalog over gRPC with scope-bound credentials).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from catalog_svc.app import build_services as build_catalog_services
from runtime_svc.api.records import build_record_service
from services import db
from services.auth import (
    CredentialVerifier,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    generate_keypair,
    mint_credential,
)
from services.config import ServiceName
from services.digest import versioned_digest
from services.grpc_server import start_server
from services.proto import catalog_v1, common_v1, runtime_v1
from tests.integration.records.support import view_proto
from tests.support.servers import BackgroundServers, workload_metadata
from tests.support.servers import Scope as Scope
from tests.support.servers import error_detail as error_detail
from tests.support.servers import new_id as new_id

KEY_ID = "records-test"


class RecordServers(BackgroundServers):
    """Catalog + RecordService in a background event loop; :meth:`stop` is idempotent."""

    def __init__(self, runtime_db_url: str, catalog_db_url: str, data_dir: Path) -> None:
        super().__init__(
            data_dir,
            {"FLOW_RUNTIME_DB_URL": runtime_db_url, "FLOW_CATALOG_DB_URL": catalog_db_url},
            name="records-servers",
        )
        self.runtime_db_url = runtime_db_url
        self.catalog_db_url = catalog_db_url
        self.private_key, public = generate_keypair()
        self._runtime_verifier = CredentialVerifier({KEY_ID: public}, ServiceName.RUNTIME)
        self._catalog_verifier = CredentialVerifier({KEY_ID: public}, ServiceName.CATALOG)
        self.runtime_port = 0
        self.catalog_port = 0

    async def serve(self) -> None:
        catalog_engine = db.create_engine(self.catalog_db_url, pool_size=4)
        runtime_engine = db.create_engine(self.runtime_db_url, pool_size=8)
        try:
            catalog_cfg = self.cfg(ServiceName.CATALOG)
            catalog = await start_server(
                catalog_cfg,
                await build_catalog_services(catalog_cfg, catalog_engine),
                verifier=self._catalog_verifier,
            )
            self.catalog_port = catalog.port
            cfg = self.cfg(ServiceName.RUNTIME)
            registration = await build_record_service(
                cfg,
                runtime_engine,
                catalog_target=f"127.0.0.1:{catalog.port}",
                credentials=self.catalog_credential,
            )
            runtime = await start_server(cfg, [registration], verifier=self._runtime_verifier)
            self.runtime_port = runtime.port
            await self.serving()
            await runtime.stop(0)
            await catalog.stop(0)
        finally:
            await runtime_engine.dispose()
            await catalog_engine.dispose()

    def catalog_credential(self, scope: TrustedRuntimeWorkScope) -> str:
        """What ``runtime_svc.catalog_client.ScopedCredentials`` mints for ``scope``."""
        claims = WorkloadClaims(
            subject="runtime",
            audiences=(ServiceName.CATALOG,),
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
        )
        return mint_credential(self.private_key, KEY_ID, claims, ttl_s=300)


@dataclass
class Clients:
    """Synchronous RecordService and CatalogService stubs plus credential minting."""

    runtime_channel: grpc.Channel
    catalog_channel: grpc.Channel
    private_key: Ed25519PrivateKey
    records: Any = field(init=False)
    catalog: Any = field(init=False)

    def __post_init__(self) -> None:
        self.records = runtime_v1.RecordServiceStub(self.runtime_channel)
        self.catalog = catalog_v1.CatalogServiceStub(self.catalog_channel)

    def md(
        self,
        audience: ServiceName,
        org: str,
        inst: str | None = None,
        cap: str | None = None,
        digest: str | None = None,
    ) -> tuple[tuple[str, str], ...]:
        return workload_metadata(
            self.private_key, KEY_ID, audience, org, inst, cap, digest, subject="records-test"
        )

    def runtime_md(self, scope: Scope) -> tuple[tuple[str, str], ...]:
        return self.md(
            ServiceName.RUNTIME,
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
        )

    def tenant(self, org: str | None = None) -> Scope:
        """Publish the test view and register a binding in the real catalog."""
        org, inst, cap = org or new_id("org"), "inst-1", "cap-records"
        view = view_proto()
        view.org_id, view.app_installation_id = org, inst
        published = self.catalog.PublishMetadataView(
            catalog_v1.PublishMetadataViewRequest(request_id=new_id("req"), org_id=org, view=view),
            metadata=self.md(ServiceName.CATALOG, org, inst),
            timeout=30,
        ).view
        binding = common_v1.RuntimeWorkBinding(
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            catalog_revision=1,
            schema_generation=1,
            engine_generation=1,
            catalog_snapshot_digest=versioned_digest("catalog_snapshot", {"rev": 1}),
            runtime_metadata_view_digest=published.runtime_metadata_view_digest,
        )
        registered = self.catalog.RegisterWorkBinding(
            catalog_v1.RegisterWorkBindingRequest(
                request_id=new_id("req"), org_id=org, binding=binding
            ),
            metadata=self.md(ServiceName.CATALOG, org, inst, cap),
            timeout=30,
        ).work_binding
        return Scope(org, inst, cap, registered.runtime_work_binding_digest)

    def call(self, rpc: str, request: Any, scope: Scope) -> Any:
        return getattr(self.records, rpc)(request, metadata=self.runtime_md(scope), timeout=30)
