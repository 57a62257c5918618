"""Crash-proof fixtures of the effect exchange: REAL service processes (the effect owner,
the runtime) as children on migrated test databases, and REAL local servers in the test's
event loop that count what they receive: the SMTP sink, the HTTP webhook receiver and
a WakeSignalService stand-in (the runtime's receiving side of completion receipts, until
it exists) behind the production gRPC bootstrap.

These are also the fixtures the full three-service proofs build on: :meth:`EffectStack.
spawn_runtime` starts a real runtime child whose canonical-outbox dispatcher delivers to
:meth:`EffectStack.spawn_owner`'s child; the later runtime-side work replaces the fake
wake signals with the runtime child itself (``FLOW_EFFECT_RUNTIME_TARGET``) and starts
runs instead of enqueueing messages directly.

Children share ``FLOW_DATA_DIR`` (one dev key pair) with the test, which mints the
credentials it needs with the same key. Every wait is bounded and event-driven; a child
that must have died at a named point and did not makes the test fail as inconclusive.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import (
    CredentialVerifier,
    WorkloadClaims,
    bearer_metadata,
    ensure_dev_keys,
    load_signing_key,
    mint_credential,
)
from services.config import ServiceName, load_config
from services.effect_contract import HANDOFF_SUBMIT_ROLE
from services.grpc_server import ServiceRegistration, start_server
from services.proto import effect_v1, runtime_v1
from tests.integration.effects.harness import Scope
from tests.support.effect_servers import (
    FakeWakeSignals,
    ScriptedMailSink,
    WebhookReceiver,
    mail_sink,
    webhook_receiver,
)
from tests.support.procs import ROOT, SERVICE_MODULES, free_port, service_env

__all__ = ["Child", "EffectStack", "effect_stack", "expect_sigkill"]

KEY_ID = "dev"
#: Owner timings: a 3 s command lease (provider calls are cut at 80 % of it), fast retry.
OWNER_ENV = {
    "FLOW_EFFECT_LEASE_MS": "3000",
    "FLOW_EFFECT_RETRY_BASE_MS": "50",
    "FLOW_EFFECT_RETRY_MAX_MS": "400",
    "FLOW_EFFECT_IDLE_MS": "100",
    "FLOW_EFFECT_SMTP_TIMEOUT_S": "5",
    "FLOW_EFFECT_WEBHOOK_TIMEOUT_S": "2",
}
#: Outbox timings of every child: a 2 s delivery lease, 200 ms sweeps.
OUTBOX_ENV = {
    "FLOW_OUTBOX_LEASE_MS": "2000",
    "FLOW_OUTBOX_RETRY_BASE_MS": "50",
    "FLOW_OUTBOX_RETRY_MAX_MS": "400",
    "FLOW_OUTBOX_IDLE_MS": "100",
    "FLOW_OUTBOX_SWEEP_MS": "200",
}
_COMMON = {"FLOW_DB_AUTO_MIGRATE": "false", "FLOW_OTEL_ENABLED": "false", "FLOW_LOG_LEVEL": "INFO"}
_DEATH_S = 60.0


@dataclass
class Child:
    """One service child process."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    _log: Any = field(repr=False, default=None)

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    async def wait_exit(self, timeout_s: float = _DEATH_S) -> int | None:
        for _ in range(int(timeout_s / 0.05)):
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.05)
        return self.proc.poll()

    async def wait_serving(self, timeout_s: float = 60.0) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(int(timeout_s / 0.1)):
                if self.proc.poll() is not None:
                    pytest.fail(f"{self.name} exited {self.proc.returncode}:\n{self.log_text()}")
                with contextlib.suppress(grpc.aio.AioRpcError):
                    resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.1)
        pytest.fail(f"{self.name} never became SERVING:\n{self.log_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if self._log is not None:
            self._log.close()
            self._log = None


async def expect_sigkill(child: Child, marker: Path, point: str) -> None:
    """The child died by SIGKILL exactly at ``point`` (else: inconclusive, fail)."""
    code = await child.wait_exit()
    if code != -signal.SIGKILL:
        pytest.fail(
            f"inconclusive: {child.name} did not die by SIGKILL at {point} "
            f"(returncode {code}):\n{child.log_text()[-3000:]}"
        )
    assert marker.read_text().splitlines()[-1] == point
    assert f"SIGKILL at {point}" in child.log_text()


@dataclass
class EffectStack:
    """The servers and children of one crash test (see the module docstring)."""

    tmp: Path
    owner_db_url: str
    runtime_db_url: str
    sink: ScriptedMailSink
    smtp_port: int
    receiver: WebhookReceiver
    webhook_url: str
    wake: FakeWakeSignals
    wake_port: int
    private_key: Any
    owner_port: int = field(default_factory=free_port)
    children: list[Child] = field(default_factory=list)

    @property
    def marker(self) -> Path:
        return self.tmp / "crash_marker.txt"

    def _spawn(self, name: str, port: int, db_url: str, extra: Mapping[str, str]) -> Child:
        env = service_env(self.tmp, name, port, db_url=db_url, extra={**_COMMON, **extra})
        log_path = self.tmp / f"{name}-{len(self.children)}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in Child.stop()
        proc = subprocess.Popen(
            [sys.executable, "-m", SERVICE_MODULES[name], "serve"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        child = Child(name, port, proc, log_path, log)
        self.children.append(child)
        return child

    def _hook(self, crash_at: str | None) -> dict[str, str]:
        if not crash_at:
            return {}
        return {"FLOW_CRASH_AT": crash_at, "FLOW_CRASH_MARKER_FILE": str(self.marker)}

    def spawn_owner(self, crash_at: str | None = None, **extra: str) -> Child:
        """The effect owner, its providers pointed at the local servers and its receipts
        at the WakeSignalService stand-in."""
        env = {
            **OWNER_ENV,
            **OUTBOX_ENV,
            "FLOW_EFFECT_SMTP_PORT": str(self.smtp_port),
            "FLOW_EFFECT_WEBHOOK_URL": f"{self.webhook_url}/hook",
            "FLOW_EFFECT_RUNTIME_TARGET": f"127.0.0.1:{self.wake_port}",
            **self._hook(crash_at),
            **extra,
        }
        return self._spawn("effect-owner", self.owner_port, self.owner_db_url, env)

    def spawn_runtime(self, crash_at: str | None = None, **extra: str) -> Child:
        """The runtime with only its canonical-outbox dispatcher (no step workers),
        delivering every owner kind to :meth:`spawn_owner`'s child."""
        env = {
            **OUTBOX_ENV,
            "FLOW_RUNTIME_WORKERS": "0",
            "FLOW_RUNTIME_SWEEPS": "false",
            "FLOW_EFFECT_OWNER_TARGETS": f"*=127.0.0.1:{self.owner_port}",
            **self._hook(crash_at),
            **extra,
        }
        return self._spawn("runtime", free_port(), self.runtime_db_url, env)

    def runtime_md(self, scope: Scope) -> Any:
        """The runtime's credential for ``scope`` (what its dispatcher sends)."""
        claims = WorkloadClaims(
            subject="runtime",
            audiences=(ServiceName.EFFECT_OWNER,),
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            roles=(HANDOFF_SUBMIT_ROLE,),
        )
        return bearer_metadata(mint_credential(self.private_key, KEY_ID, claims, ttl_s=600))

    async def accept(self, scope: Scope, env: Any, request_id: str | None = None) -> Any:
        """``AcceptHandoff`` to the owner child, as the runtime's dispatcher sends it."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.owner_port}") as ch:
            stub = effect_v1.EffectOwnerServiceStub(ch)
            return await stub.AcceptHandoff(
                effect_v1.AcceptHandoffRequest(
                    request_id=request_id or uuid.uuid4().hex, scope=scope.proto(), envelope=env
                ),
                metadata=self.runtime_md(scope),
                timeout=20,
            )

    def stop_all(self) -> None:
        for child in self.children:
            child.stop()


@contextlib.asynccontextmanager
async def effect_stack(
    tmp: Path, owner_db_url: str, runtime_db_url: str
) -> AsyncIterator[EffectStack]:
    """Start the local servers; stop every child on exit."""
    keys = ensure_dev_keys(tmp, env="test", key_id=KEY_ID)
    private_key = load_signing_key(keys.signing_key)
    sink, receiver, wake = ScriptedMailSink(), WebhookReceiver(), FakeWakeSignals()
    cfg = load_config(
        ServiceName.RUNTIME,
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(tmp),
            "FLOW_RUNTIME_PORT": "0",
            "FLOW_OTEL_ENABLED": "false",
        },
    )
    verifier = CredentialVerifier({KEY_ID: private_key.public_key()}, ServiceName.RUNTIME)
    wake_server = await start_server(
        cfg,
        [
            ServiceRegistration(
                "nexus.flow.runtime.v1.WakeSignalService",
                runtime_v1.add_WakeSignalServiceServicer_to_server,
                wake,
            )
        ],
        verifier=verifier,
    )
    stack: EffectStack | None = None
    try:
        async with mail_sink(sink) as smtp_port, webhook_receiver(receiver) as url:
            stack = EffectStack(
                tmp,
                owner_db_url,
                runtime_db_url,
                sink,
                smtp_port,
                receiver,
                url,
                wake,
                wake_server.port,
                private_key,
            )
            try:
                yield stack
            finally:
                stack.stop_all()
    finally:
        await wake_server.stop(0)
