"""The three services as REAL child processes for the effect seam proofs: the catalog,
the runtime (its gRPC services, step workers, sweeps and canonical-outbox dispatcher)
and the effect owner (its command dispatcher and receipt outbox delivering to the
runtime child) — each on its own migrated database, sharing one ``FLOW_DATA_DIR`` (dev
keys) with the test, plus the counting SMTP sink and HTTP receiver of
:class:`~tests.crash.effects_support.EffectStack`.

The demo is seeded through the public APIs (``flowctl.demo.seed``: the sealed demo
catalog generation and the ACTIVE ``WelcomeContact`` Flow); a Contact created through
the runtime's ``RecordService`` starts the Flow (after-save), whose ``crm.send_email``
effect crosses all three. The runtime appends every step entry to a file
(``FLOW_CRASH_STEP_ENTRY_FILE``): the step-entry counter of the seam's Required Proof.
Ports are fixed per stack, so a restarted child is found where its peers dial it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from google.protobuf.struct_pb2 import Struct

from flowctl.demo import DemoSummary, seed
from services.auth import WorkloadClaims, bearer_metadata, load_signing_key, mint_credential
from services.config import ServiceName, load_config
from services.proto import common_v1, runtime_v1
from tests.crash.effects_support import OUTBOX_ENV, OWNER_ENV, Child, EffectStack
from tests.support.procs import free_port

__all__ = ["CONTACT_FLOWS", "RUNTIME_ENV", "WELCOME_FLOW", "FlowStack"]

_FLOWS = Path(__file__).resolve().parents[2] / "examples" / "flows"
WELCOME_FLOW = _FLOWS / "welcome_contact.json"
#: The demo Flows the Contact trigger subscriptions name (the approval Flow is left out).
CONTACT_FLOWS = (_FLOWS / "normalize_contact_name.json", WELCOME_FLOW)
#: Runtime child timings: a 2 s step lease, fast idle loops and sweeps.
RUNTIME_ENV = {
    "FLOW_RUNTIME_WORKERS": "1",
    "FLOW_RUNTIME_SWEEPS": "true",
    "FLOW_RUNTIME_LEASE_MS": "2000",
    "FLOW_RUNTIME_RETRY_BASE_MS": "50",
    "FLOW_RUNTIME_RETRY_MAX_MS": "400",
    "FLOW_RUNTIME_IDLE_MS": "100",
    "FLOW_RUNTIME_SWEEP_MS": "200",
    "FLOW_RUNTIME_WAIT_SWEEP_MS": "200",
}


@dataclass
class FlowStack:
    """See the module docstring."""

    effects: EffectStack
    catalog_db_url: str
    catalog_port: int = field(default_factory=free_port)
    runtime_port: int = field(default_factory=free_port)
    demo: DemoSummary | None = None

    @property
    def tmp(self) -> Path:
        return self.effects.tmp

    @property
    def entries_file(self) -> Path:
        return self.tmp / "step_entries.txt"

    def spawn_catalog(self) -> Child:
        return self.effects._spawn("catalog", self.catalog_port, self.catalog_db_url, {})

    def spawn_runtime(self, crash_at: str | None = None, **extra: str) -> Child:
        """The whole runtime: API, workers, sweeps, outbox dispatcher (to the owner)."""
        env = {
            **RUNTIME_ENV,
            **OUTBOX_ENV,
            "FLOW_CATALOG_TARGET": f"127.0.0.1:{self.catalog_port}",
            "FLOW_EFFECT_OWNER_TARGETS": f"*=127.0.0.1:{self.effects.owner_port}",
            "FLOW_CRASH_STEP_ENTRY_FILE": str(self.entries_file),
            **self.effects._hook(crash_at),
            **extra,
        }
        return self.effects._spawn("runtime", self.runtime_port, self.effects.runtime_db_url, env)

    def spawn_owner(self, crash_at: str | None = None, **extra: str) -> Child:
        """The effect owner, its providers at the local servers, its receipts delivered
        to the runtime child."""
        env = {
            **OWNER_ENV,
            **OUTBOX_ENV,
            "FLOW_EFFECT_SMTP_PORT": str(self.effects.smtp_port),
            "FLOW_EFFECT_WEBHOOK_URL": f"{self.effects.webhook_url}/hook",
            "FLOW_EFFECT_RUNTIME_TARGET": f"127.0.0.1:{self.runtime_port}",
            **self.effects._hook(crash_at),
            **extra,
        }
        return self.effects._spawn(
            "effect-owner", self.effects.owner_port, self.effects.owner_db_url, env
        )

    def _configs(self) -> Mapping[ServiceName, Any]:
        env = {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(self.tmp),
            "FLOW_CATALOG_PORT": str(self.catalog_port),
            "FLOW_RUNTIME_PORT": str(self.runtime_port),
            "FLOW_EFFECT_PORT": str(self.effects.owner_port),
            "FLOW_OTEL_ENABLED": "false",
        }
        return {svc: load_config(svc, env) for svc in ServiceName}

    async def seed(self) -> DemoSummary:
        """Seed the demo catalog and activate the Contact Flows (public APIs only)."""
        self.demo = await asyncio.to_thread(
            seed, self._configs(), self.tmp, flow_files=CONTACT_FLOWS
        )
        return self.demo

    def _md(self) -> Any:
        assert self.demo is not None
        key = load_signing_key(self.tmp / "auth" / "dev_signing_key.pem")
        claims = WorkloadClaims(
            subject="crash-test",
            audiences=(ServiceName.RUNTIME,),
            org_id=self.demo.org_id,
            app_installation_id=self.demo.app_installation_id,
            runtime_capability_id=self.demo.runtime_capability_id,
            runtime_work_binding_digest=self.demo.binding_digest,
        )
        return bearer_metadata(mint_credential(key, "dev", claims, ttl_s=600))

    def _scope(self) -> Any:
        assert self.demo is not None
        return common_v1.TrustedRuntimeWorkScope(
            org_id=self.demo.org_id,
            app_installation_id=self.demo.app_installation_id,
            runtime_capability_id=self.demo.runtime_capability_id,
            runtime_work_binding_digest=self.demo.binding_digest,
        )

    async def create_contact(self, email: str, first: str = "Ada", last: str = "Lovelace") -> str:
        """Create a Contact (which starts ``WelcomeContact``); returns the run id."""
        fields = Struct()
        fields.update({"FirstName": first, "LastName": last, "Email": email})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.runtime_port}") as ch:
            created = await runtime_v1.RecordServiceStub(ch).CreateRecord(
                runtime_v1.CreateRecordRequest(
                    request_id=f"req-{uuid.uuid4().hex}",
                    scope=self._scope(),
                    object_api_name="Contact",
                    fields=fields,
                ),
                metadata=self._md(),
                timeout=30,
            )
        [run_id] = created.triggered_flow_run_ids
        return str(run_id)

    async def run_state(self, run_id: str) -> tuple[int, str]:
        """``(RunState number, terminal cause)`` of ``run_id`` through ``GetRun``."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.runtime_port}") as ch:
            run = (
                await runtime_v1.FlowRunServiceStub(ch).GetRun(
                    runtime_v1.GetRunRequest(flow_run_id=run_id), metadata=self._md(), timeout=10
                )
            ).run
        return int(run.runtime_state), str(run.terminal_cause_code)

    def entries(self, step_key: str) -> int:
        """How often the runtime entered ``step_key`` (the step-entry counter)."""
        if not self.entries_file.exists():
            return 0
        lines = self.entries_file.read_text().splitlines()
        return sum(1 for line in lines if line.split(" ", 1)[0] == step_key)
