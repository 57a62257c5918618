"""Physical retention of Flow lineage (§10.1 ``DeleteFlowInterview`` step 7; §22.2
"physical retention refuses a non-terminal run or any live dependent/outbox reference").

Physical deletion is an internal retention operation, never a public path: a run and
its lineage (steps, attempts, checkpoints, dependencies, the wake signals those
dependencies consumed, effect links) are deleted only when

* the run is terminal (``Succeeded``/``TerminalFailed``/``Quarantined``/``Cancelled``);
* its retention anchor — the later of ``completed_at`` and ``delete_requested_at`` —
  is older than the retention window (a run with neither is never purged);
* every step, attempt and dependency is terminal, and every wake signal linked to one of
  its dependencies is resolved (``Consumed``/``Expired``);
* no Runtime outbox message of the run (by ``flow_run_id`` or through an effect link)
  is in a non-terminal delivery state;
* no audit/legal hold (``flow_runs.legal_hold``) is set.

Every condition is read from an allow-list of terminal codes, so an unknown code keeps
the run (fail closed). The candidate scan is a bounded, non-locking keyset read; each
candidate is then purged in its own transaction that locks the root first
(``SELECT … FOR UPDATE``, §12 order root → steps → attempts → dependencies), re-checks
everything under that lock and either deletes or skips with a reason. Deletes are by
primary key of the rows locked/read in that transaction, and every lifecycle delete is
fenced on the state it was checked in (row count must match, else
:class:`~services.errors.FenceLostError` rolls the whole purge back). The root delete is
fenced on its ``state_version``.

Kept on purpose: business records, business events and audit records (business and
audit evidence, not Flow lineage; a purge appends one audit record), and the Runtime
outbox rows themselves (transport rows with the dispatcher's own retention).

Owner receipts live in the effect owner's database; they are covered here through the
run's dependencies (an effect completion dependency is terminal only once its owner
receipt resolved it) and the outbox delivery states.

This module is part of the state store (``kernel/store*.py``): the only place allowed
to write the lifecycle tables (``tests/unit/kernel/test_kernel_write_boundary.py``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, false, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.states import (
    TERMINAL_ATTEMPT_OUTCOMES,
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
)
from runtime_svc.schema import (
    audit_records,
    flow_checkpoints,
    flow_dependencies,
    flow_effect_links,
    flow_runs,
    flow_step_attempts,
    flow_step_executions,
    flow_wake_signals,
    runtime_outbox,
)
from services.background import BackgroundLoop, OrgRotation, OrgSource
from services.db import WORK_SCOPE, db_now, run_in_transaction, transaction
from services.digest import canonical_json
from services.errors import FenceLostError, NotFoundError
from services.outbox import TERMINAL_STATES as OUTBOX_TERMINAL_STATES

__all__ = [
    "TERMINAL_DEPENDENCY_STATES",
    "TERMINAL_OUTBOX_DELIVERY_STATES",
    "TERMINAL_WAKE_SIGNAL_STATES",
    "PurgeReport",
    "PurgeSkip",
    "RetentionSweep",
    "SkipReason",
    "orgs_with_terminal_runs",
    "purge_expired_runs",
    "purge_run",
    "set_legal_hold",
]

log = logging.getLogger(__name__)

#: FlowDependency states with no way back to ``Pending`` (§10.5).
TERMINAL_DEPENDENCY_STATES = frozenset({"Resolved", "Expired", "Quarantined", "Cancelled"})
#: FlowWakeSignal resolution states that are final (§10.6); ``Unmatched`` is live.
TERMINAL_WAKE_SIGNAL_STATES = frozenset({"Consumed", "Expired"})
#: Runtime outbox delivery states that end transport delivery (§15.1, common/v1
#: ``OutboxDeliveryState``; the generic outbox's ``TERMINAL_STATES``); every other state,
#: pre-finalization included, is live.
TERMINAL_OUTBOX_DELIVERY_STATES = frozenset(s.value for s in OUTBOX_TERMINAL_STATES)

_TERMINAL_RUN_CODES = frozenset(s.code for s in TERMINAL_RUN_STATES)
_TERMINAL_STEP_CODES = frozenset(s.code for s in TERMINAL_STEP_STATES)
_TERMINAL_ATTEMPT_CODES = frozenset(o.code for o in TERMINAL_ATTEMPT_OUTCOMES)

_AUDIT_ACTION = "flow_run.purged"
_AUDIT_ACTOR_KIND = "System"
_AUDIT_ACTOR_ID = "flow-retention"


class SkipReason:
    """Why a candidate run was kept (the ``reason`` of a :class:`PurgeSkip`)."""

    GONE = "gone"
    NOT_TERMINAL = "run_not_terminal"
    LEGAL_HOLD = "legal_hold"
    NO_RETENTION_ANCHOR = "no_retention_anchor"
    WITHIN_RETENTION = "within_retention"
    LIVE_STEP = "live_step"
    LIVE_ATTEMPT = "live_attempt"
    LIVE_DEPENDENCY = "live_dependency"
    LIVE_WAKE_SIGNAL = "live_wake_signal"
    LIVE_OUTBOX = "live_outbox_message"
    FENCE_LOST = "fence_lost"


@dataclass(frozen=True)
class PurgeSkip:
    """A candidate that was kept, and why (a :class:`SkipReason` value)."""

    flow_run_id: str
    reason: str


@dataclass(frozen=True)
class PurgeReport:
    """One bounded purge batch of one org.

    Attributes:
        org_id: the trusted org the batch ran in.
        purged: ids of the runs physically deleted (with their lineage).
        skipped: candidates kept, each with its reason.
        rows_deleted: deleted row counts by table name.
        next_after: keyset cursor for the next batch (pass as ``after``); None when this
            batch saw the last candidate.
    """

    org_id: str
    purged: tuple[str, ...] = ()
    skipped: tuple[PurgeSkip, ...] = ()
    rows_deleted: Mapping[str, int] = field(default_factory=dict)
    next_after: str | None = None


@dataclass(frozen=True)
class _Purged:
    rows: Mapping[str, int]


def _retention_anchor(
    completed_at: datetime | None, delete_requested_at: datetime | None
) -> datetime | None:
    """The later of completion and delete request: both windows must have elapsed."""
    present = [t for t in (completed_at, delete_requested_at) if t is not None]
    return max(present) if present else None


def _check_retention(retention: timedelta, limit: int) -> None:
    if retention <= timedelta(0):
        raise ValueError("retention must be a positive window")
    if limit < 1:
        raise ValueError("limit must be >= 1")


# --- reads -------------------------------------------------------------------------------


async def _candidates(
    conn: AsyncConnection, org_id: str, cutoff: datetime, after: str | None, limit: int
) -> list[str]:
    """Terminal, unheld runs whose anchors are before ``cutoff``, in keyset order.

    Non-locking: every condition is checked again under the root lock."""
    r = flow_runs.c
    stmt = select(r.flow_run_id).where(
        r.org_id == org_id,
        r.runtime_state.in_(sorted(_TERMINAL_RUN_CODES)),
        r.legal_hold == false(),
        or_(r.completed_at.is_not(None), r.delete_requested_at.is_not(None)),
        or_(r.completed_at.is_(None), r.completed_at <= cutoff),
        or_(r.delete_requested_at.is_(None), r.delete_requested_at <= cutoff),
    )
    if after is not None:
        stmt = stmt.where(r.flow_run_id > after)
    stmt = stmt.order_by(r.flow_run_id).limit(limit)
    return [str(v) for v in (await conn.execute(stmt)).scalars()]


async def orgs_with_terminal_runs(
    engine: AsyncEngine, *, after: str | None = None, limit: int = 100
) -> list[str]:
    """Orgs that hold at least one terminal run, in org order after ``after`` (the default
    org source of the sweep, walked by an :class:`~services.background.OrgRotation`)."""
    r = flow_runs.c
    stmt = (
        select(r.org_id)
        .where(r.runtime_state.in_(sorted(_TERMINAL_RUN_CODES)))
        .group_by(r.org_id)
        .order_by(r.org_id)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(r.org_id > after)
    async with transaction(engine, readonly=True) as conn:
        return [str(v) for v in (await conn.execute(stmt)).scalars()]


# --- one run, under its root lock --------------------------------------------------------


async def _delete_exact(
    conn: AsyncConnection, stmt: Any, expected: int, entity: str, key: str
) -> int:
    """Run a fenced DELETE whose row count must be ``expected`` (else roll back)."""
    if expected == 0:
        return 0
    count = int((await conn.execute(stmt)).rowcount)
    if count != expected:
        raise FenceLostError(entity, key, expected, count)
    return count


async def _purge_run_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    *,
    retention: timedelta,
    now: datetime | None,
) -> _Purged | PurgeSkip:
    """Lock the root, re-check every condition, then delete the run and its lineage."""
    current = now if now is not None else await db_now(conn)
    cutoff = current - retention
    r = flow_runs.c
    root = (
        (
            await conn.execute(
                select(
                    *(r[c] for c in WORK_SCOPE),
                    r.flow_run_id,
                    r.runtime_state,
                    r.state_version,
                    r.legal_hold,
                    r.completed_at,
                    r.delete_requested_at,
                )
                .where(r.org_id == org_id, r.flow_run_id == flow_run_id)
                .with_for_update()
            )
        )
        .mappings()
        .first()
    )
    if root is None:
        return PurgeSkip(flow_run_id, SkipReason.GONE)
    if root["runtime_state"] not in _TERMINAL_RUN_CODES:
        return PurgeSkip(flow_run_id, SkipReason.NOT_TERMINAL)
    if root["legal_hold"]:
        return PurgeSkip(flow_run_id, SkipReason.LEGAL_HOLD)
    anchor = _retention_anchor(root["completed_at"], root["delete_requested_at"])
    if anchor is None:
        return PurgeSkip(flow_run_id, SkipReason.NO_RETENTION_ANCHOR)
    if anchor > cutoff:
        return PurgeSkip(flow_run_id, SkipReason.WITHIN_RETENTION)

    # Steps, then their attempts and dependencies (§12 lifecycle sub-order).
    s = flow_step_executions.c
    steps = (
        (
            await conn.execute(
                select(s.step_execution_id, s.state)
                .where(s.org_id == org_id, s.flow_run_id == flow_run_id)
                .order_by(s.step_execution_id)
                .with_for_update()
            )
        )
        .mappings()
        .all()
    )
    if any(row["state"] not in _TERMINAL_STEP_CODES for row in steps):
        return PurgeSkip(flow_run_id, SkipReason.LIVE_STEP)
    step_ids = [str(row["step_execution_id"]) for row in steps]

    a = flow_step_attempts.c
    attempts: Sequence[Any] = []
    if step_ids:
        attempts = (
            (
                await conn.execute(
                    select(a.attempt_id, a.transaction_outcome)
                    .where(a.org_id == org_id, a.step_execution_id.in_(step_ids))
                    .order_by(a.attempt_id)
                    .with_for_update()
                )
            )
            .mappings()
            .all()
        )
    if any(row["transaction_outcome"] not in _TERMINAL_ATTEMPT_CODES for row in attempts):
        return PurgeSkip(flow_run_id, SkipReason.LIVE_ATTEMPT)

    # Dependencies through their step index (every dependency names a step of its run).
    d = flow_dependencies.c
    dependencies: Sequence[Any] = []
    if step_ids:
        dependencies = (
            (
                await conn.execute(
                    select(d.dependency_id, d.state)
                    .where(
                        d.org_id == org_id,
                        d.step_execution_id.in_(step_ids),
                        d.flow_run_id == flow_run_id,
                    )
                    .order_by(d.dependency_id)
                    .with_for_update()
                )
            )
            .mappings()
            .all()
        )
    if any(row["state"] not in TERMINAL_DEPENDENCY_STATES for row in dependencies):
        return PurgeSkip(flow_run_id, SkipReason.LIVE_DEPENDENCY)
    dependency_ids = [str(row["dependency_id"]) for row in dependencies]

    # Wake signals a dependency of this run consumed (no lock needed: a signal linked to a
    # terminal dependency cannot change any more; deletes below go by primary key).
    w = flow_wake_signals.c
    signals: Sequence[Any] = []
    if dependency_ids:
        signals = (
            (
                await conn.execute(
                    select(*(w[c] for c in WORK_SCOPE), w.wake_signal_id, w.resolution_state)
                    .where(w.org_id == org_id, w.dependency_id.in_(dependency_ids))
                    .order_by(w.wake_signal_id)
                )
            )
            .mappings()
            .all()
        )
    if any(row["resolution_state"] not in TERMINAL_WAKE_SIGNAL_STATES for row in signals):
        return PurgeSkip(flow_run_id, SkipReason.LIVE_WAKE_SIGNAL)

    # Outbox: no new message can appear for a terminal root (every producer commit locks
    # the root first), and delivery states only move towards terminal, so a read suffices.
    e = flow_effect_links.c
    links = (
        (
            await conn.execute(
                select(*(e[c] for c in WORK_SCOPE), e.effect_link_id, e.runtime_outbox_message_id)
                .where(e.org_id == org_id, e.flow_run_id == flow_run_id)
                .order_by(e.effect_link_id)
            )
        )
        .mappings()
        .all()
    )
    o = runtime_outbox.c
    linked_messages = sorted({str(row["runtime_outbox_message_id"]) for row in links})
    references = [o.flow_run_id == flow_run_id]
    if linked_messages:
        references.append(o.runtime_outbox_message_id.in_(linked_messages))
    live_outbox = (
        await conn.execute(
            select(o.runtime_outbox_message_id)
            .where(
                o.org_id == org_id,
                or_(*references),
                o.delivery_state.not_in(sorted(TERMINAL_OUTBOX_DELIVERY_STATES)),
            )
            .limit(1)
        )
    ).first()
    if live_outbox is not None:
        return PurgeSkip(flow_run_id, SkipReason.LIVE_OUTBOX)

    # Delete leaves first (foreign keys: links/checkpoints/steps -> root, attempts and
    # dependencies -> steps). Each delete is fenced on what was checked above.
    rows: dict[str, int] = {}
    key = f"org_id={org_id},flow_run_id={flow_run_id}"
    for sig in signals:
        stmt = delete(flow_wake_signals).where(
            *(w[c] == sig[c] for c in WORK_SCOPE),
            w.wake_signal_id == sig["wake_signal_id"],
            w.resolution_state.in_(sorted(TERMINAL_WAKE_SIGNAL_STATES)),
        )
        rows["flow_wake_signals"] = rows.get("flow_wake_signals", 0) + await _delete_exact(
            conn, stmt, 1, "flow_wake_signal", key
        )
    for link in links:
        stmt = delete(flow_effect_links).where(
            *(e[c] == link[c] for c in WORK_SCOPE), e.effect_link_id == link["effect_link_id"]
        )
        rows["flow_effect_links"] = rows.get("flow_effect_links", 0) + await _delete_exact(
            conn, stmt, 1, "flow_effect_link", key
        )
    if dependency_ids:
        rows["flow_dependencies"] = await _delete_exact(
            conn,
            delete(flow_dependencies).where(
                d.org_id == org_id,
                d.dependency_id.in_(dependency_ids),
                d.state.in_(sorted(TERMINAL_DEPENDENCY_STATES)),
            ),
            len(dependency_ids),
            "flow_dependency",
            key,
        )
    if attempts:
        rows["flow_step_attempts"] = await _delete_exact(
            conn,
            delete(flow_step_attempts).where(
                a.org_id == org_id,
                a.attempt_id.in_([str(row["attempt_id"]) for row in attempts]),
                a.transaction_outcome.in_(sorted(_TERMINAL_ATTEMPT_CODES)),
            ),
            len(attempts),
            "flow_step_attempt",
            key,
        )
    c = flow_checkpoints.c
    checkpoint_ids = [
        str(v)
        for v in (
            await conn.execute(
                select(c.checkpoint_id)
                .where(c.org_id == org_id, c.flow_run_id == flow_run_id)
                .order_by(c.checkpoint_id)
            )
        ).scalars()
    ]
    if checkpoint_ids:
        rows["flow_checkpoints"] = await _delete_exact(
            conn,
            delete(flow_checkpoints).where(
                c.org_id == org_id,
                c.checkpoint_id.in_(checkpoint_ids),
                c.flow_run_id == flow_run_id,
            ),
            len(checkpoint_ids),
            "flow_checkpoint",
            key,
        )
    if step_ids:
        rows["flow_step_executions"] = await _delete_exact(
            conn,
            delete(flow_step_executions).where(
                s.org_id == org_id,
                s.step_execution_id.in_(step_ids),
                s.state.in_(sorted(_TERMINAL_STEP_CODES)),
            ),
            len(step_ids),
            "flow_step_execution",
            key,
        )
    version = int(root["state_version"])
    root_delete = delete(flow_runs).where(
        r.org_id == org_id,
        r.flow_run_id == flow_run_id,
        r.state_version == version,
        r.runtime_state == root["runtime_state"],
        r.legal_hold == false(),
    )
    if int((await conn.execute(root_delete)).rowcount) != 1:
        raise FenceLostError("flow_run", key, version, None)
    rows["flow_runs"] = 1

    # Audit evidence of the purge itself (kept: audit records are not lineage).
    await conn.execute(
        audit_records.insert().values(
            org_id=org_id,
            audit_record_id=f"aud_{uuid.uuid4().hex}",
            actor_kind=_AUDIT_ACTOR_KIND,
            actor_id=_AUDIT_ACTOR_ID,
            action=_AUDIT_ACTION,
            flow_run_id=flow_run_id,
            details=canonical_json(
                {
                    "runtime_state": root["runtime_state"],
                    "retention_seconds": int(retention.total_seconds()),
                    "rows_deleted": dict(sorted(rows.items())),
                }
            ).decode("utf-8"),
            occurred_at=current,
        )
    )
    return _Purged(rows)


async def purge_run(
    engine: AsyncEngine,
    org_id: str,
    flow_run_id: str,
    *,
    retention: timedelta,
    now: datetime | None = None,
) -> PurgeSkip | None:
    """Purge one run in its own transaction: None when it was deleted, else why not.

    Args:
        engine: the runtime database.
        org_id: the trusted org (every statement is scoped by it).
        flow_run_id: the run.
        retention: how long a terminal run is kept after its retention anchor.
        now: the retention clock; the database clock (``db_now``) when None.

    Raises:
        FenceLostError: a row changed between the check and its fenced delete (the whole
            purge of this run rolled back).
        ValueError: a non-positive ``retention``.
    """
    _check_retention(retention, 1)
    outcome = await run_in_transaction(
        engine,
        lambda conn: _purge_run_txn(conn, org_id, flow_run_id, retention=retention, now=now),
    )
    return outcome if isinstance(outcome, PurgeSkip) else None


async def purge_expired_runs(
    engine: AsyncEngine,
    org_id: str,
    *,
    retention: timedelta,
    now: datetime | None = None,
    limit: int = 100,
    after: str | None = None,
) -> PurgeReport:
    """One bounded retention batch of ``org_id``: scan up to ``limit`` candidates after
    the keyset cursor ``after``, then purge each in its own transaction (root lock,
    re-check, delete) or skip it with a reason.

    Args:
        engine: the runtime database.
        org_id: the trusted org; nothing outside it is read or deleted.
        retention: how long a terminal run is kept after the later of its completion and
            its delete request.
        now: the retention clock; the database clock (``db_now``) when None.
        limit: the most candidates one batch considers.
        after: resume after this run id (the previous report's ``next_after``).

    Raises:
        ValueError: a non-positive ``retention`` or ``limit``.
    """
    _check_retention(retention, limit)
    async with transaction(engine, readonly=True) as conn:
        current = now if now is not None else await db_now(conn)
        candidates = await _candidates(conn, org_id, current - retention, after, limit)
    purged: list[str] = []
    skipped: list[PurgeSkip] = []
    totals: dict[str, int] = {}
    for run_id in candidates:

        async def fn(conn: AsyncConnection, rid: str = run_id) -> _Purged | PurgeSkip:
            return await _purge_run_txn(conn, org_id, rid, retention=retention, now=now)

        try:
            outcome = await run_in_transaction(engine, fn)
        except FenceLostError as exc:
            # A concurrent writer moved a row between check and delete: keep the run.
            log.info("retention: %s/%s kept after a lost fence: %s", org_id, run_id, exc)
            skipped.append(PurgeSkip(run_id, SkipReason.FENCE_LOST))
            continue
        if isinstance(outcome, PurgeSkip):
            skipped.append(outcome)
            continue
        purged.append(run_id)
        for table, count in outcome.rows.items():
            totals[table] = totals.get(table, 0) + count
    next_after = candidates[-1] if len(candidates) == limit else None
    return PurgeReport(org_id, tuple(purged), tuple(skipped), totals, next_after)


async def set_legal_hold(engine: AsyncEngine, org_id: str, flow_run_id: str, *, hold: bool) -> None:
    """Set or clear the audit/legal hold of a run (idempotent).

    A hold is a retention fact, not a lifecycle transition: it does not advance
    ``state_version``, so it never fences an in-flight worker.

    Raises:
        NotFoundError: no such run in ``org_id``.
    """

    async def fn(conn: AsyncConnection) -> None:
        r = flow_runs.c
        locked = (
            await conn.execute(
                select(r.flow_run_id)
                .where(r.org_id == org_id, r.flow_run_id == flow_run_id)
                .with_for_update()
            )
        ).first()
        if locked is None:
            raise NotFoundError("flow_run", flow_run_id)
        await conn.execute(
            update(flow_runs)
            .where(and_(r.org_id == org_id, r.flow_run_id == flow_run_id))
            .values(legal_hold=hold)
        )

    await run_in_transaction(engine, fn)


# --- background sweep (STYLE 12 lifecycle) ---------------------------------------------


class RetentionSweep(BackgroundLoop):
    """Background retention loop (``services.background`` lifecycle): every
    ``interval_s``, purge the expired runs of the next batch of orgs in bounded batches
    (at most ``max_batches`` of ``batch_size`` per org and pass); the org rotation
    resumes after the last org served, so every org is reached.

    Args:
        engine: the runtime database.
        retention: the retention window.
        orgs: the trusted org source ``(after, limit) -> orgs``;
            :func:`orgs_with_terminal_runs` by default.
        interval_s: pause between passes.
        batch_size: candidates per batch (``limit`` of :func:`purge_expired_runs`).
        max_batches: batches per org and pass.
        org_batch: orgs per pass.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        retention: timedelta,
        orgs: OrgSource | None = None,
        interval_s: float = 300.0,
        batch_size: int = 100,
        max_batches: int = 10,
        org_batch: int = 100,
    ) -> None:
        _check_retention(retention, batch_size)
        if max_batches < 1 or interval_s <= 0:
            raise ValueError("max_batches must be >= 1 and interval_s > 0")
        super().__init__("flow-retention", idle_s=interval_s, interval=True)
        self._engine = engine
        self.retention = retention

        async def terminal(after: str | None, limit: int) -> list[str]:
            return await orgs_with_terminal_runs(engine, after=after, limit=limit)

        self._orgs = OrgRotation(orgs or terminal, batch=org_batch)
        self._batch_size = batch_size
        self._max_batches = max_batches

    async def sweep_org(self, org_id: str) -> list[PurgeReport]:
        """Up to ``max_batches`` batches of one org (stops early at shutdown)."""
        reports: list[PurgeReport] = []
        after: str | None = None
        for _ in range(self._max_batches):
            report = await purge_expired_runs(
                self._engine,
                org_id,
                retention=self.retention,
                limit=self._batch_size,
                after=after,
            )
            reports.append(report)
            after = report.next_after
            if after is None or self.stopping:
                break
        return reports

    async def sweep_once(self) -> list[PurgeReport]:
        """One pass over the next batch of orgs."""
        reports: list[PurgeReport] = []
        for org_id in await self._orgs.next_batch():
            if self.stopping:
                break
            reports.extend(await self.sweep_org(org_id))
        return reports

    async def run_once(self) -> bool:
        reports = await self.sweep_once()
        purged = sum(len(r.purged) for r in reports)
        if purged:
            log.info("retention: purged %d run(s)", purged)
        return False  # a slow duty: always wait the interval
