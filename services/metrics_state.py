"""The bounded, periodic authoritative-state scan behind the state gauges (spec §19).

§19 wants run counts, queue ages, backlogs and the must-be-zero counters *derived from
authoritative state*, and alerts on *bounded windows* — not on log lines. A scan pass
(:meth:`StateScan.scan_once`, every ``FLOW_METRICS_STATE_MS``) reads the database in a
cost that does not grow with the population:

* it visits at most ``FLOW_METRICS_STATE_ORGS`` orgs, continuing from a keyset cursor
  over org ids (the scan rotates over every org across passes; one pass per org is one
  short read-only transaction);
* each :class:`StateSource` probe of an org is a fixed number of index seeks and index
  range scans capped at ``FLOW_METRICS_COUNT_CAP`` rows (a count at the cap means "at
  least"), or a keyset window of at most ``FLOW_METRICS_PROBE_WINDOW`` rows;
* the latest result per org is kept in memory and the gauges publish the aggregate
  (sums for counts, maxima for oldest ages) atomically; an org the scan no longer finds
  drops out when the rotation wraps.

Run it on one replica per database (the sweeps replica); the values are identical on
every replica, so more only costs reads. ``nexus_flow_state_scan_timestamp_seconds``
tells an alert when the scan itself stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Select, Table, func, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.background import BackgroundLoop
from services.db import db_now, transaction
from services.metrics import FlowMetrics, StateFamily, metrics, seconds_since
from services.outbox.model import DUE_STATES, LIVE_STATES
from services.outbox.store import OutboxTable

__all__ = [
    "OutboxStateSource",
    "Sample",
    "StateScan",
    "StateSource",
    "aggregate",
    "capped_count",
    "distinct_orgs",
    "due_age",
    "oldest",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One gauge sample of one org; ``combine`` says how orgs aggregate (``sum``/``max``)."""

    family: str
    labels: tuple[str, ...]
    value: float
    combine: str = "sum"


class StateSource(Protocol):
    """A service's contribution to the scan: its gauge families, the orgs it has rows
    for, and the per-org probe."""

    @property
    def families(self) -> Sequence[StateFamily]:
        """The gauge families the probe publishes."""
        ...

    def baseline(self) -> Sequence[Sample]:
        """Samples published even when no org has any (zeros of the fixed label sets)."""
        ...

    async def orgs(self, conn: AsyncConnection, after: str, limit: int) -> list[str]:
        """Up to ``limit`` org ids after ``after`` in id order (bounded)."""
        ...

    async def probe(self, conn: AsyncConnection, org_id: str, now: datetime) -> list[Sample]:
        """The samples of one org (bounded queries, org-scoped)."""
        ...


# --- query building blocks ---------------------------------------------------------------


def capped_count(table: Table, *where: ColumnElement[bool], cap: int) -> Any:
    """``COUNT(*)`` of at most ``cap`` matching rows, as a scalar subquery (an index range
    scan stops after ``cap`` entries)."""
    inner = select(literal(1).label("one")).select_from(table).where(*where).limit(cap)
    return select(func.count()).select_from(inner.subquery()).scalar_subquery()


def oldest(column: Any, *where: ColumnElement[bool]) -> Any:
    """``MIN(column)`` as a scalar subquery (one index seek with equality on the index
    prefix)."""
    return select(func.min(column)).where(*where).scalar_subquery()


async def distinct_orgs(conn: AsyncConnection, table: Table, after: str, limit: int) -> list[str]:
    """Org ids of ``table`` after ``after`` (a loose scan of the primary key's leading
    column, bounded by ``limit``)."""
    org = table.c.org_id
    stmt: Select[Any] = select(org).where(org > after).group_by(org).order_by(org).limit(limit)
    return [str(o) for o in (await conn.execute(stmt)).scalars()]


def due_age(moment: datetime | None, now: datetime) -> float:
    """Seconds ``moment`` is overdue at ``now`` (0 when None or in the future)."""
    return seconds_since(moment, now) or 0.0


# --- the generic outbox source -----------------------------------------------------------


class OutboxStateSource:
    """Backlog of one transactional outbox (``services.outbox``): live messages by
    delivery state and the oldest due message's age.

    Args:
        spec: the outbox table.
        name: the ``outbox`` label (``runtime`` / ``owner``).
        count_cap: cap of each count.
    """

    def __init__(self, spec: OutboxTable, name: str, *, count_cap: int) -> None:
        self._spec, self._name, self._cap = spec, name, count_cap
        self._states = sorted(s.value for s in LIVE_STATES)
        self._due = sorted(s.value for s in DUE_STATES)

    @property
    def families(self) -> Sequence[StateFamily]:
        return (
            StateFamily(
                "nexus_flow_outbox_messages",
                "Undelivered outbox messages by delivery state (capped per org).",
                ("outbox", "state"),
            ),
            StateFamily(
                "nexus_flow_outbox_oldest_due_age_seconds",
                "Age of the oldest outbox message due for delivery (0: none due).",
                ("outbox",),
            ),
        )

    def baseline(self) -> Sequence[Sample]:
        return [
            *(Sample("nexus_flow_outbox_messages", (self._name, s), 0) for s in self._states),
            Sample("nexus_flow_outbox_oldest_due_age_seconds", (self._name,), 0, "max"),
        ]

    async def orgs(self, conn: AsyncConnection, after: str, limit: int) -> list[str]:
        return await distinct_orgs(conn, self._spec.table, after, limit)

    async def probe(self, conn: AsyncConnection, org_id: str, now: datetime) -> list[Sample]:
        t = self._spec.table.c
        columns = [
            capped_count(self._spec.table, t.org_id == org_id, t.delivery_state == s, cap=self._cap)
            for s in self._states
        ]
        columns += [
            oldest(t.next_attempt_at, t.org_id == org_id, t.delivery_state == s) for s in self._due
        ]
        row = (await conn.execute(select(*columns))).one()
        counts, due = row[: len(self._states)], row[len(self._states) :]
        samples = [
            Sample("nexus_flow_outbox_messages", (self._name, s), float(n or 0))
            for s, n in zip(self._states, counts, strict=True)
        ]
        age = max((due_age(d, now) for d in due), default=0.0)
        samples.append(
            Sample("nexus_flow_outbox_oldest_due_age_seconds", (self._name,), age, "max")
        )
        return samples


# --- the scan ----------------------------------------------------------------------------


def aggregate(
    baseline: Sequence[Sample], per_org: Mapping[str, Sequence[Sample]]
) -> dict[str, dict[tuple[str, ...], float]]:
    """Combine the orgs' samples (sum or max per sample) over the zero baseline."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for sample in baseline:
        out.setdefault(sample.family, {})[sample.labels] = sample.value
    combined: dict[tuple[str, tuple[str, ...]], float] = {}
    kinds: dict[tuple[str, tuple[str, ...]], str] = {}
    for samples in per_org.values():
        for s in samples:
            key = (s.family, s.labels)
            kinds[key] = s.combine
            if key not in combined:
                combined[key] = s.value
            elif s.combine == "max":
                combined[key] = max(combined[key], s.value)
            else:
                combined[key] += s.value
    for (family, labels), value in combined.items():
        out.setdefault(family, {})[labels] = value
    return out


class StateScan:
    """Runs the sources' probes over a rotating window of orgs (module docstring).

    Args:
        engine: the service database.
        sources: the service's state sources.
        orgs_per_pass: orgs one pass visits.
        interval_s: time between passes.
        instance: the metrics to publish on (default: :func:`services.metrics.metrics`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        sources: Sequence[StateSource],
        *,
        orgs_per_pass: int = 50,
        interval_s: float = 15.0,
        instance: FlowMetrics | None = None,
    ) -> None:
        self._engine = engine
        self._sources = list(sources)
        self._limit = max(1, orgs_per_pass)
        self._interval_s = interval_s
        self._metrics = instance or metrics()
        self._cursor = ""
        self._per_org: dict[str, list[Sample]] = {}
        self._seen: set[str] = set()
        self._baseline = [s for src in self._sources for s in src.baseline()]
        self._metrics.state.declare(f for src in self._sources for f in src.families)

    async def _next_orgs(self) -> tuple[list[str], datetime, bool]:
        async with transaction(self._engine, readonly=True) as conn:
            now = await db_now(conn)
            found: set[str] = set()
            for source in self._sources:
                found.update(await source.orgs(conn, self._cursor, self._limit))
        orgs = sorted(found)[: self._limit]
        return orgs, now, len(orgs) < self._limit

    async def scan_once(self) -> int:
        """One pass: the next window of orgs, then publish; returns the orgs visited."""
        started = time.perf_counter()
        orgs, now, wrapped = await self._next_orgs()
        for org in orgs:
            try:
                async with transaction(self._engine, readonly=True) as conn:
                    samples: list[Sample] = []
                    for source in self._sources:
                        samples += await source.probe(conn, org, now)
            except Exception:
                log.warning("state scan of an org failed; keeping its last values", exc_info=True)
                self._metrics.state_scan_errors.inc()
                samples = self._per_org.get(org, [])
            self._per_org[org] = samples
            self._seen.add(org)
        if wrapped:
            # A full rotation ended: an org no source lists any more has no rows left.
            for gone in set(self._per_org) - self._seen:
                del self._per_org[gone]
            self._seen.clear()
            self._cursor = ""
        else:
            self._cursor = orgs[-1]
        self._metrics.state.publish(aggregate(self._baseline, self._per_org))
        self._metrics.state_scan_duration.observe(time.perf_counter() - started)
        self._metrics.state_scan_timestamp.set(time.time())
        return len(orgs)

    def loop(self, name: str = "metrics-state-scan") -> BackgroundLoop:
        """The scan as an interval :class:`~services.background.BackgroundLoop`."""

        async def body() -> bool:
            await self.scan_once()
            return False

        return BackgroundLoop(name, idle_s=self._interval_s, body=body, interval=True)
