"""The runtime's FlowDefinitionService *and* FlowRunService, plus the proto-following
catalog double, on loopback port 0 (production bootstrap: error mapping, credential
verification, request-scope checks).

Plans are compiled and activated through the definitions API exactly as a client would;
runs are then started and read through the FlowRunService API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct

from runtime_svc.api.definitions import build_definition_service
from runtime_svc.api.runs import build_run_service
from runtime_svc.catalog_client import ScopedCredentials
from services import db
from services.config import ServiceName
from services.grpc_server import start_server
from services.proto import runtime_v1
from tests.integration.definitions import flows
from tests.integration.definitions.fake_catalog import Published
from tests.integration.definitions.harness import (
    KEY_ID,
    Client,
    Servers,
    new_request_id,
)
from tests.support.servers import workload_metadata

__all__ = ["ALL_ROLES", "RunClient", "RunServers", "publish_and_activate"]

ALL_ROLES = ("flow.runs.delete", "flow.runs.cancel")


class RunServers(Servers):
    """:class:`Servers` with the FlowRunService registered next to the definitions."""

    async def serve(self) -> None:
        engine = db.create_engine(self.db_url, pool_size=8)
        catalog, target = await self.start_catalog()
        cfg = self.cfg(ServiceName.RUNTIME)
        registrations = [
            await build_definition_service(
                cfg,
                engine,
                catalog_target=target,
                credentials=ScopedCredentials(self.private_key, KEY_ID),
            ),
            # These tests cover the accept/read/cancel API: runs stay where StartRun put
            # them (Bounded Atomic execution has its own tests).
            await build_run_service(cfg, engine, max_wait_s=2.0, synchronous_atomic=False),
        ]
        try:
            runtime = await start_server(cfg, registrations, verifier=self._runtime_verifier)
            self.runtime_port = runtime.port
            await self.serving()
            await runtime.stop(0)
            if catalog is not None:
                await catalog.stop(0)
        finally:
            await engine.dispose()

    def run_client(self) -> RunClient:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.runtime_port}")
        return RunClient(channel, self.private_key)


class RunClient(Client):
    """Definitions client plus FlowRunService shorthands."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.runs = runtime_v1.FlowRunServiceStub(self.channel)

    def creds(
        self, pub: Published | tuple[str, ...], roles: Sequence[str] = ALL_ROLES
    ) -> tuple[tuple[str, str], ...]:
        scope = pub.scope if isinstance(pub, Published) else pub
        padded = (*scope, None, None, None)[:4]
        return workload_metadata(
            self.private_key,
            KEY_ID,
            ServiceName.RUNTIME,
            padded[0],
            *padded[1:],
            subject="runs-test",
            roles=roles,
        )

    def start(
        self,
        pub: Published,
        *,
        flow: str | None = None,
        version: int = 0,
        plan_id: str | None = None,
        inputs: Mapping[str, Any] | None = None,
        input_json: str | None = None,
        key: str = "",
        wait_s: float = 0.0,
        md: Any = None,
    ) -> Any:
        req = runtime_v1.StartRunRequest(
            request_id=new_request_id(), scope=pub.scope_proto(), idempotency_key=key
        )
        if plan_id is not None:
            req.plan_id = plan_id
        else:
            req.flow.flow_api_name = flow or ""
            req.flow.version_number = version
        if inputs is not None:
            s = Struct()
            s.update(dict(inputs))
            req.input_variables.CopyFrom(s)
        if input_json is not None:
            req.input_json = input_json
        if wait_s:
            req.wait_budget.FromMilliseconds(int(wait_s * 1000))
        return self.runs.StartRun(req, metadata=md or self.creds(pub), timeout=30)

    def get(self, pub: Any, run_id: str, md: Any = None) -> Any:
        org = pub.scope[0] if isinstance(pub, Published) else pub[0]
        return self.runs.GetRun(
            runtime_v1.GetRunRequest(org_id=org, flow_run_id=run_id),
            metadata=md or self.creds(pub),
            timeout=30,
        ).run

    def support(self, pub: Any, run_id: str, md: Any = None) -> Any:
        org = pub.scope[0] if isinstance(pub, Published) else pub[0]
        return self.runs.GetRunSupport(
            runtime_v1.GetRunSupportRequest(org_id=org, flow_run_id=run_id),
            metadata=md or self.creds(pub),
            timeout=30,
        ).support

    def list(self, pub: Any, md: Any = None, **kwargs: Any) -> Any:
        org = pub.scope[0] if isinstance(pub, Published) else pub[0]
        return self.runs.ListRuns(
            runtime_v1.ListRunsRequest(org_id=org, **kwargs),
            metadata=md or self.creds(pub),
            timeout=30,
        )

    def delete(self, pub: Any, run_id: str, md: Any = None, expected: int = 0) -> Any:
        org = pub.scope[0] if isinstance(pub, Published) else pub[0]
        return self.runs.DeleteRun(
            runtime_v1.DeleteRunRequest(
                request_id=new_request_id(),
                org_id=org,
                flow_run_id=run_id,
                expected_state_version=expected,
            ),
            metadata=md or self.creds(pub),
            timeout=30,
        ).run

    def cancel(self, pub: Any, run_id: str, md: Any = None) -> Any:
        org = pub.scope[0] if isinstance(pub, Published) else pub[0]
        return self.runs.CancelRun(
            runtime_v1.CancelRunRequest(
                request_id=new_request_id(), org_id=org, flow_run_id=run_id
            ),
            metadata=md or self.creds(pub),
            timeout=30,
        ).run


def publish_and_activate(
    servers: RunServers, client: RunClient, org: str, sources: Sequence[Mapping[str, Any]]
) -> tuple[Published, dict[str, Any]]:
    """Publish the corpus catalog for ``org``, register, compile and activate ``sources``
    through the definitions API; returns the scope and the plan of each Flow."""
    pub = servers.catalog.publish(org, flows.view(org), flows.entries())
    plans = {}
    for source in sources:
        fv = client.register(org, source)
        resp = client.compile(pub, fv.flow_version_id)
        assert resp.compiled, [d.message for d in resp.diagnostics]
        client.activate(pub, fv.flow_version_id, resp.plan)
        plans[str(source["api_name"])] = resp.plan
    return pub, plans
