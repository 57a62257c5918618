"""The whole effect exchange in the test's event loop, with REAL parts: the runtime's
worker (EffectSubmit / EffectCompletion steps), its canonical-outbox dispatcher with the
Flow finalizer delivering over gRPC to the real effect-owner service, the owner's command
dispatcher calling real providers (SMTP to a local sink, HTTP to a local receiver), the
owner's outbox delivering completion receipts over gRPC to the runtime's real
``WakeSignalService``, and the runtime's wait and effect sweeps.

Every part is driven explicitly (:meth:`EffectWorld.pump`), so a test decides what runs
when — e.g. "the receipt arrives before the scheduler looks at the run" — and every
wait is bounded. Delays are minutes, reached by shifting the runtime's database clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.commands.model import CommandPolicy
from effect_owner_svc.commands.store import due_commands_txn
from effect_owner_svc.dispatcher.commands import CommandDispatcher
from effect_owner_svc.providers.factory import ProviderSet, build_providers
from effect_owner_svc.receipts.delivery import WakeSignalDelivery
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.schema import external_commands
from runtime_svc.api.signals import wake_signal_registration
from runtime_svc.effects.finalizer import FlowEffectFinalizer
from runtime_svc.effects.steps import EffectSteps
from runtime_svc.effects.sweep import EffectSweeper
from runtime_svc.kernel import RunRecord
from runtime_svc.outbox import (
    RUNTIME_OUTBOX,
    EffectHandoff,
    flow_effect_submit_family,
    owner_channels,
)
from runtime_svc.schema import flow_effect_links, flow_step_executions, runtime_outbox
from runtime_svc.worker import FixedViews, StepWorker
from services.auth import CredentialVerifier, generate_keypair
from services.config import ServiceName, load_config, load_effect_owner_settings
from services.db import db_now, transaction
from services.effect_contract import (
    EFFECT_COMPLETION_FAMILY,
    HANDOFF_SUBMIT_ROLE,
    WAKE_SIGNAL_SUBMIT_ROLE,
)
from services.grpc_server import start_server
from services.outbox import (
    PRE_FINAL_STATES,
    DeliveryPolicy,
    FamilyRegistry,
    MessageFamily,
    OutboxDispatcher,
    OutboxMessage,
    get_message,
)
from services.outbox.store import due_messages, expired_deliveries, pre_final_messages
from services.peer_client import ScopedCredentials, peer_channel
from tests.integration.effects.harness import KEY_ID, OwnerClient, running_owner
from tests.integration.waits.support import World, new_scope
from tests.integration.worker.support import record_view
from tests.support.effect_servers import (
    ScriptedMailSink,
    WebhookReceiver,
    mail_sink,
    webhook_receiver,
)

__all__ = [
    "FAST_COMMANDS",
    "FAST_OUTBOX",
    "EffectWorld",
    "charge_flow",
    "effect_world",
    "email_flow",
]

#: Owner kinds of the corpus catalog's effect actions (their ``owner_id``).
EMAIL_KIND, PAYMENTS_KIND = "email-gateway", "payments"
FAST_OUTBOX = DeliveryPolicy(
    max_attempts=3, base_delay_ms=1, max_delay_ms=2, lease_ms=10_000, reconcile_max_attempts=3
)
FAST_COMMANDS = CommandPolicy(
    max_attempts=2, reconcile_max_attempts=2, base_delay_ms=1, max_delay_ms=2, lease_ms=10_000
)


def email_flow(*, fault: bool = True, after: bool = True) -> dict[str, Any]:
    """``send`` (the corpus ``send_email`` effect of owner ``email-gateway``), then a Task
    ``sent``; with ``fault`` the element's fault connector creates a Task ``failed``."""
    send: dict[str, Any] = {
        "api_name": "send",
        "type": "ActionCall",
        "action_type": "send_email",
        "inputs": {"to": "to", "subject": "'Welcome'", "body": "CONCAT('Hello ', name)"},
        "output_variable": "msgId",
    }
    elements: list[dict[str, Any]] = [send]
    if after:
        send["next"] = "after"
        elements.append(
            {"api_name": "after", "type": "CreateRecord", "object": "Task",
             "fields": {"Subject": "'sent'"}}
        )  # fmt: skip
    if fault:
        send["fault"] = "failed"
        elements.append(
            {"api_name": "failed", "type": "CreateRecord", "object": "Task",
             "fields": {"Subject": "'email failed'"}}
        )  # fmt: skip
    return {
        "api_name": "effect_email",
        "version": 1,
        "description": "effect test Flow: one e-mail effect",
        "process_type": "autolaunched",
        "variables": [
            {"name": "to", "type": "string", "input": True},
            {"name": "name", "type": "string", "input": True},
            {"name": "msgId", "type": "string"},
        ],
        "start": "send",
        "elements": elements,
    }


def charge_flow() -> dict[str, Any]:
    """Compensation (§22.5 "explicit compensation path"): ``charge`` (a ``charge_card``
    effect of owner ``payments``), then ``confirm`` (a ``send_email`` effect); when the
    e-mail fails *after the charge completed*, the e-mail's fault connector runs the
    compensating ``refund`` effect (a negative charge), then ``Fault CHARGE_REVERSED``.
    Nothing is rolled back implicitly: the compensation is two explicit effects."""
    return {
        "api_name": "effect_charge",
        "version": 1,
        "description": "effect test Flow: a charge compensated by an explicit fault path",
        "process_type": "autolaunched",
        "variables": [
            {"name": "accountId", "type": "string", "input": True},
            {"name": "amount", "type": "number", "input": True},
            {"name": "to", "type": "string", "input": True},
            {"name": "ref", "type": "string"},
            {"name": "mailRef", "type": "string"},
            {"name": "refundRef", "type": "string"},
        ],
        "start": "charge",
        "elements": [
            {"api_name": "charge", "type": "ActionCall", "action_type": "charge_card",
             "inputs": {"accountId": "accountId", "amount": "amount"},
             "output_variable": "ref", "next": "confirm", "fault": "declined"},
            {"api_name": "confirm", "type": "ActionCall", "action_type": "send_email",
             "inputs": {"to": "to", "subject": "'Payment received'",
                        "body": "CONCAT('Charged ', TEXT(amount))"},
             "output_variable": "mailRef", "fault": "refund"},
            {"api_name": "refund", "type": "ActionCall", "action_type": "charge_card",
             "inputs": {"accountId": "accountId", "amount": "0 - amount"},
             "output_variable": "refundRef", "next": "reversed"},
            {"api_name": "reversed", "type": "Fault", "code": "CHARGE_REVERSED",
             "message": "the charge was refunded"},
            {"api_name": "declined", "type": "Fault", "code": "CHARGE_DECLINED",
             "message": "the charge was declined"},
        ],
    }  # fmt: skip


@dataclass
class EffectWorld:
    """See the module docstring."""

    runtime: World
    owner_engine: AsyncEngine
    owner: OwnerClient
    sink: ScriptedMailSink
    receiver: WebhookReceiver
    providers: ProviderSet
    private_key: Ed25519PrivateKey
    tmp: Path
    wake_port: int
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    effects: EffectSteps = field(init=False)
    finalizer: FlowEffectFinalizer = field(init=False)
    dispatcher: OutboxDispatcher = field(init=False)
    commands: CommandDispatcher = field(init=False)
    receipts: OutboxDispatcher = field(init=False)
    effect_sweeper: EffectSweeper = field(init=False)

    def __post_init__(self) -> None:
        rt = self.runtime
        self.effects = EffectSteps(rt.engine, rt.rt.steps, rt.clock)
        rt.worker = StepWorker(
            rt.engine,
            rt.store,
            FixedViews(record_view()),
            owner="effects-test",
            waits=rt.rt.steps,
            changes=rt.rt.producer,
            effects=self.effects,
            heartbeat=False,
        )
        self.effect_sweeper = EffectSweeper(rt.engine, rt.rt.matcher, clock=rt.clock, batch=50)
        rt.sweeper = rt.rt.sweeper(batch=50, expiry_guard=self.effect_sweeper.expiry_allowed)
        self.finalizer = FlowEffectFinalizer(rt.engine, rt.rt.matcher, rt.clock)
        self.dispatcher = self.runtime_dispatcher()
        self.commands = CommandDispatcher(
            self.owner_engine, self.providers, FAST_COMMANDS, owner="t", rng=random.Random(5)
        )
        runtime_cfg = self._cfg(ServiceName.RUNTIME)
        channel = peer_channel(
            runtime_cfg, f"127.0.0.1:{self.wake_port}", audience=ServiceName.RUNTIME
        )
        self.channels.append(channel)
        creds = ScopedCredentials(
            self.private_key,
            KEY_ID,
            audience=ServiceName.RUNTIME,
            subject="effect-owner",
            roles=(WAKE_SIGNAL_SUBMIT_ROLE,),
        )
        family = MessageFamily(
            EFFECT_COMPLETION_FAMILY,
            WakeSignalDelivery(channel, creds, timeout_s=10),
            policy=FAST_OUTBOX,
        )
        self.receipts = OutboxDispatcher(
            self.owner_engine, OWNER_OUTBOX, FamilyRegistry([family]), owner="t"
        )

    def _cfg(self, svc: ServiceName) -> Any:
        port = {
            ServiceName.RUNTIME: "FLOW_RUNTIME_PORT",
            ServiceName.EFFECT_OWNER: "FLOW_EFFECT_PORT",
        }
        return load_config(
            svc,
            {
                "FLOW_ENV": "test",
                "FLOW_DATA_DIR": str(self.tmp),
                port[svc]: "0",
                "FLOW_OTEL_ENABLED": "false",
            },
        )

    def runtime_dispatcher(
        self,
        *,
        policy: DeliveryPolicy = FAST_OUTBOX,
        handoff: EffectHandoff | None = None,
        finalizer: Any = ...,
    ) -> OutboxDispatcher:
        """The runtime's canonical-outbox dispatcher delivering to the owner (the Flow
        finalizer registered unless ``finalizer`` says otherwise)."""
        if handoff is None:
            target = self.owner.channel
            lookup, _ = owner_channels({"*": "owner"}, lambda _t: target)
            creds = ScopedCredentials(
                self.private_key,
                KEY_ID,
                audience=ServiceName.EFFECT_OWNER,
                subject="runtime",
                roles=(HANDOFF_SUBMIT_ROLE,),
            )
            handoff = EffectHandoff(lookup, creds, timeout_s=10)
        fin = self.finalizer if finalizer is ... else finalizer
        family = flow_effect_submit_family(handoff, policy=policy, finalizer=fin)
        return OutboxDispatcher(
            self.runtime.engine,
            RUNTIME_OUTBOX,
            FamilyRegistry([family]),
            owner="rt",
            rng=random.Random(2),
        )

    # --- driving ---------------------------------------------------------------------------

    @property
    def org(self) -> str:
        return self.runtime.org

    async def seed(self, source: dict[str, Any]) -> str:
        return await self.runtime.seed(source)

    async def start(self, flow: str, **variables: Any) -> RunRecord:
        return await self.runtime.start(flow, **variables)

    async def run(self, run_id: str) -> RunRecord:
        return await self.runtime.run(run_id)

    async def work(self) -> int:
        """One worker batch of this world's org."""
        return len(await self.runtime.worker.run_batch(self.org))

    # Every pass is scoped to this world's org: worlds of other tests share the
    # databases, and their messages and commands must never reach this world's servers.

    async def deliver(self) -> int:
        """One pass of the runtime's outbox dispatcher (delivery, reconciliation)."""
        return await _outbox_pass(self.dispatcher, self.runtime.engine, self.org)

    async def execute(self) -> int:
        """One pass of the owner's command dispatcher (provider calls)."""
        async with transaction(self.owner_engine, readonly=True) as conn:
            now = await db_now(conn)
            due = await due_commands_txn(conn, self.org, sorted(self.providers), now, 20)
        return sum([await self.commands.process(c) for c in due])

    async def report(self) -> int:
        """One pass of the owner's outbox: completion receipts → SubmitWakeSignal."""
        return await _outbox_pass(self.receipts, self.owner_engine, self.org)

    async def sweep(self) -> None:
        """The runtime's wait and effect sweeps and the outbox repair sweep."""
        await self.runtime.sweep()
        await self.effect_sweeper.sweep_org(self.org)
        await self.repair()

    async def repair(self) -> int:
        """The runtime outbox's repair sweep for this org (expired leases, pre-final
        messages re-driven through the finalizer)."""
        spec = self.dispatcher.spec
        families = ["flow.effect.submit"]
        async with transaction(self.runtime.engine, readonly=True) as conn:
            now = await db_now(conn)
            expired = await expired_deliveries(conn, spec, self.org, families, now, 20)
            pre_final = await pre_final_messages(conn, spec, self.org, families, 20)
        for m in expired:
            moved = await self.dispatcher._expire(m)
            if moved is not None and moved.delivery_state in PRE_FINAL_STATES:
                pre_final.append(moved)
        return sum([await self.dispatcher.finalize(m) for m in pre_final])

    async def pump(self, rounds: int = 1) -> None:
        """Every part once per round: worker, delivery, provider call, receipt, sweeps."""
        for _ in range(rounds):
            await self.work()
            await self.deliver()
            await self.execute()
            await self.report()
            await self.work()
            await self.sweep()

    async def settle(
        self, run_id: str, done: Callable[[RunRecord], bool] | None = None, *, rounds: int = 40
    ) -> RunRecord:
        """Pump until ``done(run)`` (default: terminal); bounded."""
        check = done or (lambda r: r.state.name in ("SUCCEEDED", "TERMINAL_FAILED",
                                                     "QUARANTINED", "CANCELLED"))  # fmt: skip
        run = await self.run(run_id)
        for _ in range(rounds):
            if check(run):
                return run
            await self.pump()
            run = await self.run(run_id)
            await asyncio.sleep(0)
        return run

    # --- reads -----------------------------------------------------------------------------

    async def message(self, run_id: str) -> OutboxMessage | None:
        """The run's one ``flow.effect.submit`` message (first by id)."""
        o = runtime_outbox.c
        async with transaction(self.runtime.engine, readonly=True) as conn:
            mid = (
                await conn.execute(
                    select(o.runtime_outbox_message_id)
                    .where(o.org_id == self.org, o.flow_run_id == run_id)
                    .order_by(o.runtime_outbox_message_id)
                    .limit(1)
                )
            ).scalar_one_or_none()
            return None if mid is None else await get_message(conn, RUNTIME_OUTBOX, self.org, mid)

    async def outbox_rows(self, run_id: str | None = None) -> int:
        o = runtime_outbox.c
        preds = [o.org_id == self.org]
        if run_id is not None:
            preds.append(o.flow_run_id == run_id)
        return await _count(self.runtime.engine, runtime_outbox, *preds)

    async def links(self, run_id: str) -> int:
        c = flow_effect_links.c
        return await _count(
            self.runtime.engine, flow_effect_links, c.org_id == self.org, c.flow_run_id == run_id
        )

    async def commands_count(self) -> int:
        c = external_commands.c
        return await _count(self.owner_engine, external_commands, c.org_id == self.org)

    async def steps(self, run_id: str) -> list[tuple[str, str]]:
        """``(plan step key, state)`` of the run's steps in creation order."""
        s = flow_step_executions.c
        async with transaction(self.runtime.engine, readonly=True) as conn:
            rows = await conn.execute(
                select(s.plan_step_key, s.state)
                .where(s.org_id == self.org, s.flow_run_id == run_id)
                .order_by(s.created_at, s.invocation_ordinal, s.step_execution_id)
            )
            return [(str(k), str(v)) for k, v in rows]

    async def output(self, run_id: str) -> dict[str, Any]:
        from tests.integration.worker.support import final_context

        run = await self.run(run_id)
        ctx = await final_context(self.runtime.engine, self.org, run)
        return dict(ctx.get("$output") or {})


async def _outbox_pass(d: OutboxDispatcher, engine: AsyncEngine, org: str) -> int:
    async with transaction(engine, readonly=True) as conn:
        now = await db_now(conn)
        due = await due_messages(conn, d.spec, org, d._families, now, 20)
    return sum([await d.process(m) for m in due])


async def _count(engine: AsyncEngine, table: Any, *preds: Any) -> int:
    async with transaction(engine, readonly=True) as conn:
        stmt = select(func.count()).select_from(table).where(*preds)
        return int((await conn.execute(stmt)).scalar_one())


@contextlib.asynccontextmanager
async def effect_world(
    runtime_engine: AsyncEngine,
    owner_engine: AsyncEngine,
    tmp: Path,
    *,
    webhook_idempotent: bool = True,
    hook: Callable[[World], Awaitable[None]] | None = None,
) -> AsyncIterator[EffectWorld]:
    """Start the local servers, the owner and the runtime's WakeSignalService."""
    private_key, _ = generate_keypair()
    sink, receiver = ScriptedMailSink(), WebhookReceiver()
    runtime = World(runtime_engine, new_scope())
    async with mail_sink(sink) as smtp_port, webhook_receiver(receiver) as base:
        settings = load_effect_owner_settings(
            {
                "FLOW_EFFECT_PROVIDERS": f"{EMAIL_KIND}=email,{PAYMENTS_KIND}=webhook",
                "FLOW_EFFECT_SMTP_PORT": str(smtp_port),
                "FLOW_EFFECT_SMTP_TIMEOUT_S": "5",
                "FLOW_EFFECT_WEBHOOK_URL": f"{base}/hook",
                "FLOW_EFFECT_WEBHOOK_TIMEOUT_S": "5",
                "FLOW_EFFECT_WEBHOOK_IDEMPOTENT": "true" if webhook_idempotent else "false",
            }
        )
        providers = build_providers(settings)
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
        wake = await start_server(
            cfg,
            [wake_signal_registration(runtime.rt.signals, FixedViews(record_view()))],
            verifier=verifier,
        )
        world: EffectWorld | None = None
        try:
            async with running_owner(
                owner_engine, private_key, tmp, kinds=(EMAIL_KIND, PAYMENTS_KIND)
            ) as owner:
                world = EffectWorld(
                    runtime,
                    owner_engine,
                    owner,
                    sink,
                    receiver,
                    providers,
                    private_key,
                    tmp,
                    wake.port,
                )
                if hook is not None:
                    await hook(runtime)
                yield world
        finally:
            if world is not None:
                for ch in world.channels:
                    await ch.close()
            await providers.aclose()
            await wake.stop(0)


def evidence_of(text: str | None) -> dict[str, Any]:
    return json.loads(text) if text else {}
