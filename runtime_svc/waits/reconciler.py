"""The wait sweeps of the runtime process (§14.2 step 4, §14.3, §14.4): durable,
bounded, jittered — no process timer, no unbounded scan.

One :meth:`WaitSweeper.sweep_org` pass does, each part bounded by ``batch`` rows over an
index led by ``org_id``:

1. **due probes** — timers whose due time passed resolve; producer-backed dependencies
   are re-matched (the periodic reconciler that closes a crash on either side of the
   notify-before-wait race). A probe that finds nothing is rescheduled with jittered
   exponential backoff; after the policy's ``max_reconciliation_attempts`` the dependency
   is only woken by a notification or its deadline (a missing producer never polls
   forever);
2. **owed signal matches** — signals whose producer crashed between commit and match;
3. **deadlines** — the compiled expiry policy, one root-first transaction each (a timer
   due before its deadline resolves instead);
4. **repair** — a keyset cursor over ``Waiting`` roots: a terminal dependency under a
   ``Waiting`` root is invariant corruption and gets the root-first finalizer;
5. **signal retention** — unmatched signals past their bound expire; expired ones are
   purged a week later; idle watch registrations are dropped.

Candidates are discovered without locks; every transition locks root first
(:class:`~runtime_svc.kernel.store_waits.WaitStore`). A lost race is re-read next pass.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, exists, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler.inputs import WaitPolicy
from runtime_svc.compiler.kinds import RECORD_CHANGE_PRODUCER
from runtime_svc.kernel.states import RunState
from runtime_svc.kernel.store_waits import FaultStep
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyRecord, DependencyState, SignalState
from runtime_svc.schema import flow_dependencies, flow_record_watches, flow_runs, flow_wake_signals
from runtime_svc.waits import queries
from runtime_svc.waits.record_producer import RecordWatches
from runtime_svc.waits.registry import ProducerFamily
from runtime_svc.waits.resolution import Matcher
from services.background import OrgRotation
from services.db import db_now, run_in_transaction, transaction
from services.errors import NotFoundError

__all__ = ["SweepStats", "WaitSweeper", "orgs_with_waits"]

log = logging.getLogger(__name__)

#: Expired signals are purged this long after their retention bound.
_PURGE_AFTER = timedelta(days=7)
#: A watch registration idle this long, with no pending dependency, is dropped.
_WATCH_IDLE = timedelta(hours=1)
#: Watch cleanup runs on one pass in this many.
_WATCH_EVERY = 60
#: Reasons a probe did not finish (a concurrent transition moved first): no reschedule.
_RACED = frozenset({"lost_race", "superseded"})


@dataclass
class SweepStats:
    """What one pass did (the benchmark and tests read it)."""

    probes: int = 0
    resolved: int = 0
    rescheduled: int = 0
    signals_matched: int = 0
    expired: int = 0
    repaired: int = 0
    signals_expired: int = 0
    purged: int = 0

    def add(self, other: SweepStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


async def orgs_with_waits(engine: AsyncEngine, *, after: str = "", limit: int = 100) -> list[str]:
    """Orgs with ``Waiting`` runs, owed signal matches, or signals past their retention,
    after ``after`` in id order (bounded keyset pages; the sweep walks every org across
    passes)."""
    r, w = flow_runs.c, flow_wake_signals.c
    waiting = (
        select(r.org_id)
        .where(r.runtime_state == RunState.WAITING.code, r.org_id > after)
        .group_by(r.org_id)
        .order_by(r.org_id)
        .limit(limit)
    )
    owed = (
        select(w.org_id)
        .where(w.next_match_at.is_not(None), w.org_id > after)
        .group_by(w.org_id)
        .order_by(w.org_id)
        .limit(limit)
    )
    async with transaction(engine, readonly=True) as conn:
        now = await db_now(conn)
        retired = (
            select(w.org_id)
            .where(
                w.resolution_state.in_([SignalState.UNMATCHED.code, SignalState.EXPIRED.code]),
                w.expires_at < now,
                w.org_id > after,
            )
            .group_by(w.org_id)
            .order_by(w.org_id)
            .limit(limit)
        )
        found: set[str] = set()
        for query in (waiting, owed, retired):
            found |= {str(o) for o in (await conn.execute(query)).scalars()}
    return sorted(found)[:limit]


class WaitSweeper:
    """Bounded, jittered wait sweeps of the runtime process (see the module docstring).

    Args:
        engine: the runtime database.
        matcher: matching and the kernel's wait transitions.
        batch: rows each part of one org's pass handles at most.
        rng: probe jitter.
        watches: the record producer's memo, forgotten when a watch is dropped.
        org_batch: orgs one :meth:`sweep_once` pass serves; the next pass resumes after
            the last one served and wraps around (:class:`services.background.OrgRotation`),
            so every org with waits is reached however many there are.
        expiry_guard: says whether a due dependency may expire by its deadline now
            (``runtime_svc.effects``: a completion dependency only once its handoff
            settled); ``None`` allows every expiry.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        matcher: Matcher,
        *,
        batch: int = 100,
        rng: random.Random | None = None,
        watches: RecordWatches | None = None,
        org_batch: int = 100,
        expiry_guard: Callable[[DependencyRecord], Awaitable[bool]] | None = None,
    ) -> None:
        self._engine = engine
        self._watches = watches
        self._expiry_guard = expiry_guard
        self.matcher = matcher
        self._batch = batch
        self._rng = rng or random.Random()  # noqa: S311 - probe jitter, not security
        self._cursors: dict[str, str] = {}
        self._passes = 0

        async def source(after: str | None, limit: int) -> list[str]:
            return await orgs_with_waits(engine, after=after or "", limit=limit)

        self._orgs = OrgRotation(source, batch=org_batch)

    async def sweep_once(self, *, org_limit: int | None = None) -> SweepStats:
        """One pass over the next batch of orgs with waits (``org_limit`` overrides the
        batch size from now on); a failing org is logged and retried next pass."""
        if org_limit is not None:
            self._orgs.batch = org_limit
        total = SweepStats()
        for org in await self._orgs.next_batch():
            try:
                total.add(await self.sweep_org(org))
            except Exception:
                log.exception("wait sweep of %s failed; next pass retries", org)
        self._passes += 1
        return total

    async def sweep_org(self, org_id: str) -> SweepStats:
        """One bounded pass over ``org_id`` (see the module docstring)."""
        stats = SweepStats()
        await self._probes(org_id, stats)
        await self._owed(org_id, stats)
        await self._deadlines(org_id, stats)
        await self._repair(org_id, stats)
        await self._retention(org_id, stats)
        return stats

    # --- parts ----------------------------------------------------------------------------

    async def _probes(self, org_id: str, stats: SweepStats) -> None:
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.matcher._clock(conn)  # the clock with the read (one txn)
            due = await queries.due_probes_txn(conn, org_id, now, self._batch)
        misses: list[tuple[DependencyRecord, datetime | None]] = []
        for dep in due:
            stats.probes += 1
            result, bounds = await self.matcher.probe(dep)
            if isinstance(result, WaitTransition):
                stats.resolved += result.outcome == "resolved"
                stats.expired += result.outcome != "resolved"
                continue
            if result.reason in _RACED or bounds is None:
                continue  # raced (re-read next pass), a timer, or a vanished run
            misses.append((dep, self._next_probe(dep, now, bounds.policy)))
        if misses:
            # One short bookkeeping transaction for the whole pass: each row's own
            # conditional UPDATE, in dependency-id order (two replicas sweeping one org
            # lock the same rows in the same order); no lifecycle row is locked.
            misses.sort(key=lambda m: m[0].dependency_id)

            async def reschedule(conn: AsyncConnection) -> int:
                return sum(
                    [await queries.reschedule_probe_txn(conn, dep, nxt) for dep, nxt in misses]
                )

            stats.rescheduled += await run_in_transaction(self._engine, reschedule)

    def _next_probe(
        self, dep: DependencyRecord, now: datetime, policy: WaitPolicy
    ) -> datetime | None:
        """The jittered next probe time, or ``None`` once the attempts are spent."""
        attempt = dep.reconciliation_attempts + 1
        if attempt >= policy.max_reconciliation_attempts:
            return None
        delay = policy.probe_delay_seconds(attempt + 1)
        return now + timedelta(seconds=delay * (0.5 + self._rng.random() / 2))

    async def _owed(self, org_id: str, stats: SweepStats) -> None:
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.matcher._clock(conn)  # the clock with the read (one txn)
            owed = await queries.owed_signal_matches_txn(conn, org_id, now, self._batch)
        for signal in owed:
            result = await self.matcher.match_signal(signal.scope, signal.wake_signal_id)
            if isinstance(result, WaitTransition):
                stats.signals_matched += 1

    async def _fault(self, dep: DependencyRecord) -> FaultStep | None:
        try:
            async with transaction(self._engine, readonly=True) as conn:
                return (await self.matcher.context_txn(conn, dep)).fault_step()
        except NotFoundError:
            return None

    async def _deadlines(self, org_id: str, stats: SweepStats) -> None:
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.matcher._clock(conn)  # the clock with the read (one txn)
            due = await queries.due_deadlines_txn(conn, org_id, now, self._batch)
        for dep in due:
            spec = self.matcher.registry.spec(dep.producer_kind)
            timer = spec is not None and spec.family is ProducerFamily.TIMER
            if timer and dep.next_probe_at is not None and dep.next_probe_at <= dep.deadline:
                # The timer was due before its deadline (e.g. the runtime was down): it
                # resumes rather than expires.
                result = await self.matcher.match_dependency(dep)
            elif self._expiry_guard is not None and not await self._expiry_guard(dep):
                continue  # not yet: its producer settles first (and is re-checked)
            else:
                fault = await self._fault(dep)

                async def lookup(
                    _root: object, _dep: object, f: FaultStep | None = fault
                ) -> FaultStep | None:
                    return f

                result = await self.matcher.waits.expire(
                    org_id, dep.dependency_id, fault_lookup=lookup
                )
            if isinstance(result, WaitTransition):
                stats.resolved += result.outcome == "resolved"
                stats.expired += result.outcome != "resolved"

    async def _repair(self, org_id: str, stats: SweepStats) -> None:
        after = self._cursors.get(org_id, "")
        async with transaction(self._engine, readonly=True) as conn:
            roots = await queries.waiting_roots_txn(conn, org_id, after, self._batch)
            steps = [s for _, s in roots if s is not None]
            broken = await queries.terminal_dependencies_of_steps_txn(conn, org_id, steps)
        self._cursors[org_id] = roots[-1][0] if len(roots) == self._batch else ""
        for dep in broken:
            log.warning(
                "repair: dependency %s is %s under a Waiting root; replaying its finalizer",
                dep.dependency_id,
                dep.state.code,
            )
            fault = await self._fault(dep) if dep.state is DependencyState.EXPIRED else None

            async def lookup(
                _root: object, _dep: object, f: FaultStep | None = fault
            ) -> FaultStep | None:
                return f

            result = await self.matcher.waits.repair(org_id, dep.dependency_id, fault_lookup=lookup)
            if isinstance(result, WaitTransition):
                stats.repaired += 1

    async def _retention(self, org_id: str, stats: SweepStats) -> None:
        async with transaction(self._engine) as conn:
            now = await self.matcher._clock(conn)
            stats.signals_expired += await queries.expire_signals_txn(
                conn, org_id, now, self._batch
            )
            stats.purged += await queries.purge_expired_signals_txn(
                conn, org_id, now - _PURGE_AFTER, self._batch
            )
        if self._passes % _WATCH_EVERY == 0:
            await self._drop_idle_watches(org_id, now)

    async def _drop_idle_watches(self, org_id: str, now: datetime) -> None:
        """Delete watch registrations idle past a window with no pending record wait on
        their object (a concurrent wait commit refreshes the row under its lock, so the
        conditional DELETE then matches nothing)."""
        w, d = flow_record_watches.c, flow_dependencies.c
        cutoff = now - _WATCH_IDLE
        async with transaction(self._engine, readonly=True) as conn:
            rows = (
                await conn.execute(
                    select(flow_record_watches)
                    .where(w.org_id == org_id, w.refreshed_at < cutoff)
                    .limit(self._batch)
                )
            ).all()
        for row in rows:
            prefix = f"{row.object_name}/"
            pending = exists().where(
                d.org_id == row.org_id,
                d.app_installation_id == row.app_installation_id,
                d.runtime_capability_id == row.runtime_capability_id,
                d.runtime_work_binding_digest == row.runtime_work_binding_digest,
                d.producer_kind == RECORD_CHANGE_PRODUCER,
                d.producer_key.startswith(prefix, autoescape=True),
                d.state == DependencyState.PENDING.code,
            )
            async with transaction(self._engine) as conn:
                await conn.execute(
                    delete(flow_record_watches).where(
                        and_(
                            w.org_id == row.org_id,
                            w.object_name == row.object_name,
                            w.app_installation_id == row.app_installation_id,
                            w.runtime_capability_id == row.runtime_capability_id,
                            w.runtime_work_binding_digest == row.runtime_work_binding_digest,
                            w.refreshed_at < cutoff,
                            ~pending,
                        )
                    )
                )
            if self._watches is not None:
                self._watches.invalidate(org_id)
