"""The effect owner on loopback port 0 with the production bootstrap, and builders of
the requests the runtime's dispatcher sends.

Everything is in the test's event loop: the ``grpc.aio`` server, the ``grpc.aio``
client, the local SMTP/HTTP servers and the fake WakeSignalService.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.api.servicer import build_effect_owner_service
from effect_owner_svc.schema import external_commands, owner_inbox, owner_outbox
from runtime_svc.outbox import EffectSubmitIntent, effect_submit_intent
from services.auth import (
    CredentialVerifier,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    bearer_metadata,
    mint_credential,
)
from services.config import ServiceConfig, ServiceName, load_config
from services.db import transaction
from services.digest import canonical_json, versioned_digest
from services.effect_contract import (
    FLOW_EFFECT_SUBMIT_FAMILY,
    HANDOFF_SUBMIT_ROLE,
    effect_handoff_key,
    effect_payload_digest,
    runtime_outbox_message_id,
)
from services.grpc_server import RunningServer, ServiceRegistration, start_server
from services.proto import common_v1, effect_v1, runtime_v1

__all__ = [
    "KEY_ID",
    "OwnerClient",
    "Scope",
    "count",
    "envelope",
    "owner_config",
    "running_owner",
    "running_wake_signals",
    "submit_intent",
]

KEY_ID = "test"
SERVED = ("email.smtp", "webhook.http")


@dataclass(frozen=True)
class Scope:
    """A complete work scope (binding digest derived from the other three)."""

    org_id: str
    app_installation_id: str = "inst-1"
    runtime_capability_id: str = "cap-1"
    runtime_work_binding_digest: str = ""

    def __post_init__(self) -> None:
        if not self.runtime_work_binding_digest:
            digest = versioned_digest(
                "runtime_work_binding",
                [self.org_id, self.app_installation_id, self.runtime_capability_id],
            )
            object.__setattr__(self, "runtime_work_binding_digest", digest)

    def with_(self, **changes: str) -> Scope:
        if "runtime_work_binding_digest" not in changes:
            changes["runtime_work_binding_digest"] = ""
        return replace(self, **changes)

    def proto(self) -> Any:
        return common_v1.TrustedRuntimeWorkScope(
            org_id=self.org_id,
            app_installation_id=self.app_installation_id,
            runtime_capability_id=self.runtime_capability_id,
            runtime_work_binding_digest=self.runtime_work_binding_digest,
        )


def envelope(
    scope: Scope,
    *,
    run: str = "run-1",
    step: str = "send_welcome",
    ordinal: int = 0,
    payload: Mapping[str, Any] | None = None,
    owner_kind: str = "email.smtp",
    key: str | None = None,
    outbox_id: str | None = None,
    payload_digest: str | None = None,
) -> Any:
    """A ``RuntimeOutboxEnvelope`` exactly as the runtime's dispatcher builds it."""
    body = dict(payload or {"to": "ada@example.com", "template": "contact_welcome"})
    handoff_key = key or effect_handoff_key(
        scope, flow_run_id=run, submit_step_key=step, invocation_ordinal=ordinal
    )
    env = common_v1.RuntimeOutboxEnvelope(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
        runtime_outbox_message_id=outbox_id or runtime_outbox_message_id(handoff_key),
        message_family=FLOW_EFFECT_SUBMIT_FAMILY,
        message_family_version=1,
        effect_handoff_key=handoff_key,
        effect_owner_kind=owner_kind,
        payload_schema_version=1,
        payload_digest=payload_digest or effect_payload_digest(body),
        payload_json=canonical_json(body).decode(),
        flow_run_id=run,
        step_execution_id=f"step_{run}_{step}_{ordinal}",
        submission_attempt_id=f"att_{run}_{step}_{ordinal}",
        failure_policy=common_v1.ExpiryPolicy.EXPIRY_POLICY_FAULT_PATH,
    )
    env.deadline.FromSeconds(4_102_444_800)  # 2100-01-01
    return env


def submit_intent(
    scope: Scope,
    *,
    run: str = "run-1",
    owner_kind: str = "email.smtp",
    deadline: datetime | None = None,
) -> EffectSubmitIntent:
    """The EffectSubmit intent the runtime computes for ``scope``'s run (send_welcome,
    first invocation, the demo's e-mail payload)."""
    return effect_submit_intent(
        TrustedRuntimeWorkScope(
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
        ),
        flow_run_id=run,
        submit_step_key="send_welcome",
        invocation_ordinal=0,
        step_execution_id="step_1",
        submission_attempt_id="att_1",
        effect_owner_kind=owner_kind,
        payload={"to": "ada@example.com", "template": "contact_welcome"},
        deadline=deadline,
        failure_policy="fault_path",
    )


def owner_config(data_dir: Path) -> ServiceConfig:
    return load_config(
        ServiceName.EFFECT_OWNER,
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(data_dir),
            "FLOW_EFFECT_PORT": "0",
            "FLOW_OTEL_ENABLED": "false",
        },
    )


@dataclass
class OwnerClient:
    """An aio client of the owner acting as the runtime's dispatcher (or an operator)."""

    channel: grpc.aio.Channel
    private_key: Ed25519PrivateKey
    stub: Any = field(init=False)

    def __post_init__(self) -> None:
        self.stub = effect_v1.EffectOwnerServiceStub(self.channel)

    def md(self, scope: Scope, roles: Sequence[str] = (HANDOFF_SUBMIT_ROLE,)) -> Any:
        claims = WorkloadClaims(
            subject="runtime",
            audiences=(ServiceName.EFFECT_OWNER,),
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            roles=tuple(roles),
        )
        return bearer_metadata(mint_credential(self.private_key, KEY_ID, claims, ttl_s=300))

    async def accept(
        self, scope: Scope, env: Any, *, request_id: str | None = None, md: Any = None
    ) -> Any:
        req = effect_v1.AcceptHandoffRequest(
            request_id=request_id or uuid.uuid4().hex, scope=scope.proto(), envelope=env
        )
        return await self.stub.AcceptHandoff(req, metadata=md or self.md(scope), timeout=30)

    async def reject(
        self,
        scope: Scope,
        key: str,
        digest: str,
        outbox_id: str,
        *,
        request_id: str | None = None,
        with_scope: bool = True,
    ) -> Any:
        req = effect_v1.RejectIfUnacceptedRequest(
            request_id=request_id or uuid.uuid4().hex,
            effect_handoff_key=key,
            payload_digest=digest,
            runtime_outbox_message_id=outbox_id,
        )
        if with_scope:
            req.scope.CopyFrom(scope.proto())
        return await self.stub.RejectIfUnaccepted(req, metadata=self.md(scope), timeout=30)


@contextlib.asynccontextmanager
async def running_owner(
    engine: AsyncEngine,
    private_key: Ed25519PrivateKey,
    data_dir: Path,
    *,
    kinds: Sequence[str] = SERVED,
    on_accepted: Callable[[Any], None] | None = None,
    seats: Any = None,
) -> AsyncIterator[OwnerClient]:
    """The owner service (production bootstrap) and a client of it (``on_accepted``:
    the servicer's hook for each newly accepted command; ``seats``: its pre-claimed
    commands' dispatcher, ADR 0008)."""
    verifier = CredentialVerifier({KEY_ID: private_key.public_key()}, ServiceName.EFFECT_OWNER)
    server = await start_server(
        owner_config(data_dir),
        [build_effect_owner_service(engine, kinds, on_accepted=on_accepted, seats=seats)],
        verifier=verifier,
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield OwnerClient(channel, private_key)
    finally:
        await channel.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def running_wake_signals(
    servicer: Any, private_key: Ed25519PrivateKey, data_dir: Path
) -> AsyncIterator[RunningServer]:
    """A WakeSignalService servicer behind the production bootstrap (audience runtime)."""
    cfg = load_config(
        ServiceName.RUNTIME,
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(data_dir),
            "FLOW_RUNTIME_PORT": "0",
            "FLOW_OTEL_ENABLED": "false",
        },
    )
    verifier = CredentialVerifier({KEY_ID: private_key.public_key()}, ServiceName.RUNTIME)
    registration = ServiceRegistration(
        "nexus.flow.runtime.v1.WakeSignalService",
        runtime_v1.add_WakeSignalServiceServicer_to_server,
        servicer,
    )
    server = await start_server(cfg, [registration], verifier=verifier)
    try:
        yield server
    finally:
        await server.stop(0)


async def count(engine: AsyncEngine, table: Any, **where: Any) -> int:
    """Rows of ``table`` matching ``where`` (column == value)."""
    async with transaction(engine, readonly=True) as conn:
        stmt = (
            select(func.count())
            .select_from(table)
            .where(*(table.c[k] == v for k, v in where.items()))
        )
        return int((await conn.execute(stmt)).scalar_one())


TABLES = {"inbox": owner_inbox, "commands": external_commands, "outbox": owner_outbox}
