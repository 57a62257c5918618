"""External-effect figures (issue 12 benchmark): the three services as real processes on
loopback — catalog, runtime, effect owner — each on its own SQLite (and, when
``FLOW_TEST_MYSQL_URL`` is set, MariaDB) database, with a local SMTP server in this
process as the e-mail provider's remote side. The demo is seeded through the public APIs
and every effect is the ``WelcomeContact`` Flow's ``crm.send_email`` started by a Contact.

* **round trip**, per effect: *submit committed* (the canonical outbox row's
  ``created_at``) → *owner accepted* (the command's ``created_at``) → *provider called*
  (the remote attempt's ``started_at``) → *provider answered* (its ``finished_at``) →
  *receipt committed* (``completion_receipts.created_at``) → *signal committed* (the
  runtime's wake signal ``received_at``) → *wait resolved* (the completion dependency's
  ``resolved_at``: the match transaction) → *Flow resumed* (the ``EffectCompletion``
  step's attempt ``started_at``: its claim), p50/p99 over ``samples`` sequential
  effects (target p50 ≤ 30 ms; every timestamp is a database clock of the same host);
* **throughput**: ``burst`` Contacts created at once against a runtime with 4 worker
  tasks; effects per second from the first submit commit to the last resumed Flow;
* **cost drivers**: the p50 of each hop; per effect and service (runtime, owner) the
  committed database transactions (the ``nexus_flow_db_transactions`` counter of each
  process's ``/metrics``, background polling included) and the CPU milliseconds of the
  process; the rows one effect writes in each database;
* **where it goes**: a separate run of ``BENCH_EFFECT_PROFILE_SAMPLES`` (20) sequential
  effects whose service children load ``bench/effect_profile`` (a ``sitecustomize``):
  per effect and service, the transactions and statements of each call site that opened
  a transaction, and the event-loop CPU of each component (worker, outbox delivery, gRPC
  handler, sweep); its own stack, so the profiler's CPU stays out of the other figures;
* **idle cost**: each service's CPU share over an idle window after the warm-up (what the
  polling loops cost when nothing happens).

Services use their default idle, sweep and retry settings (the wakeups — a submit wakes the
outbox dispatcher, an acceptance the command dispatcher, a receipt the receipt delivery,
a resolution the workers — are what keep the idle backoffs off the round trip; an
enqueue and an acceptance also name what committed, so the woken dispatcher claims it
without a discovery query). Nothing is asserted; figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.schema import (
    completion_receipts,
    external_commands,
    owner_inbox,
    owner_outbox,
    remote_attempts,
)
from runtime_svc.kernel.states import RunState
from runtime_svc.schema import (
    flow_dependencies,
    flow_effect_links,
    flow_runs,
    flow_step_attempts,
    flow_step_executions,
    flow_wake_signals,
    runtime_outbox,
)
from services import db, migrate

__all__ = ["run"]

_FAILED = {s.code for s in (RunState.TERMINAL_FAILED, RunState.QUARANTINED, RunState.CANCELLED)}
_COMPLETION = "send_welcome#completion"
#: Service settings: the defaults, except what a loopback bench must pin.
_DEFAULTS = {
    "FLOW_RUNTIME_IDLE_MS": "500",
    "FLOW_OUTBOX_IDLE_MS": "500",
    "FLOW_EFFECT_IDLE_MS": "500",
    "FLOW_RUNTIME_WAIT_SWEEP_MS": "1000",
    "FLOW_RUNTIME_SWEEP_MS": "1000",
    "FLOW_OUTBOX_SWEEP_MS": "1000",
    "FLOW_LOG_LEVEL": "WARNING",
}
HOPS = (
    "owner accepted",
    "provider called",
    "provider answered",
    "receipt committed",
    "signal committed",
    "wait resolved",
    "flow resumed",
)


@dataclass(frozen=True)
class _Trip:
    """The timestamps of one effect, submit commit first."""

    at: tuple[datetime, ...]

    def hops_ms(self) -> list[float]:
        return [(b - a).total_seconds() * 1000 for a, b in zip(self.at, self.at[1:], strict=False)]

    @property
    def total_ms(self) -> float:
        return (self.at[-1] - self.at[0]).total_seconds() * 1000


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_IDLE_WINDOW_S = 10.0
_PROFILER = Path(__file__).resolve().parent / "effect_profile"
#: Sequential effects of the separate, profiled run that prints the per-phase breakdown
#: (its own stack: the profiler's CPU stays out of the figures above; 0 skips it).
_PROFILE_SAMPLES = int(os.environ.get("BENCH_EFFECT_PROFILE_SAMPLES", "20"))
#: Rows of each breakdown printed (the rest summed as "other").
_TOP = 14
#: How often :func:`_wait_all` reads the runs' states.
_POLL_S = 0.025


def _cpu_ms(pid: int) -> float:
    """User + system CPU milliseconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


async def _transactions(port: int) -> float:
    """Committed database transactions of the process serving ``/metrics`` on ``port``."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nexus_flow_db_transactions_total") and 'outcome="committed"' in line
    )


@dataclass(frozen=True)
class _Costs:
    """Per-effect transactions and CPU ms of (runtime, owner); idle CPU % of each."""

    txn: tuple[float, float] = (0.0, 0.0)
    cpu_ms: tuple[float, float] = (0.0, 0.0)
    idle_pct: tuple[float, float] = (0.0, 0.0)
    #: per child (runtime, owner): the profile's counters per effect
    phases: tuple[dict[str, Any], ...] = ()


class _Meter:
    """Snapshots of the runtime and owner children's transactions and CPU, and of their
    per-phase profiles (``bench/effect_profile``) when ``profile_dir`` is set."""

    def __init__(
        self, pids: tuple[int, int], ports: tuple[int, int], profile_dir: Path | None = None
    ) -> None:
        self.pids, self.ports, self.profile_dir = pids, ports, profile_dir

    async def snap(self) -> tuple[float, ...]:
        txns = [await _transactions(p) for p in self.ports]
        return (*txns, *(_cpu_ms(p) for p in self.pids))

    async def profiles(self) -> list[dict[str, Any]]:
        """One profile snapshot per child (runtime, owner): SIGUSR1, then its file."""
        if self.profile_dir is None:
            return [{}, {}]
        out = []
        for pid in self.pids:
            path = self.profile_dir / f"{pid}.json"
            seq = json.loads(path.read_text())["seq"] if path.exists() else 0
            os.kill(pid, signal.SIGUSR1)
            for _ in range(400):
                if path.exists() and json.loads(path.read_text())["seq"] > seq:
                    break
                await asyncio.sleep(0.025)
            out.append(json.loads(path.read_text()))
        return out

    async def idle_pct(self) -> tuple[float, float]:
        before = [_cpu_ms(p) for p in self.pids]
        await asyncio.sleep(_IDLE_WINDOW_S)
        after = [_cpu_ms(p) for p in self.pids]
        rt, ow = ((b - a) / (_IDLE_WINDOW_S * 10) for a, b in zip(before, after, strict=True))
        return rt, ow


def _delta(a: dict[str, float], b: dict[str, float], n: int) -> dict[str, float]:
    out = {k: (v - a.get(k, 0.0)) / n for k, v in b.items()}
    return {k: v for k, v in out.items() if v}


def _profile_delta(a: dict[str, Any], b: dict[str, Any], n: int) -> dict[str, Any]:
    """The profile counters of ``n`` effects: snapshot ``b`` minus ``a``, per effect."""
    if not b:
        return {}
    return {
        "txns": _delta(a.get("txns", {}), b["txns"], n),
        "stmts": _delta(a.get("stmts", {}), b["stmts"], n),
        "cpu_ms": {k: v * 1000 for k, v in _delta(a.get("cpu_s", {}), b["cpu_s"], n).items()},
        "loop_ms": (b["loop_thread_cpu_s"] - a.get("loop_thread_cpu_s", 0.0)) * 1000 / n,
        "process_ms": (b["process_cpu_s"] - a.get("process_cpu_s", 0.0)) * 1000 / n,
    }


def _print_phases(label: str, service: str, phases: dict[str, Any]) -> None:
    """Where one service's transactions, statements and loop CPU went, per effect."""
    if not phases:
        return
    txns, stmts = phases["txns"], phases["stmts"]
    print(
        f"{label:<8}   {service} per effect ({_PROFILE_SAMPLES} profiled), by call site"
        " (w/r = write/read-only): transactions, statements"
    )
    ranked = sorted(txns.items(), key=lambda kv: -kv[1])
    for site, count in ranked[:_TOP]:
        print(f"{label:<8}     {count:5.2f} {stmts.get(site[2:], 0.0):6.1f}  {site}")
    rest = ranked[_TOP:]
    if rest:
        print(f"{label:<8}     {sum(v for _, v in rest):5.2f}         ({len(rest)} other sites)")
    loose = stmts.get("outside a transaction", 0.0)
    if loose:
        print(f"{label:<8}            {loose:6.1f}  statements outside services.db.transaction")
    cpu = sorted(phases["cpu_ms"].items(), key=lambda kv: -kv[1])
    print(
        f"{label:<8}   {service} CPU ms per effect: process {phases['process_ms']:.1f}, "
        f"event loop {phases['loop_ms']:.1f}, other threads "
        f"{phases['process_ms'] - phases['loop_ms']:.1f}; loop by component:"
    )
    for comp, ms in cpu[:_TOP]:
        print(f"{label:<8}     {ms:6.2f}  {comp}")
    if cpu[_TOP:]:
        print(f"{label:<8}     {sum(v for _, v in cpu[_TOP:]):6.2f}  ({len(cpu) - _TOP} other)")


@asynccontextmanager
async def _databases(label: str, tmp: Path) -> AsyncIterator[tuple[str, str, str]]:
    """Catalog, runtime and owner database URLs, migrated (dropped afterwards)."""
    names = ("catalog_svc", "runtime_svc", "effect_owner_svc")
    if label == "sqlite":
        urls = [f"sqlite+aiosqlite:///{tmp / f'{n}.db'}" for n in names]
        for url, pkg in zip(urls, names, strict=True):
            await migrate.upgrade(url, pkg)
        yield urls[0], urls[1], urls[2]
        return
    mysql = os.environ["FLOW_TEST_MYSQL_URL"].rstrip("/")
    admin = db.create_engine(mysql + "/", pool_size=1)
    dbs = [f"bench_fx_{n[:7]}_{uuid.uuid4().hex[:8]}" for n in names]
    try:
        async with admin.connect() as conn:
            for name in dbs:
                await conn.execute(
                    sa.text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
                )
        urls = [f"{mysql}/{name}?charset=utf8mb4" for name in dbs]
        for url, pkg in zip(urls, names, strict=True):
            await migrate.upgrade(url, pkg)
        yield urls[0], urls[1], urls[2]
    finally:
        async with admin.connect() as conn:
            for name in dbs:
                await conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        await admin.dispose()


async def _trips(runtime: AsyncEngine, owner: AsyncEngine, org: str) -> list[_Trip]:
    o, s, a, w = (
        runtime_outbox.c,
        flow_step_executions.c,
        flow_step_attempts.c,
        flow_wake_signals.c,
    )
    c, r, rc = external_commands.c, remote_attempts.c, completion_receipts.c
    async with db.transaction(runtime, readonly=True) as conn:
        submitted = {
            str(k): (str(run), t)
            for k, run, t in await conn.execute(
                select(o.effect_handoff_key, o.flow_run_id, o.created_at).where(o.org_id == org)
            )
        }
        signals = {
            str(k): t
            for k, t in await conn.execute(
                select(w.producer_key, w.received_at).where(w.org_id == org)
            )
        }
        d = flow_dependencies.c
        resolved = {
            str(k): t
            for k, t in await conn.execute(
                select(d.producer_key, d.resolved_at).where(
                    d.org_id == org, d.resolved_at.is_not(None)
                )
            )
        }
        resumed = {
            str(run): t
            for run, t in await conn.execute(
                select(s.flow_run_id, func.min(a.started_at))
                .select_from(
                    flow_step_attempts.join(
                        flow_step_executions,
                        (s.org_id == a.org_id) & (s.step_execution_id == a.step_execution_id),
                    )
                )
                .where(s.org_id == org, s.plan_step_key == _COMPLETION)
                .group_by(s.flow_run_id)
            )
        }
    async with db.transaction(owner, readonly=True) as conn:
        commands = {
            str(k): (str(cid), t)
            for k, cid, t in await conn.execute(
                select(c.effect_handoff_key, c.external_command_id, c.created_at).where(
                    c.org_id == org
                )
            )
        }
        attempts = {
            str(cid): (t0, t1)
            for cid, t0, t1 in await conn.execute(
                select(r.external_command_id, r.started_at, r.finished_at).where(
                    r.org_id == org, r.attempt_number == 1
                )
            )
        }
        receipts = {
            str(cid): t
            for cid, t in await conn.execute(
                select(rc.external_command_id, rc.created_at).where(rc.org_id == org)
            )
        }
    trips = []
    for key, (run_id, t_submit) in submitted.items():
        if (
            key not in commands
            or run_id not in resumed
            or key not in signals
            or key not in resolved
        ):
            continue
        cid, t_accept = commands[key]
        t_call, t_answer = attempts[cid]
        trips.append(
            _Trip(
                (
                    t_submit,
                    t_accept,
                    t_call,
                    t_answer,
                    receipts[cid],
                    signals[key],
                    resolved[key],
                    resumed[run_id],
                )
            )
        )
    return trips


async def _commit_ms(engine: AsyncEngine, n: int = 30) -> float:
    """p50 of one single-row write transaction on ``engine`` right now (the unit the
    round trip is made of: on a loaded machine both grow together)."""
    meta = sa.MetaData()
    probe = sa.Table(
        f"bench_probe_{uuid.uuid4().hex[:6]}",
        meta,
        sa.Column("id", sa.String(40), primary_key=True),
    )
    async with engine.begin() as conn:
        await conn.run_sync(meta.create_all)
    times = []
    try:
        for i in range(n):
            start = time.perf_counter()
            async with db.transaction(engine) as conn:
                await conn.execute(probe.insert().values(id=f"r{i}"))
            times.append((time.perf_counter() - start) * 1000)
    finally:
        async with engine.begin() as conn:
            await conn.run_sync(meta.drop_all)
    return statistics.median(times)


async def _rows_per_effect(runtime: AsyncEngine, owner: AsyncEngine, org: str, n: int) -> str:
    async def count(engine: AsyncEngine, table: Any) -> int:
        async with db.transaction(engine, readonly=True) as conn:
            stmt = select(func.count()).select_from(table).where(table.c.org_id == org)
            return int((await conn.execute(stmt)).scalar_one())

    rt = [runtime_outbox, flow_effect_links, flow_dependencies, flow_wake_signals]
    ow = [owner_inbox, external_commands, remote_attempts, completion_receipts, owner_outbox]
    parts = [f"{t.name} {await count(runtime, t) / n:.0f}" for t in rt]
    parts += [f"{t.name} {await count(owner, t) / n:.0f}" for t in ow]
    return ", ".join(parts)


async def _wait_all(runtime: AsyncEngine, run_ids: Sequence[str], timeout_s: float) -> None:
    """Until every run ``Succeeded``, read from the runtime database every 25 ms (a
    ``GetRun`` per run and poll — a new channel, a credential check and a transaction in
    the runtime's own event loop each time — loaded the very process whose hops are
    measured with about half of its transactions). The figures are database timestamps
    of the rows themselves, so this interval only spaces the samples; a tighter one
    took CPU from this process's SMTP server, a hop of the measured path."""
    r = flow_runs.c
    pending = set(run_ids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        async with db.transaction(runtime, readonly=True) as conn:
            rows = await conn.execute(
                select(r.flow_run_id, r.runtime_state, r.terminal_cause_code).where(
                    r.flow_run_id.in_(sorted(pending))
                )
            )
            for run_id, state, cause in rows:
                if state == RunState.SUCCEEDED.code:
                    pending.discard(str(run_id))
                elif state in _FAILED:
                    raise RuntimeError(f"run {run_id} ended {state} ({cause})")
        if pending:
            await asyncio.sleep(_POLL_S)
    if pending:
        raise RuntimeError(f"{len(pending)} runs did not finish in {timeout_s:.0f}s")


async def _stack_run(
    label: str, samples: int, burst: int, workers: int, tmp: Path, *, profile: bool = False
) -> tuple[list[_Trip], float, str, float, _Costs]:
    from tests.crash.effects_support import effect_stack
    from tests.crash.flow_stack import FlowStack
    from tests.support.procs import free_port

    async with _databases(label, tmp) as (catalog_url, runtime_url, owner_url):
        runtime = db.create_engine(runtime_url, pool_size=2)
        owner = db.create_engine(owner_url, pool_size=2)
        costs = _Costs()
        try:
            async with effect_stack(tmp, owner_url, runtime_url) as effects:
                stack = FlowStack(effects, catalog_url)
                catalog = stack.spawn_catalog()
                await catalog.wait_serving()
                ports = (free_port(), free_port())
                env = {**_DEFAULTS, "FLOW_RUNTIME_WORKERS": str(workers)}
                profile_dir = tmp / "profile" if profile else None
                prof: dict[str, str] = {}
                if profile_dir is not None:
                    profile_dir.mkdir()
                    prof = {
                        # The profiler times asyncio's own handles: the profiled
                        # children run on asyncio even where uvloop would be chosen.
                        "FLOW_EVENT_LOOP": "asyncio",
                        "BENCH_PROFILE_DIR": str(profile_dir),
                        "PYTHONPATH": os.pathsep.join(
                            [str(_PROFILER), *filter(None, [os.environ.get("PYTHONPATH")])]
                        ),
                    }
                owner_child = stack.spawn_owner(
                    **_DEFAULTS, **prof, FLOW_METRICS_PORT=str(ports[1])
                )
                runtime_child = stack.spawn_runtime(**env, **prof, FLOW_METRICS_PORT=str(ports[0]))
                await owner_child.wait_serving()
                await runtime_child.wait_serving()
                meter = _Meter((runtime_child.proc.pid, owner_child.proc.pid), ports, profile_dir)
                demo = await stack.seed()
                await _wait_all(runtime, [await stack.create_contact("warm@example.com")], 60)
                trips: list[_Trip] = []
                if samples:
                    idle = (0.0, 0.0) if profile else await meter.idle_pct()
                    before = await meter.snap()
                    p_before = await meter.profiles()
                    for i in range(samples):
                        run_id = await stack.create_contact(f"c{i}@example.com")
                        await _wait_all(runtime, [run_id], 60)
                    after = await meter.snap()
                    p_after = await meter.profiles()
                    per = [(b - a) / samples for a, b in zip(before, after, strict=True)]
                    phases = tuple(
                        _profile_delta(a, b, samples)
                        for a, b in zip(p_before, p_after, strict=True)
                    )
                    costs = _Costs((per[0], per[1]), (per[2], per[3]), idle, phases)
                    trips = await _trips(runtime, owner, demo.org_id)
                    trips = sorted(trips, key=lambda t: t.at[0])[1:]  # without the warm-up
                rate, rows = 0.0, ""
                commit = await _commit_ms(runtime)
                if burst:
                    before_n = len(await _trips(runtime, owner, demo.org_id))
                    run_ids = await asyncio.gather(
                        *(stack.create_contact(f"b{i}@example.com") for i in range(burst))
                    )
                    await _wait_all(runtime, run_ids, 300)
                    every = sorted(await _trips(runtime, owner, demo.org_id), key=lambda t: t.at[0])
                    mine = every[before_n:]
                    span = (
                        max(t.at[-1] for t in mine) - min(t.at[0] for t in mine)
                    ).total_seconds()
                    rate = len(mine) / span if span > 0 else 0.0
                    rows = await _rows_per_effect(runtime, owner, demo.org_id, len(every))
        finally:
            await runtime.dispose()
            await owner.dispose()
    return trips, rate, rows, commit, costs


async def _bench(label: str, samples: int, burst: int) -> None:
    with tempfile.TemporaryDirectory() as t1:
        trips, _, _, commit, costs = await _stack_run(label, samples, 0, 1, Path(t1))
    with tempfile.TemporaryDirectory() as t2:
        _, rate, rows, _, _ = await _stack_run(label, 0, burst, 4, Path(t2))
    phases: tuple[dict[str, Any], ...] = ()
    if _PROFILE_SAMPLES:
        with tempfile.TemporaryDirectory() as t3:
            profiled = await _stack_run(label, _PROFILE_SAMPLES, 0, 1, Path(t3), profile=True)
        phases = profiled[4].phases
    totals = [t.total_ms for t in trips]
    p50 = _pct(totals, 0.5)
    print(
        f"{label:<8} effect round trip (submit committed → Flow resumed), {len(totals)} effects: "
        f"p50 {p50:6.1f} ms  p99 {_pct(totals, 0.99):6.1f} ms  (target p50 ≤ 30 ms)"
    )
    print(
        f"{label:<8}   one write transaction p50 {commit:5.1f} ms here and now: the round trip"
        f" is {p50 / commit:4.1f} of them (2 gRPC calls, 1 SMTP message)"
    )
    hops = list(zip(*(t.hops_ms() for t in trips), strict=True))
    parts = [f"{name} {statistics.median(h):.1f}" for name, h in zip(HOPS, hops, strict=True)]
    print(f"{label:<8}   per hop p50 ms: " + ", ".join(parts))
    print(
        f"{label:<8}   per effect: runtime {costs.txn[0]:.1f} transactions / "
        f"{costs.cpu_ms[0]:.1f} ms CPU, owner {costs.txn[1]:.1f} transactions / "
        f"{costs.cpu_ms[1]:.1f} ms CPU (background polling included)"
    )
    print(
        f"{label:<8}   idle CPU over {_IDLE_WINDOW_S:.0f}s: runtime {costs.idle_pct[0]:.1f} %, "
        f"owner {costs.idle_pct[1]:.1f} % of one core"
    )
    for service, counters in zip(("runtime", "owner"), phases, strict=False):
        _print_phases(label, service, counters)
    print(f"{label:<8} effects/s, {burst} at once, 4 runtime workers   {rate:8.1f}")
    print(f"{label:<8}   rows per effect: {rows}")


def run(seconds: float, *, samples: int = 40, burst: int = 60) -> None:
    """Print the effect figures (``seconds`` is unused: the counts bound the run)."""
    del seconds
    print("external effects (three services on loopback, local SMTP server)")
    asyncio.run(_bench("sqlite", samples, burst))
    if os.environ.get("FLOW_TEST_MYSQL_URL"):
        asyncio.run(_bench("mariadb", samples, burst))
    else:
        print("mariadb  skipped (set FLOW_TEST_MYSQL_URL=mysql+asyncmy://root:@127.0.0.1:3307)")
