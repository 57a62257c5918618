"""The generic outbox dispatcher: claim → deliver → record, reconciliation, finalizer,
repair sweep (spec §10.7, §15.1, §15.4; seam rule 6: at-least-once, consumers dedupe).

One pass of :meth:`OutboxDispatcher.deliver_once`::

    discover due rows (no locks) ─► claim_txn (fenced, lease + fencing token) ─► COMMIT
      ─► family.deliver(message) / family.reconcile(message)   (no transaction open)
      ─► crash_point(after_outbox_delivery, family)      [delivered, not yet recorded]
      ─► apply_txn (fenced on version + lease token) ─► COMMIT
      ─► pre-final? ─► family.finalizer.finalize(ticket)   (its own transaction)

A delivery loop woken with hints (:mod:`services.outbox.hints`: a producer in this
process committed those messages) first claims each hinted message directly —
``claim_hinted_txn`` instead of discovery + claim — and then polls as usual.

A producer in this process may instead enqueue *pre-claimed* (ADR 0004): its
transaction writes the row already leased to this dispatcher (:meth:`preclaim`) and,
after its commit, hands the leased message over (:meth:`hand`); the delivery loop then
delivers it at once — no claim transaction at all. The lease is the same fence a claim
writes: a producer that dies before handing it over, or a dispatcher that stops before
delivering it, leaves a ``Delivering`` row whose lease expires and which the repair sweep
returns to ``Retrying`` like any other lost delivery.

A remote call never runs inside a transaction. A dispatcher that dies between delivery
and recording leaves the row ``Delivering``; the repair sweep (:meth:`sweep_once`)
returns an expired delivery lease to ``Retrying`` (counting the attempt), so the same
message — same key, same payload — is delivered again and the consumer deduplicates.
The sweep also re-drives every pre-finalization candidate through its family finalizer.

The dispatcher holds no connection while it waits for a consumer, and every delivery
call is bounded by the family's lease (a call outliving its lease could otherwise race
the repair sweep's redelivery; it would still lose the final fence).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from opentelemetry.trace import SpanKind
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.background import (
    HINTED_IDLE_FLOOR,
    BackgroundLoop,
    LoopGroup,
    Wakeup,
    settle_tasks,
)
from services.db import db_now, run_in_transaction
from services.errors import FenceLostError
from services.faults import CrashPoint, crash_point
from services.metrics import metrics
from services.outbox.families import FamilyRegistry, FinalizationTicket, MessageFamily
from services.outbox.hints import OutboxHint, claim_hinted_txn
from services.outbox.model import (
    PRE_FINAL_STATES,
    Delivered,
    DeliveryResult,
    DeliveryState,
    Disposition,
    ReconcileResult,
    RetryLater,
    Transition,
    UnknownReceipt,
    decide_after_delivery,
    decide_after_reconcile,
)
from services.outbox.store import (
    OutboxMessage,
    OutboxTable,
    PreClaim,
    apply_txn,
    claim_txn,
    due_messages,
    expire_lease_txn,
    expired_deliveries,
    orgs_with_due,
    orgs_with_repair_work,
    pre_final_messages,
)
from services.telemetry import span

__all__ = ["DELIVER_SPAN", "HINTED_IDLE_FLOOR", "OutboxDispatcher", "SweepReport"]

log = logging.getLogger(__name__)

_ORG_LIMIT = 100
#: The span of one delivery or reconciliation attempt.
DELIVER_SPAN = "outbox.deliver"


def _result_code(result: object) -> str:
    """``RetryLater`` → ``retry_later`` (the metric label and span attribute)."""
    name = type(result).__name__
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


@dataclass(frozen=True)
class SweepReport:
    """What one repair pass did."""

    leases_expired: int = 0
    finalized: int = 0
    pre_final_waiting: int = 0


class OutboxDispatcher:
    """Delivers the registered families of one outbox table.

    Args:
        engine: the database holding the table.
        spec: the outbox table.
        families: the families this dispatcher serves.
        owner: lease owner name (host/pid/instance), diagnostics only.
        batch_size: rows claimed per org and pass.
        concurrency: deliveries in flight at once.
        idle_s: longest idle backoff of the delivery loop.
        sweep_interval_s: repair-sweep interval.
        rng: jitter source (tests pass a seeded one).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        spec: OutboxTable,
        families: FamilyRegistry,
        *,
        owner: str,
        batch_size: int = 20,
        concurrency: int = 8,
        idle_s: float = 0.5,
        sweep_interval_s: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self._engine = engine
        self._spec = spec
        self._families = families
        self._owner = owner
        self._batch = max(1, batch_size)
        self._gate = asyncio.Semaphore(max(1, concurrency))
        self._idle_s = idle_s
        self._sweep_s = sweep_interval_s
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._loops: LoopGroup | None = None
        #: Pre-claimed messages handed over by producers of this process (unbounded by
        #: design: one entry per committed row not yet delivered, never dropped).
        self._handed: deque[OutboxMessage] = deque()
        self._handed_wake: Wakeup | None = None
        #: The woken delivery loop (:meth:`loops`): while it runs, a handed message
        #: starts delivering at once (:meth:`hand`).
        self._deliver_loop: BackgroundLoop | None = None
        #: Handed deliveries in flight (:meth:`deliver_handed`, :meth:`settle`).
        self._inflight: set[asyncio.Future[int]] = set()

    @property
    def spec(self) -> OutboxTable:
        return self._spec

    # --- delivery ---------------------------------------------------------------------

    async def deliver_once(self) -> int:
        """One pass over every org with due messages; returns how many were processed."""

        async def discover(conn: AsyncConnection) -> list[OutboxMessage]:
            now = await db_now(conn)
            found: list[OutboxMessage] = []
            for org in await orgs_with_due(conn, self._spec, self._families, now, _ORG_LIMIT):
                found += await due_messages(conn, self._spec, org, self._families, now, self._batch)
            return found

        candidates = await run_in_transaction(self._engine, discover, readonly=True)
        if not candidates:
            return 0
        results = await asyncio.gather(*(self._guarded(m) for m in candidates))
        return sum(results)

    async def _guarded(self, message: OutboxMessage) -> int:
        async with self._gate:
            try:
                return 1 if await self.process(message) else 0
            except Exception:
                log.exception(
                    "outbox %s: processing %s failed", self._spec.table.name, message.message_id
                )
                return 0

    async def process(self, message: OutboxMessage) -> bool:
        """Claim, deliver or reconcile, and record one due message.

        Returns:
            False when another dispatcher won the claim.
        """
        family = self._families[message.family]
        started = time.time_ns()
        leased = await self._claim(message, family)
        if leased is None:
            return False
        await self._run_leased(leased, started)
        return True

    async def deliver_hinted(self, hints: Sequence[object]) -> int:
        """Claim and deliver the hinted messages of this table (hints of other tables
        are ignored); returns how many this dispatcher claimed."""
        mine = [h for h in hints if isinstance(h, OutboxHint) and h.table == self._spec.table.name]
        if not mine:
            return 0
        return sum(await asyncio.gather(*(self._guarded_hint(h) for h in mine)))

    async def _guarded_hint(self, hint: OutboxHint) -> int:
        async with self._gate:
            try:
                return 1 if await self.process_hint(hint) else 0
            except Exception:
                log.exception("outbox %s: processing hint %s failed", self._spec.table.name, hint)
                return 0

    async def process_hint(self, hint: OutboxHint) -> bool:
        """Claim the hinted message in one transaction (when it is still due) and
        deliver it like :meth:`process`.

        Returns:
            False when it was not due or another dispatcher won the claim.
        """
        started = time.time_ns()
        leases = {n: self._families[n].policy.lease_ms for n in self._families}

        async def fn(conn: AsyncConnection) -> OutboxMessage | None:
            return await claim_hinted_txn(
                conn, self._spec, hint, leases, owner=self._owner, now=await db_now(conn)
            )

        try:
            leased = await run_in_transaction(self._engine, fn)
        except FenceLostError:
            return False
        if leased is None:
            return False
        await self._run_leased(leased, started)
        return True

    # --- pre-claimed enqueue (ADR 0004) -------------------------------------------------

    def preclaim(self, family: str) -> PreClaim | None:
        """The lease a producer of this process writes with a new ``family`` message
        (:func:`~services.outbox.enqueue_txn` ``preclaim=``), or None when this
        dispatcher does not serve that family or runs no woken delivery loop (the
        producer then enqueues ``Pending`` for polling)."""
        if self._handed_wake is None or family not in self._families:
            return None
        return PreClaim(self._owner, self._families[family].policy.lease_ms)

    def hand(self, leased: OutboxMessage) -> None:
        """Deliver ``leased`` — a message enqueued with :meth:`preclaim`'s lease whose
        transaction committed — at the delivery loop's next iteration."""
        if self._deliver_loop is not None and self._deliver_loop.running:
            # The delivery loop runs: start the delivery now rather than at the loop's
            # next iteration (a wake, a pass of the loop, then the task: round 6, one
            # scheduling hop less between the producer's commit and the remote call).
            self._start_leased(leased)
            return
        self._handed.append(leased)
        if self._handed_wake is not None:
            self._handed_wake.notify()

    async def deliver_handed(self) -> int:
        """Start delivering every handed message (no claim: each already holds its
        lease); returns how many were started.

        The deliveries run as tasks (bounded by the dispatcher's concurrency), not
        awaited here: a message handed over while others are in flight starts at once
        instead of waiting for the slowest of the previous batch (with 60 effects at
        once that wait was most of the owner → runtime hop)."""
        handed = list(self._handed)
        self._handed.clear()
        for message in handed:
            self._start_leased(message)
        return len(handed)

    def _start_leased(self, message: OutboxMessage) -> None:
        task = asyncio.ensure_future(self._guarded_leased(message))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def settle(self, grace_s: float = 5.0) -> None:
        """Wait (bounded) for the handed deliveries still in flight, then cancel the
        rest: a cancelled one keeps its lease, which expires and the repair sweep
        returns the row for redelivery (ADR 0004). Call after the loops stopped."""
        await settle_tasks(self._inflight, grace_s)

    async def _guarded_leased(self, leased: OutboxMessage) -> int:
        async with self._gate:
            try:
                if leased.family not in self._families:
                    return 0  # not ours: its lease expires and the sweep repairs it
                await self._run_leased(leased, time.time_ns())
                return 1
            except Exception:
                log.exception(
                    "outbox %s: delivering %s failed", self._spec.table.name, leased.message_id
                )
                return 0

    async def _run_leased(self, leased: OutboxMessage, started: int) -> None:
        family = self._families[leased.family]
        # The delivery continues the trace of the span that enqueued the message (a step
        # attempt, a command dispatch); the peer call below is its child.
        with span(
            DELIVER_SPAN,
            parent=leased.trace_context,
            kind=SpanKind.PRODUCER,
            start_time=started,
            attributes={
                "nexus.flow.outbox": self._spec.table.name,
                "nexus.flow.message_family": leased.family,
                "nexus.flow.message_id": leased.message_id,
                "nexus.flow.delivery_attempt": leased.delivery_attempts + 1,
            },
        ) as current:
            result = await self._deliver_leased(family, leased)
            current.set_attribute("nexus.flow.result", result)

    async def _deliver_leased(self, family: MessageFamily, leased: OutboxMessage) -> str:
        """Deliver or reconcile a claimed message and record the outcome; returns the
        result code (metrics and the span)."""
        timeout_s = family.policy.lease_ms / 1000 * 0.8
        decide: Callable[[datetime], Transition]
        result: DeliveryResult | ReconcileResult
        if leased.delivery_state is DeliveryState.RECONCILING:
            result = result_r = await self._bounded_reconcile(family, leased, timeout_s)

            def decide(now: datetime) -> Transition:
                return decide_after_reconcile(
                    leased.delivery_attempts,
                    result_r,
                    family.policy,
                    now=now,
                    deadline=leased.deadline,
                    rng=self._rng,
                )
        else:
            result = result_d = await self._bounded_deliver(family, leased, timeout_s)
            if isinstance(result_d, Delivered):
                crash_point(CrashPoint.AFTER_OUTBOX_DELIVERY, family.name)

            def decide(now: datetime) -> Transition:
                return decide_after_delivery(
                    leased.delivery_attempts,
                    result_d,
                    family.policy,
                    reconciles=family.reconcile is not None,
                    finalizes=family.finalizer is not None,
                    now=now,
                    deadline=leased.deadline,
                    rng=self._rng,
                )

        recorded = await self._apply(leased, decide)
        code = _result_code(result)
        delivered = recorded is not None and recorded.delivery_state is DeliveryState.DELIVERED
        metrics().outbox_attempt(leased.family, code, leased.created_at, delivered)
        if recorded is not None and recorded.delivery_state in PRE_FINAL_STATES:
            await self.finalize(recorded)
        return code

    async def _claim(self, message: OutboxMessage, family: MessageFamily) -> OutboxMessage | None:
        async def fn(conn: AsyncConnection) -> OutboxMessage:
            now = await db_now(conn)
            until = now + timedelta(milliseconds=family.policy.lease_ms)
            return await claim_txn(
                conn, self._spec, message, owner=self._owner, lease_until=until, now=now
            )

        try:
            return await run_in_transaction(self._engine, fn)
        except FenceLostError:
            return None

    async def _bounded_deliver(
        self, family: MessageFamily, message: OutboxMessage, timeout_s: float
    ) -> DeliveryResult:
        try:
            return await asyncio.wait_for(family.deliver(message), timeout=timeout_s)
        except TimeoutError:
            return RetryLater("delivery_timeout")
        except Exception:
            log.exception("outbox family %s: deliver raised", family.name)
            return RetryLater("delivery_error")

    async def _bounded_reconcile(
        self, family: MessageFamily, message: OutboxMessage, timeout_s: float
    ) -> ReconcileResult:
        if family.reconcile is None:
            # Only reachable if the family lost its reconciler across a deployment.
            return UnknownReceipt("no_reconciler")
        try:
            return await asyncio.wait_for(family.reconcile(message), timeout=timeout_s)
        except TimeoutError:
            return RetryLater("reconcile_timeout")
        except Exception:
            log.exception("outbox family %s: reconcile raised", family.name)
            return RetryLater("reconcile_error")

    async def _apply(
        self, leased: OutboxMessage, decide: Callable[[datetime], Transition]
    ) -> OutboxMessage | None:
        # The decision is taken inside the recording transaction, on the database clock.
        async def fn(conn: AsyncConnection) -> OutboxMessage:
            now = await db_now(conn)
            return await apply_txn(conn, self._spec, leased, decide(now), now=now)

        try:
            return await run_in_transaction(self._engine, fn)
        except FenceLostError:
            # The lease expired and the sweep (or another dispatcher) moved on; the
            # consumer deduplicates whatever this delivery did.
            log.info("outbox %s: lease of %s lost", self._spec.table.name, leased.message_id)
            return None

    # --- finalization -------------------------------------------------------------------

    async def finalize(self, message: OutboxMessage) -> bool:
        """Call the family finalizer of a pre-final message (no transaction, no lock).

        Returns:
            True when the message is terminal afterwards.
        """
        family = self._families[message.family]
        if family.finalizer is None:
            log.warning(
                "outbox %s: %s is %s and family %s has no finalizer; it stays pre-final",
                self._spec.table.name,
                message.message_id,
                message.delivery_state.value,
                family.name,
            )
            return False
        disposition = (
            Disposition.REJECTED
            if message.delivery_state is DeliveryState.REJECTED
            else Disposition.UNKNOWN
        )
        try:
            await family.finalizer.finalize(FinalizationTicket(message, disposition, self._spec))
        except FenceLostError:
            return False  # a concurrent finalizer won; the sweep re-reads
        except Exception:
            log.exception("outbox family %s: finalizer failed", family.name)
            return False
        return True

    # --- repair sweep ------------------------------------------------------------------

    async def sweep_once(self) -> SweepReport:
        """Repair expired delivery leases and re-drive pre-finalization candidates."""

        async def discover(
            conn: AsyncConnection,
        ) -> tuple[list[OutboxMessage], list[OutboxMessage]]:
            now = await db_now(conn)
            expired: list[OutboxMessage] = []
            pre_final: list[OutboxMessage] = []
            for org in await orgs_with_repair_work(
                conn, self._spec, self._families, now, _ORG_LIMIT
            ):
                expired += await expired_deliveries(
                    conn, self._spec, org, self._families, now, self._batch
                )
                pre_final += await pre_final_messages(
                    conn, self._spec, org, self._families, self._batch
                )
            return expired, pre_final

        expired, pre_final = await run_in_transaction(self._engine, discover, readonly=True)
        repaired = 0
        for message in expired:
            moved = await self._expire(message)
            if moved is None:
                continue
            repaired += 1
            if moved.delivery_state in PRE_FINAL_STATES:
                pre_final.append(moved)
        finalized = 0
        for message in pre_final:
            if await self.finalize(message):
                finalized += 1
        return SweepReport(repaired, finalized, len(pre_final) - finalized)

    async def _expire(self, message: OutboxMessage) -> OutboxMessage | None:
        family = self._families[message.family]

        async def fn(conn: AsyncConnection) -> OutboxMessage:
            now = await db_now(conn)
            transition = decide_after_delivery(
                message.delivery_attempts,
                RetryLater("lease_expired"),
                family.policy,
                reconciles=family.reconcile is not None,
                finalizes=family.finalizer is not None,
                now=now,
                deadline=message.deadline,
                rng=self._rng,
            )
            return await expire_lease_txn(conn, self._spec, message, transition, now=now)

        try:
            return await run_in_transaction(self._engine, fn)
        except FenceLostError:
            return None

    # --- lifecycle (STYLE 12) ---------------------------------------------------------

    def loops(self, name: str, *, wake: Wakeup | None = None) -> list[BackgroundLoop]:
        """The delivery loop (woken by ``wake``: a message was enqueued in this process)
        and the periodic repair sweep (``services.background``)."""

        self._handed_wake = wake

        async def deliver() -> bool:
            # Pre-claimed and hinted messages first (delivered without a claim, or claimed
            # without discovery); they named what this process committed, so no re-poll
            # follows them: the wake does not restart the idle backoff
            # (``wake_resets=False``), whose polls find other processes' messages. A wake
            # that named nothing deliverable, or dropped hints, takes the ordinary pass.
            if wake is not None:
                done = await self.deliver_handed()
                done += await self.deliver_hinted(wake.take_hints())
                if done > 0 and not wake.take_lost():
                    return False
            return await self.deliver_once() > 0

        async def sweep() -> bool:
            await self.sweep_once()
            return False

        deliver_loop = BackgroundLoop(
            f"{name}-deliver",
            idle_s=self._idle_s,
            body=deliver,
            wake=wake,
            min_idle_s=self._idle_s / HINTED_IDLE_FLOOR if wake is not None else 0.0,
            wake_resets=wake is None,
        )
        if wake is not None:
            self._deliver_loop = deliver_loop
        return [
            deliver_loop,
            BackgroundLoop(f"{name}-sweep", idle_s=self._sweep_s, body=sweep, interval=True),
        ]

    async def run(self) -> None:
        """Deliver and sweep until :meth:`shutdown`."""
        self._loops = LoopGroup(self.loops(self._spec.table.name))
        await self._loops.run()

    async def shutdown(self) -> None:
        """Stop after the current iteration, then settle handed deliveries (idempotent)."""
        if self._loops is not None:
            await self._loops.shutdown()
        await self.settle()
