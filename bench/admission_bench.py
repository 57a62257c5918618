"""Queue fairness under one hot tenant (§22.7, issue 14 benchmark; target ratio ≤ 2).

Prints, on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is set) MariaDB, the cold tenant's
queue age — from its run's creation to the worker picking its step up — p50 and p99, in
three scenarios, each ``_TICKS`` ticks of the same arrival pattern:

* **alone** — the cold tenant only: one new run per tick;
* **hot, admission** — plus a hot tenant with ten times the arrivals (ten runs per
  tick), served by the worker with the §16 admission controller (deficit round-robin,
  quantum 1, sparse orgs first): the figure the target is about, ``p99(hot) / p99(alone)``;
* **hot, rotation order** — the same with admission, but the pass's orgs served in the
  rotation's org order (sparse-first off, :class:`_RotationOrder`): the cold tenant
  waits behind one quantum of the hot tenant per pass — the figure before sparse-first;
* **hot, no admission** — the same load on a worker without admission (every org's due
  batch taken in one visit), for contrast.

The scenarios run interleaved, tick by tick (the order rotating), on one database, each
with its own orgs and worker, so load drift on a shared machine hits all of them alike.
A tick creates the hot tenant's runs, then the cold tenant's, then runs one worker pass
over every org of the scenario with work; the hot tenant's org sorts first, so the
rotation order puts it before the cold tenant (the worst order for the cold tenant).
Each run is the one-step worker Flow (one record mutation).

The first tick is the warm-up: every org is new to the worker (no deficit, no backlog
history, empty policy and plan caches), so the scheduler has nothing to tell a hot
tenant from a cold one and serves one quantum of each in rotation order. Its age is
printed on its own (``first``) and kept out of p50/p99, which describe the steady state
the target is about: a hot tenant with a standing backlog next to a cold one. Nothing
is asserted; figures depend on the machine (p99 of ``_TICKS`` samples is close to the
worst one: compare runs of one back-to-back invocation only).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from bench.databases import on_each_database
from runtime_svc.admission.controller import AdmissionController
from runtime_svc.kernel import Candidate, FlowRunStateStore, RetryPolicy
from runtime_svc.worker import FixedViews, Outcome, StepWorker
from services import db, migrate
from tests.integration.worker.support import Seeded, record_view, seed, start_run

__all__ = ["run", "scenario"]

_TICKS = int(os.environ.get("BENCH_ADMISSION_TICKS", "60"))
_HOT_FACTOR = 10


class _Timed(StepWorker):
    """Notes when each cold run's step was picked up."""

    picked: dict[str, float]

    async def process_chain(
        self, org_id: str, candidate: Candidate, *, gate: Callable[[str], bool] | None = None
    ) -> list[Outcome]:
        self.picked.setdefault(candidate.flow_run_id, time.perf_counter())
        return await super().process_chain(org_id, candidate, gate=gate)


class _RotationOrder(AdmissionController):
    """Admission without sparse-first: a pass serves its orgs in rotation order."""

    def order(self, orgs: Sequence[str]) -> list[str]:
        return list(orgs)


def _p(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class _Scenario:
    """One scenario's orgs, worker and cold-run timings; advanced tick by tick, so the
    scenarios of a bench run interleave and machine drift hits them all alike. Its
    worker serves only its own orgs (the org query still sees, and pays for, all)."""

    def __init__(self, engine: AsyncEngine, *, hot: bool, admission: bool, sparse_first: bool):
        self.engine, self.hot, self.admission, self.sparse_first = (
            engine,
            hot,
            admission,
            sparse_first,
        )
        self.created: dict[str, float] = {}
        self.ticks = 0

    async def setup(self) -> None:
        engine, stem = self.engine, uuid.uuid4().hex[:8]
        self.store = FlowRunStateStore(engine, policy=RetryPolicy(lease_duration_ms=300_000))
        self.cold: Seeded = await seed(engine, f"b-cold-{stem}", mutations=1, pure_step=False)
        self.heavy: Seeded | None = (
            await seed(engine, f"a-hot-{stem}", mutations=1, pure_step=False) if self.hot else None
        )
        kind = AdmissionController if self.sparse_first else _RotationOrder
        controller = kind(engine, budget=4, quantum=1) if self.admission else None
        self.worker = _Timed(
            engine,
            self.store,
            FixedViews(record_view()),
            owner=f"bench-{stem}",
            admission=controller,
        )
        self.worker.picked = {}
        ours = {self.cold.org} | ({self.heavy.org} if self.heavy else set())
        rotation = self.worker._orgs
        original = rotation.next_batch

        async def next_batch() -> list[str]:
            return [org for org in await original() if org in ours]

        rotation.next_batch = next_batch  # type: ignore[method-assign]

    async def tick(self) -> None:
        """The hot tenant's runs, then the cold tenant's, then one worker pass."""
        if self.heavy is not None:
            for i in range(_HOT_FACTOR):
                await start_run(self.store, self.heavy, label=f"h{self.ticks}-{i}")
        run = await start_run(self.store, self.cold, label=f"c{self.ticks}")
        self.created[run.flow_run_id] = time.perf_counter()
        self.ticks += 1
        await self.worker.run_once()

    async def ages(self) -> list[float]:
        """The cold tenant's queue ages (seconds), in tick order (drained first)."""
        picked = self.worker.picked
        for _ in range(self.ticks):  # drain the cold tenant (bounded)
            if all(r in picked for r in self.created):
                break
            await self.worker.run_once()
        return [picked[r] - t for r, t in self.created.items() if r in picked]


async def scenario(
    engine: AsyncEngine,
    *,
    hot: bool,
    admission: bool,
    ticks: int = _TICKS,
    sparse_first: bool = True,
) -> list[float]:
    """The cold tenant's queue ages (seconds) of one scenario run on its own: the
    warm-up tick's first, then one per measured tick (``ticks`` of them)."""
    return (await _interleaved(engine, [(hot, admission, sparse_first)], ticks))[0]


async def _interleaved(
    engine: AsyncEngine, kinds: Sequence[tuple[bool, bool, bool]], ticks: int
) -> list[list[float]]:
    """Each ``(hot, admission, sparse_first)`` scenario, ticked in turn (the order
    rotating every tick) for a warm-up tick and ``ticks`` more."""
    scenarios = [_Scenario(engine, hot=h, admission=a, sparse_first=f) for h, a, f in kinds]
    for sc in scenarios:
        await sc.setup()
    for tick in range(ticks + 1):
        shift = tick % len(scenarios)
        for sc in scenarios[shift:] + scenarios[:shift]:
            await sc.tick()
    return [await sc.ages() for sc in scenarios]


def _steady(ages: list[float]) -> list[float]:
    """The measured ticks' ages (the warm-up tick left out)."""
    return ages[1:] or ages


async def _bench(label: str, url: str, ticks: int) -> dict[str, list[float]]:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=4)
    try:
        alone, fair, rotation, unfair = await _interleaved(
            engine,
            [(False, True, True), (True, True, True), (True, True, False), (True, False, True)],
            ticks,
        )
    finally:
        await engine.dispose()
    base = _p(_steady(alone), 99)
    figures = {
        "alone": alone,
        "hot, admission": fair,
        "hot, rotation order": rotation,
        "hot, no admission": unfair,
    }
    for name, all_ages in figures.items():
        ages = _steady(all_ages)
        ratio = _p(ages, 99) / base if base else 0.0
        print(
            f"{label:<8} cold tenant queue age, {name:<19} p50 {_p(ages, 50) * 1000:8.1f} ms"
            f"  p99 {_p(ages, 99) * 1000:8.1f} ms  ratio p99/alone {ratio:5.2f}"
            f"  ({len(ages)} runs; first tick {all_ages[0] * 1000:.1f} ms)"
        )
    return figures


def run(seconds: float) -> None:
    """Print the fairness figures (``BENCH_ADMISSION_TICKS`` sets the ticks per scenario)."""
    print(
        f"Admission fairness bench ({_TICKS} ticks after a warm-up tick, hot tenant at "
        f"{_HOT_FACTOR}x; "
        f"{seconds:.0f}s unused; target p99 ratio with admission <= 2)"
    )

    async def one(label: str, url: str) -> None:
        await _bench(label, url, _TICKS)

    asyncio.run(on_each_database("admission", one))
