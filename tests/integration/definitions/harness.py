"""The runtime's FlowDefinitionService and a catalog service on loopback port 0.

Both servers run with the production bootstrap (``services.grpc_server.start_server``:
error mapping, real credential verification and request-scope checks) in a background
thread with its own event loop, so tests call them with plain synchronous stubs, exactly
as any client would. One pair of servers (over one migrated database) serves a whole
test module; every test works in freshly named orgs.

The runtime is wired the way ``runtime_svc.app`` wires it
(:func:`runtime_svc.api.definitions.build_definition_service`) and reaches the catalog
over gRPC with scope-bound credentials; the catalog is :class:`FakeCatalog` (the proto
contract), or a real catalog at ``catalog_target``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from runtime_svc.api.definitions import build_definition_service
from runtime_svc.catalog_client import ScopedCredentials
from services import db
from services.auth import (
    CredentialVerifier,
    generate_keypair,
)
from services.config import ServiceName
from services.grpc_server import ServiceRegistration, start_server
from services.proto import catalog_v1, runtime_v1
from tests.integration.definitions.fake_catalog import FakeCatalog, Published
from tests.support.servers import BackgroundServers, workload_metadata
from tests.support.servers import error_detail as error_detail

KEY_ID = "definitions-test"


class Servers(BackgroundServers):
    """Runtime (FlowDefinitionService) and fake catalog in one background event loop."""

    def __init__(
        self,
        db_url: str,
        data_dir: Path,
        *,
        catalog_target: str | None = None,
        catalog_signer: tuple[Ed25519PrivateKey, str] | None = None,
    ) -> None:
        """Serve the runtime over ``db_url``; with ``catalog_target`` (and the key the
        catalog trusts, ``catalog_signer``) use that catalog instead of a fake one."""
        super().__init__(data_dir, {"FLOW_RUNTIME_DB_URL": db_url}, name="definitions-servers")
        self.db_url = db_url
        self.catalog_target = catalog_target
        self.catalog_signer = catalog_signer
        self.private_key, public = generate_keypair()
        self._runtime_verifier = CredentialVerifier({KEY_ID: public}, ServiceName.RUNTIME)
        self._catalog_verifier = CredentialVerifier({KEY_ID: public}, ServiceName.CATALOG)
        self.catalog = FakeCatalog()
        self.runtime_port = 0
        self.catalog_port = 0

    async def start_catalog(self) -> tuple[Any, str]:
        """The fake catalog server (``None`` with an external ``catalog_target``) and the
        target the runtime dials."""
        if self.catalog_target is not None:
            return None, self.catalog_target
        catalog = await start_server(
            self.cfg(ServiceName.CATALOG),
            [
                ServiceRegistration(
                    "nexus.flow.catalog.v1.CatalogService",
                    catalog_v1.add_CatalogServiceServicer_to_server,
                    self.catalog,
                )
            ],
            verifier=self._catalog_verifier,
        )
        self.catalog_port = catalog.port
        return catalog, f"127.0.0.1:{catalog.port}"

    async def serve(self) -> None:
        engine = db.create_engine(self.db_url, pool_size=4)
        catalog, target = await self.start_catalog()
        key, key_id = self.catalog_signer or (self.private_key, KEY_ID)
        cfg = self.cfg(ServiceName.RUNTIME)
        registration = await build_definition_service(
            cfg, engine, catalog_target=target, credentials=ScopedCredentials(key, key_id)
        )
        try:
            runtime = await start_server(cfg, [registration], verifier=self._runtime_verifier)
            self.runtime_port = runtime.port
            await self.serving()
            await runtime.stop(0)
            if catalog is not None:
                await catalog.stop(0)
        finally:
            await engine.dispose()

    def client(self) -> Client:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.runtime_port}")
        return Client(channel, self.private_key)


def new_org() -> str:
    return f"org-{uuid.uuid4().hex[:12]}"


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Client:
    """Synchronous FlowDefinitionService stub plus credential minting."""

    channel: grpc.Channel
    private_key: Ed25519PrivateKey
    stub: Any = field(init=False)

    def __post_init__(self) -> None:
        self.stub = runtime_v1.FlowDefinitionServiceStub(self.channel)

    def md(
        self,
        org: str,
        app: str | None = None,
        cap: str | None = None,
        digest: str | None = None,
    ) -> tuple[tuple[str, str], ...]:
        return workload_metadata(
            self.private_key,
            KEY_ID,
            ServiceName.RUNTIME,
            org,
            app,
            cap,
            digest,
            subject="definitions-test",
        )

    def scoped(self, pub: Published) -> tuple[tuple[str, str], ...]:
        return self.md(*pub.scope)

    # --- RPC shorthands ----------------------------------------------------------------------

    def register(self, org: str, source: Mapping[str, Any] | str, label: str = "") -> Any:
        text = source if isinstance(source, str) else json.dumps(source)
        name = "" if isinstance(source, str) else str(source["api_name"])
        return self.stub.RegisterFlowVersion(
            runtime_v1.RegisterFlowVersionRequest(
                request_id=new_request_id(),
                org_id=org,
                flow_api_name=name,
                source_json=text,
                label=label,
            ),
            metadata=self.md(org),
            timeout=30,
        ).flow_version

    def compile(
        self,
        pub: Published,
        flow_version_id: str,
        *,
        generation_id: str | None = None,
        catalog_digest: str | None = None,
        requested_profile: int = 0,
    ) -> Any:
        return self.stub.CompileFlowVersion(
            runtime_v1.CompileFlowVersionRequest(
                request_id=new_request_id(),
                scope=pub.scope_proto(),
                flow_version_id=flow_version_id,
                catalog_generation_id=generation_id or pub.generation_id,
                catalog_digest=catalog_digest or pub.catalog_digest,
                requested_profile=requested_profile,  # type: ignore[arg-type]
            ),
            metadata=self.scoped(pub),
            timeout=30,
        )

    def activate(
        self, pub: Published, flow_version_id: str, plan: Any, *, request_id: str | None = None
    ) -> Any:
        return self.stub.ActivateFlowVersion(
            runtime_v1.ActivateFlowVersionRequest(
                request_id=request_id or new_request_id(),
                scope=pub.scope_proto(),
                flow_version_id=flow_version_id,
                plan_id=plan.plan_id,
                plan_digest=plan.plan_digest,
            ),
            metadata=self.scoped(pub),
            timeout=30,
        )

    def deactivate(self, pub: Published, flow_version_id: str) -> Any:
        return self.stub.DeactivateFlowVersion(
            runtime_v1.DeactivateFlowVersionRequest(
                request_id=new_request_id(), org_id=pub.scope[0], flow_version_id=flow_version_id
            ),
            metadata=self.scoped(pub),
            timeout=30,
        ).activation

    def get_plan(self, org: str, plan_ref: str) -> Any:
        return self.stub.GetPlan(
            runtime_v1.GetPlanRequest(org_id=org, plan_id=plan_ref),
            metadata=self.md(org),
            timeout=30,
        ).plan

    def inventory(self, pub: Published, names: Sequence[str] = (), page_size: int = 0) -> Any:
        return self.stub.GetInventory(
            runtime_v1.GetInventoryRequest(
                scope=pub.scope_proto(),
                catalog_generation_id=pub.generation_id,
                catalog_digest=pub.catalog_digest,
                flow_api_names=list(names),
                page_size=page_size,
            ),
            metadata=self.scoped(pub),
            timeout=60,
        )


def run_db(db_url: str, fn: Any) -> Any:
    """Run ``await fn(engine)`` on a fresh engine of ``db_url`` (from a synchronous test)."""

    async def main() -> Any:
        engine = db.create_engine(db_url, pool_size=2)
        try:
            return await fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def rows(db_url: str, table: Any, **where: Any) -> list[dict[str, Any]]:
    """Every row of ``table`` matching ``where`` (column == value), as dicts."""

    async def fn(engine: Any) -> list[dict[str, Any]]:
        async with engine.connect() as conn:
            q = select(table).where(*(table.c[k] == v for k, v in where.items()))
            return [dict(r) for r in (await conn.execute(q)).mappings()]

    result: list[dict[str, Any]] = run_db(db_url, fn)
    return result
