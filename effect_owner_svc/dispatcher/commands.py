"""The owner's command dispatcher: accepted commands → provider calls → outcomes and
completion receipts (spec §15.1-§15.3; seam rule 5).

One command, end to end (:meth:`CommandDispatcher.process`)::

    claim_txn (lease + fencing token; a new remote attempt IN_FLIGHT) ─► COMMIT
      ─► crash_point(before_provider_call, kind)
      ─► provider.submit(command)        no transaction open; bounded below the lease
      ─► crash_point(after_provider_accepted, kind)        [SUCCEEDED, not recorded]
      ─► record_attempt_txn (attempt outcome, command CAS under the lease token,
           terminal: receipt + owner-outbox message) ─► COMMIT
      ─► crash_point(after_receipt_commit, kind)

A command accepted in this process while its dispatcher has room is *pre-claimed* (ADR
0008): the acceptance reserves a :class:`CommandSeat`, inserts the command leased to this
dispatcher with its first attempt ``IN_FLIGHT``, and after its COMMIT hands the
:class:`~effect_owner_svc.commands.store.Started` over (:meth:`CommandSeat.hand`) — the
same state ``claim_txn`` would have committed, one transaction earlier, so the provider
call starts without a claim transaction. A seat is a slot of the concurrency gate held
from the reservation to the hand-over, so a handed command never waits for the gate while
its lease runs.

A dispatcher killed after the provider accepted but before recording leaves the attempt
``IN_FLIGHT``; when its lease expires the next claim records that attempt's outcome as
unknown and reconciles: the provider's ``lookup`` where it has one, a replay with the
same idempotency key where the provider deduplicates on it, and quarantine otherwise —
never a blind second send. The network call is never made before the acceptance that
created the command committed (the command row only exists after that commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.commands.model import (
    CommandPolicy,
    decide_after_attempt,
    decide_after_lookup,
)
from effect_owner_svc.commands.records import CommandRecord, ReceiptRecord
from effect_owner_svc.commands.store import (
    Reconciling,
    Started,
    claim_txn,
    due_commands_txn,
    hold_command_txn,
    orgs_with_due_commands_txn,
    record_attempt_txn,
    record_lookup_txn,
)
from effect_owner_svc.observability import command_span, provider_call
from effect_owner_svc.providers.base import (
    Provider,
    ProviderCommand,
    ProviderOutcome,
    ProviderOutcomeKind,
)
from effect_owner_svc.providers.factory import ProviderSet
from effect_owner_svc.receipts.store import receipt_hint
from services.background import BackgroundLoop, Wakeup, settle_tasks
from services.db import db_now, run_in_transaction
from services.effect_contract import EFFECT_COMPLETION_FAMILY
from services.errors import FenceLostError
from services.faults import CrashPoint, crash_point
from services.outbox import OutboxHint, PreClaim
from services.outbox.dispatcher import HINTED_IDLE_FLOOR, OutboxDispatcher

__all__ = ["CommandDispatcher", "CommandSeat", "CommandSeats"]

log = logging.getLogger(__name__)

_ORG_LIMIT = 100


class CommandDispatcher:
    """Calls providers for due commands of the kinds in ``providers``.

    Args:
        engine: the owner database.
        providers: providers by effect owner kind (the kinds this process serves).
        policy: attempt budget, backoff and lease.
        owner: lease owner name, diagnostics only.
        batch_size: commands claimed per org and pass.
        concurrency: provider calls in flight at once.
        idle_s: longest idle backoff of the loop.
        rng: jitter source.
        on_receipt: called after a completion receipt committed, with the hint naming its
            owner-outbox message (wakes its delivery, which claims that message directly).
        receipts: this process's owner-outbox dispatcher: a receipt's message is then
            enqueued already leased to it and handed over after the commit (ADR 0004),
            so its delivery starts without a claim transaction.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        providers: ProviderSet,
        policy: CommandPolicy,
        *,
        owner: str,
        batch_size: int = 20,
        concurrency: int = 8,
        idle_s: float = 0.5,
        rng: random.Random | None = None,
        on_receipt: Callable[[OutboxHint], None] | None = None,
        receipts: OutboxDispatcher | None = None,
    ) -> None:
        self._engine = engine
        self._on_receipt = on_receipt
        self._receipts = receipts
        self._providers = providers
        self._policy = policy
        self._owner = owner
        self._batch = max(1, batch_size)
        self._concurrency = max(1, concurrency)
        self._gate = asyncio.Semaphore(self._concurrency)
        self._idle_s = idle_s
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        #: Gate slots in use (claimed or handed commands being driven).
        self._busy = 0
        #: Seats reserved by acceptances not yet handed over or released.
        self._reserved: set[CommandSeat] = set()
        self._inflight: set[asyncio.Task[None]] = set()
        self._loop: BackgroundLoop | None = None

    async def run_once(self) -> int:
        """One pass over every org with due commands; returns how many were processed."""
        kinds = sorted(self._providers)
        if not kinds:
            return 0

        async def discover(conn: AsyncConnection) -> list[CommandRecord]:
            now = await db_now(conn)
            found: list[CommandRecord] = []
            for org in await orgs_with_due_commands_txn(conn, kinds, now, _ORG_LIMIT):
                found += await due_commands_txn(conn, org, kinds, now, self._batch)
            return found

        due = await run_in_transaction(self._engine, discover, readonly=True)
        if not due:
            return 0
        return sum(await asyncio.gather(*(self._guarded(c) for c in due)))

    async def run_hinted(self, hints: Sequence[object]) -> int:
        """Dispatch the commands this process just accepted (the wakeup's hints) without
        a discovery transaction; the claim re-validates each under its fence (a command
        already claimed elsewhere, or not due, is skipped). Returns how many ran."""
        mine = [
            h
            for h in hints
            if isinstance(h, CommandRecord) and h.effect_owner_kind in self._providers
        ]
        if not mine:
            return 0
        return sum(await asyncio.gather(*(self._guarded(c) for c in mine)))

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """A slot of the concurrency gate, counted in ``_busy`` while held."""
        async with self._gate:
            self._busy += 1
            try:
                yield
            finally:
                self._busy -= 1

    async def _guarded(self, command: CommandRecord) -> int:
        async with self._slot():
            try:
                return 1 if await self.process(command) else 0
            except Exception:
                log.exception("command %s: dispatch failed", command.command_id)
                return 0

    # --- pre-claimed commands (ADR 0008) ---------------------------------------------------

    def reserve(self, kind: str) -> CommandSeat | None:
        """A seat for a command of ``kind`` an acceptance of this process is about to
        insert pre-claimed, or None (kind not served here, the dispatch loop not running,
        or every slot of the concurrency gate taken or reserved: the acceptance then
        inserts the command ``ACCEPTED`` and wakes the loop)."""
        loop = self._loop
        if kind not in self._providers or loop is None or not loop.running:
            return None
        if self._busy + len(self._reserved) >= self._concurrency:
            return None
        seat = CommandSeat(PreClaim(self._owner, self._policy.lease_ms), self)
        self._reserved.add(seat)
        return seat

    def _hand(self, seat: CommandSeat, started: Started) -> None:
        if seat not in self._reserved:
            return
        self._reserved.discard(seat)
        task = asyncio.ensure_future(self._guarded_started(started))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def _release(self, seat: CommandSeat) -> None:
        self._reserved.discard(seat)

    async def _guarded_started(self, started: Started) -> None:
        command = started.command
        # The seat kept a slot free since the reservation: this does not wait.
        async with self._slot():
            try:
                with command_span(command):
                    await self._drive(self._providers[command.effect_owner_kind], command, started)
            except Exception:
                log.exception("command %s: dispatch failed", command.command_id)

    async def settle(self, grace_s: float = 5.0) -> None:
        """Wait (bounded) for the handed commands still being driven, then cancel the
        rest — a cancelled one keeps its lease and its ``IN_FLIGHT`` attempt, which the
        next claim after the lease reconciles like any interrupted attempt. Call after
        the loops stopped (no new seat is reserved then)."""
        await settle_tasks(self._inflight, grace_s)

    async def process(self, command: CommandRecord) -> bool:
        """Claim one due command and drive it as far as this pass can.

        Returns:
            False when another dispatcher won the claim.
        """
        provider = self._providers[command.effect_owner_kind]

        async def claim(conn: AsyncConnection) -> Started | Reconciling:
            now = await db_now(conn)
            until = now + timedelta(milliseconds=self._policy.lease_ms)
            return await claim_txn(conn, command, owner=self._owner, lease_until=until, now=now)

        try:
            step: Started | Reconciling | None = await run_in_transaction(self._engine, claim)
        except FenceLostError:
            return False
        with command_span(command):
            return await self._drive(provider, command, step)

    async def _drive(
        self, provider: Provider, command: CommandRecord, step: Started | Reconciling | None
    ) -> bool:
        while step is not None:
            try:
                if isinstance(step, Started):
                    await self._attempt(provider, step)
                    step = None
                else:
                    step = await self._reconcile(provider, step)
            except FenceLostError:
                log.info("command %s: lease lost; a newer claim owns it", command.command_id)
                return True
        return True

    def _call_timeout(self) -> float:
        return self._policy.lease_ms / 1000 * 0.8

    async def _attempt(self, provider: Provider, started: Started) -> None:
        command = started.command
        kind = command.effect_owner_kind
        crash_point(CrashPoint.BEFORE_PROVIDER_CALL, kind)
        outcome = await self._submit(provider, command)
        if outcome.kind is ProviderOutcomeKind.SUCCEEDED:
            crash_point(CrashPoint.AFTER_PROVIDER_ACCEPTED, kind)

        async def record(conn: AsyncConnection) -> ReceiptRecord | None:
            # The command's lock and the clock in one statement: every write of the
            # outcome then goes in one round trip (ADR 0010).
            now = await hold_command_txn(conn, started.command)
            decision = decide_after_attempt(
                started.attempt.attempt_number, outcome, self._policy, now=now, rng=self._rng
            )
            return await record_attempt_txn(
                conn, started, outcome, decision, now, preclaim=self._preclaim(), held=True
            )

        receipt = await run_in_transaction(self._engine, record)
        if receipt is not None:
            crash_point(CrashPoint.AFTER_RECEIPT_COMMIT, kind)
            self._receipt_written(receipt)

    async def _submit(self, provider: Provider, command: CommandRecord) -> ProviderOutcome:
        request = ProviderCommand(
            org_id=command.org_id,
            command_id=command.command_id,
            effect_owner_kind=command.effect_owner_kind,
            idempotency_key=command.provider_idempotency_key,
            payload_schema_version=command.payload_schema_version,
            payload=json.loads(command.payload),
        )
        with provider_call(command.effect_owner_kind, "submit") as call:
            try:
                outcome = await asyncio.wait_for(provider.submit(request), self._call_timeout())
            except TimeoutError:
                outcome = ProviderOutcome.unknown("provider_call_timeout")
            except Exception:
                # The call may have reached the remote side before failing here.
                log.exception("provider %s raised for %s", provider.name, command.command_id)
                outcome = ProviderOutcome.unknown("provider_error")
            return call.done(outcome)

    async def _reconcile(self, provider: Provider, reconciling: Reconciling) -> Started | None:
        command = reconciling.command
        with provider_call(command.effect_owner_kind, "lookup") as call:
            try:
                found = await asyncio.wait_for(
                    provider.lookup(command.provider_idempotency_key), self._call_timeout()
                )
            except TimeoutError:
                found = ProviderOutcome.unknown("lookup_timeout")
            except Exception:
                log.exception("provider %s lookup raised for %s", provider.name, command.command_id)
                found = ProviderOutcome.unknown("lookup_error")
            if found is not None:
                call.done(found)
            else:
                call.outcome = "no_lookup"

        async def record(conn: AsyncConnection) -> ReceiptRecord | Started | None:
            now = await db_now(conn)
            decision = decide_after_lookup(
                found,
                replay_safe=provider.replay_safe,
                attempt_count=command.attempt_count,
                reconcile_attempts=command.reconcile_attempts,
                policy=self._policy,
                now=now,
                rng=self._rng,
            )
            return await record_lookup_txn(
                conn, reconciling, decision, now, preclaim=self._preclaim()
            )

        result = await run_in_transaction(self._engine, record)
        if isinstance(result, Started):
            return result
        if result is not None:
            crash_point(CrashPoint.AFTER_RECEIPT_COMMIT, command.effect_owner_kind)
            self._receipt_written(result)
        return None

    def _preclaim(self) -> PreClaim | None:
        return None if self._receipts is None else self._receipts.preclaim(EFFECT_COMPLETION_FAMILY)

    def _receipt_written(self, receipt: ReceiptRecord) -> None:
        # A receipt (and its owner-outbox message) committed: hand the pre-claimed message
        # to the receipt delivery, or wake it naming that message so it is claimed
        # without discovery.
        if receipt.delivery is not None and self._receipts is not None:
            self._receipts.hand(receipt.delivery)
        elif self._on_receipt is not None:
            self._on_receipt(receipt_hint(receipt))

    def loops(
        self, name: str = "effect-commands", *, wake: Wakeup | None = None
    ) -> list[BackgroundLoop]:
        """The dispatch loop (``services.background``; woken by ``wake``: a command was
        accepted in this process)."""

        async def body() -> bool:
            # Commands accepted in this process first (claimed without discovery). No
            # re-poll after them: the wake does not restart the idle backoff
            # (``wake_resets=False``), whose polls find other processes' commands; a wake
            # that named nothing dispatchable, or dropped hints, takes the ordinary pass.
            if wake is not None:
                done = await self.run_hinted(wake.take_hints())
                if done > 0 and not wake.take_lost():
                    return False
            return await self.run_once() > 0

        floor = self._idle_s / HINTED_IDLE_FLOOR if wake is not None else 0.0
        self._loop = BackgroundLoop(
            name,
            idle_s=self._idle_s,
            body=body,
            wake=wake,
            min_idle_s=floor,
            wake_resets=wake is None,
        )
        return [self._loop]


@dataclass(eq=False)
class CommandSeat:
    """A slot of a command dispatcher reserved for one acceptance (ADR 0008): insert the
    command with :attr:`lease`, then — after the COMMIT — :meth:`hand` the started
    command over, or :meth:`release` the seat (a duplicate, a refusal, a failed
    transaction). Both are idempotent; the first one wins."""

    lease: PreClaim
    dispatcher: CommandDispatcher

    def hand(self, started: Started) -> None:
        """Drive ``started`` — committed by the acceptance — now (a task of the dispatcher,
        in this seat's slot)."""
        self.dispatcher._hand(self, started)

    def release(self) -> None:
        """Give the slot back without a command."""
        self.dispatcher._release(self)


class CommandSeats:
    """Where this process's acceptances find its command dispatcher (set once the
    background starts; unset — no seat — before, after, and when
    ``FLOW_EFFECT_PRECLAIM_COMMAND`` is off)."""

    def __init__(self) -> None:
        self.dispatcher: CommandDispatcher | None = None

    def reserve(self, kind: str) -> CommandSeat | None:
        """:meth:`CommandDispatcher.reserve` of the current dispatcher, if any."""
        return None if self.dispatcher is None else self.dispatcher.reserve(kind)
