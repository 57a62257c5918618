"""The effect sweep of the runtime process: the handoff disposition of cancelled runs
(§10.1, §11.1), the repair of terminal non-delivery under an unconverged Flow (§15.4),
and the expiry guard of completion dependencies.

**Cancellation** (§10.1: "pending handoff delivery is cancelled only after the owner
returns the durable ``Rejected`` fence receipt; an accepted receipt continues owner
outcome tracking and an unknown receipt quarantines"). A cancel request fences the root
and the waiting ``EffectCompletion`` step but leaves the completion dependency
``Pending``; for each such run one pass of :meth:`EffectSweeper.sweep_org` looks at the
canonical outbox message and the receipts of the handoff key (no locks) and then, in one
root-first transaction (root → step → dependency → signal / outbox row last):

* an unmatched completion receipt → consumed onto the dependency; the run ends
  ``Cancelled`` (``cancelled_after_effect`` when the effect happened) or, for
  ``OUTCOME_UNKNOWN``, ``Quarantined`` — never "rolled back";
* a message still ``Pending``/``Retrying`` → asked to reconcile now
  (``RejectIfUnaccepted``); the finalizer then completes the cancellation on
  ``Rejected``, quarantines on ``AcceptanceUnknown``, or delivery is repaired on
  ``Accepted`` and the receipt is awaited;
* a delivered (accepted) message whose dependency deadline passed without a receipt →
  quarantined (``effect_outcome_unreported``).

**Repair** (§15.4 "a durable repair sweep"): a ``HandoffRejected``/``DeadLettered``
message whose dependency is still ``Pending`` (impossible through the finalizer, which
converges the Flow and the message in one transaction — but a repair scan must not
assume it) gets the same root-first convergence.

**Expiry guard**: a completion dependency whose handoff is not yet settled (delivered or
finalized) does not expire by deadline; the message's own deadline (the same instant)
drives it to reconciliation, and the finalizer applies the compiled policy on the
owner's proven rejection — so a fault path never runs while the effect may still be
accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Integer, Select, and_, bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.effects.finalizer import converge_txn, fault_step_of, scope_of_message
from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.states import RunState
from runtime_svc.kernel.store_rows import lock_run, lock_step
from runtime_svc.kernel.store_waits import (
    apply_wait_transition,
    dependency_from_row,
    lock_dependency,
    lock_signal,
)
from runtime_svc.kernel.transitions_effects import (
    decide_cancelled_receipt,
    decide_cancelled_unreported,
)
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyRecord, DependencyState, SignalRecord
from runtime_svc.outbox import RUNTIME_OUTBOX
from runtime_svc.schema import flow_dependencies, flow_runs, runtime_outbox
from runtime_svc.waits import queries
from runtime_svc.waits.resolution import Clock, Matcher
from services.db import db_now, run_in_transaction, transaction
from services.effect_contract import (
    CompletionEvidence,
    EffectContractError,
    runtime_outbox_message_id,
)
from services.errors import FenceLostError
from services.outbox import (
    DeliveryState,
    Disposition,
    OutboxMessage,
    get_message,
    request_reconciliation_txn,
)

__all__ = ["EffectSweepStats", "EffectSweeper", "orgs_with_effect_work"]

log = logging.getLogger(__name__)

_PENDING = DependencyState.PENDING.code
_SETTLED = frozenset(
    {
        DeliveryState.DELIVERED,
        DeliveryState.HANDOFF_REJECTED,
        DeliveryState.DEAD_LETTERED,
    }
)
_NON_DELIVERY = {
    DeliveryState.HANDOFF_REJECTED: Disposition.REJECTED,
    DeliveryState.DEAD_LETTERED: Disposition.UNKNOWN,
}


@dataclass
class EffectSweepStats:
    """What one pass did."""

    cancel_receipts: int = 0
    reconcile_requested: int = 0
    cancel_unreported: int = 0
    repaired: int = 0

    def add(self, other: EffectSweepStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _orgs_page(org_id: Any, *where: Any) -> Select[Any]:
    """One keyset page of orgs (``org_id > :after``, ``LIMIT :limit``), built once."""
    after = bindparam("after", type_=org_id.type)
    limit = bindparam("limit", type_=Integer())
    page = select(org_id).where(*where, org_id > after).group_by(org_id).order_by(org_id)
    return page.limit(limit)


#: Orgs with a cancelling run, and orgs with a terminal non-delivery handoff message
#: (the sweep's discovery on every pass: built once, bound per pass).
_ORGS_WITH_EFFECT_WORK = (
    _orgs_page(flow_runs.c.org_id, flow_runs.c.runtime_state == RunState.CANCEL_REQUESTED.code),
    _orgs_page(
        runtime_outbox.c.org_id,
        runtime_outbox.c.delivery_state.in_(sorted(s.value for s in _NON_DELIVERY)),
    ),
)


async def orgs_with_effect_work(
    engine: AsyncEngine, *, after: str = "", limit: int = 100
) -> list[str]:
    """Orgs with a cancelling run or a terminal non-delivery handoff message, after
    ``after`` in id order (bounded keyset pages)."""
    params = {"after": after, "limit": limit}
    async with transaction(engine, readonly=True) as conn:
        found: set[str] = set()
        for query in _ORGS_WITH_EFFECT_WORK:
            found |= {str(x) for x in (await conn.execute(query, params)).scalars()}
    return sorted(found)[:limit]


async def cancelling_handoffs_txn(
    conn: AsyncConnection, org_id: str, limit: int
) -> list[DependencyRecord]:
    """Pending completion dependencies of ``CancelRequested`` runs' current steps."""
    r, d = flow_runs.c, flow_dependencies.c
    stmt = (
        select(flow_dependencies)
        .join(
            flow_runs,
            and_(r.org_id == d.org_id, r.current_step_execution_id == d.step_execution_id),
        )
        .where(
            r.org_id == org_id,
            r.runtime_state == RunState.CANCEL_REQUESTED.code,
            d.producer_kind == EFFECT_COMPLETION_PRODUCER,
            d.state == _PENDING,
        )
        .order_by(r.flow_run_id)
        .limit(limit)
    )
    return [dependency_from_row(row) for row in (await conn.execute(stmt)).mappings()]


async def undelivered_with_pending_txn(
    conn: AsyncConnection, org_id: str, after: str, limit: int
) -> list[tuple[str, DependencyRecord]]:
    """``(message id, dependency)`` of terminal non-delivery messages whose completion
    dependency is still pending, by message id after ``after`` (keyset)."""
    o, d = runtime_outbox.c, flow_dependencies.c
    stmt = (
        select(o.runtime_outbox_message_id, flow_dependencies)
        .join(
            flow_dependencies,
            and_(
                d.org_id == o.org_id,
                d.app_installation_id == o.app_installation_id,
                d.runtime_capability_id == o.runtime_capability_id,
                d.runtime_work_binding_digest == o.runtime_work_binding_digest,
                d.producer_kind == EFFECT_COMPLETION_PRODUCER,
                d.producer_key == o.effect_handoff_key,
                d.state == _PENDING,
            ),
        )
        .where(
            o.org_id == org_id,
            o.delivery_state.in_(sorted(s.value for s in _NON_DELIVERY)),
            o.runtime_outbox_message_id > after,
        )
        .order_by(o.runtime_outbox_message_id)
        .limit(limit)
    )
    rows = (await conn.execute(stmt)).mappings().all()
    return [(str(row["runtime_outbox_message_id"]), dependency_from_row(row)) for row in rows]


def _evidence(signal: SignalRecord, key: str) -> CompletionEvidence | None:
    """A receipt's evidence when it is a well-formed receipt of ``key``, else None."""
    if signal.producer_kind != EFFECT_COMPLETION_PRODUCER or not signal.evidence_json:
        return None
    try:
        evidence = CompletionEvidence.from_json(signal.evidence_json)
    except EffectContractError:
        return None
    if evidence.effect_handoff_key != key or signal.wake_version != evidence.outcome_version:
        return None
    return evidence


class EffectSweeper:
    """Cancellation dispositions, terminal non-delivery repair and the expiry guard
    (see the module docstring).

    Args:
        engine: the runtime database.
        matcher: plan lookups (a fault successor on repair).
        clock: the durable clock.
        batch: rows each part of one org's pass handles at most.
    """

    def __init__(
        self, engine: AsyncEngine, matcher: Matcher, *, clock: Clock = db_now, batch: int = 100
    ) -> None:
        self._engine = engine
        self._matcher = matcher
        self._clock = clock
        self._batch = batch
        self._org_cursor = ""
        self._repair_cursors: dict[str, str] = {}

    async def sweep_once(self, *, org_limit: int = 100) -> EffectSweepStats:
        """One pass over a page of orgs with effect work."""
        orgs = await orgs_with_effect_work(self._engine, after=self._org_cursor, limit=org_limit)
        self._org_cursor = orgs[-1] if len(orgs) == org_limit else ""
        total = EffectSweepStats()
        for org in orgs:
            try:
                total.add(await self.sweep_org(org))
            except Exception:
                log.exception("effect sweep of %s failed; next pass retries", org)
        return total

    async def sweep_org(self, org_id: str) -> EffectSweepStats:
        """One bounded pass over ``org_id``."""
        stats = EffectSweepStats()
        async with transaction(self._engine, readonly=True) as conn:
            cancelling = await cancelling_handoffs_txn(conn, org_id, self._batch)
        for dep in cancelling:
            await self._cancelling(dep, stats)
        await self._repair(org_id, stats)
        return stats

    # --- expiry guard ---------------------------------------------------------------------

    async def expiry_allowed(self, dep: DependencyRecord) -> bool:
        """Whether the waits sweep may expire ``dep`` by its deadline: always for other
        producers; for a completion dependency only once its handoff settled."""
        if dep.producer_kind != EFFECT_COMPLETION_PRODUCER:
            return True
        async with transaction(self._engine, readonly=True) as conn:
            message = await get_message(
                conn, RUNTIME_OUTBOX, dep.org_id, runtime_outbox_message_id(dep.producer_key)
            )
        return message is None or message.delivery_state in _SETTLED

    # --- cancellation ---------------------------------------------------------------------

    async def _cancelling(self, found: DependencyRecord, stats: EffectSweepStats) -> None:
        async with transaction(self._engine, readonly=True) as conn:
            now = await self._clock(conn)
            message = await get_message(
                conn, RUNTIME_OUTBOX, found.org_id, runtime_outbox_message_id(found.producer_key)
            )
            signals = await queries.unmatched_for_key_txn(
                conn, found.scope, found.producer_kind, found.producer_key, 20
            )
        receipts = [(s, e) for s in signals if (e := _evidence(s, found.producer_key)) is not None]
        state = None if message is None else message.delivery_state
        try:
            if receipts:
                done = await self._consume(found, *receipts[0])
                stats.cancel_receipts += done
            elif message is not None and state in (DeliveryState.PENDING, DeliveryState.RETRYING):
                stats.reconcile_requested += await self._ask_fence(found, message)
            elif state is DeliveryState.DELIVERED and found.deadline <= now:
                stats.cancel_unreported += await self._unreported(found)
            elif state is not None and state in _NON_DELIVERY:
                stats.repaired += await self._converge(found, _NON_DELIVERY[state])
        except FenceLostError:
            log.info("effect sweep: %s moved meanwhile; next pass", found.dependency_id)

    async def _consume(
        self, found: DependencyRecord, signal: SignalRecord, evidence: CompletionEvidence
    ) -> bool:
        receipt = {
            "producer": found.producer_kind,
            "wake_signal_id": signal.wake_signal_id,
            "wake_token": signal.wake_token,
            "wake_version": signal.wake_version,
            "evidence_digest": signal.evidence_digest,
            "command_id": evidence.command_id,
            "outcome": evidence.outcome.value,
            "cancellation": "requested_before_receipt",
        }

        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            now = await self._clock(conn)
            root = await lock_run(conn, found.org_id, found.flow_run_id)
            step = await lock_step(conn, found.org_id, found.step_execution_id)
            dep = await lock_dependency(conn, found.org_id, found.dependency_id)
            locked = await lock_signal(conn, found.scope, signal.wake_signal_id)
            if root is None or dep is None or locked is None:
                return NoChange("missing")
            decision = decide_cancelled_receipt(
                root, step, dep, locked, now, outcome=evidence.outcome.value, receipt=receipt
            )
            if isinstance(decision, WaitTransition):
                await apply_wait_transition(conn, found.org_id, decision, now)
            return decision

        return isinstance(await run_in_transaction(self._engine, fn), WaitTransition)

    async def _ask_fence(self, found: DependencyRecord, message: OutboxMessage) -> bool:
        async def fn(conn: AsyncConnection) -> bool:
            now = await self._clock(conn)
            root = await lock_run(conn, found.org_id, found.flow_run_id)
            await lock_step(conn, found.org_id, found.step_execution_id)
            dep = await lock_dependency(conn, found.org_id, found.dependency_id)
            if root is None or dep is None or dep.state is not DependencyState.PENDING:
                return False
            if root.state is not RunState.CANCEL_REQUESTED:
                return False
            # Last in the root-first order: the outbox row (a fenced update, no read lock).
            await request_reconciliation_txn(conn, RUNTIME_OUTBOX, message, now=now)
            return True

        return await run_in_transaction(self._engine, fn)

    async def _unreported(self, found: DependencyRecord) -> bool:
        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            now = await self._clock(conn)
            root = await lock_run(conn, found.org_id, found.flow_run_id)
            step = await lock_step(conn, found.org_id, found.step_execution_id)
            dep = await lock_dependency(conn, found.org_id, found.dependency_id)
            if root is None or dep is None:
                return NoChange("missing")
            decision = decide_cancelled_unreported(root, step, dep, now)
            if isinstance(decision, WaitTransition):
                await apply_wait_transition(conn, found.org_id, decision, now)
            return decision

        return isinstance(await run_in_transaction(self._engine, fn), WaitTransition)

    # --- repair ---------------------------------------------------------------------------

    async def _converge(self, found: DependencyRecord, disposition: Disposition) -> bool:
        async with transaction(self._engine, readonly=True) as conn:
            fault = None
            if disposition is Disposition.REJECTED:
                fault = await fault_step_of(self._matcher, conn, found)

        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            now = await self._clock(conn)
            return await converge_txn(conn, found, disposition, now, fault)

        return isinstance(await run_in_transaction(self._engine, fn), WaitTransition)

    async def _repair(self, org_id: str, stats: EffectSweepStats) -> None:
        after = self._repair_cursors.get(org_id, "")
        async with transaction(self._engine, readonly=True) as conn:
            broken = await undelivered_with_pending_txn(conn, org_id, after, self._batch)
            messages = [
                await get_message(conn, RUNTIME_OUTBOX, org_id, message_id)
                for message_id, _ in broken
            ]
        self._repair_cursors[org_id] = broken[-1][0] if len(broken) == self._batch else ""
        for (message_id, dep), message in zip(broken, messages, strict=True):
            if message is None or message.delivery_state not in _NON_DELIVERY:
                continue
            if scope_of_message(message) != dep.scope:
                continue
            log.warning(
                "effect repair: %s is %s while its dependency %s is pending; converging",
                message_id,
                message.delivery_state.value,
                dep.dependency_id,
            )
            try:
                if await self._converge(dep, _NON_DELIVERY[message.delivery_state]):
                    stats.repaired += 1
            except FenceLostError:
                continue
