"""Synchronous-profile figures (issue 6 benchmark): record mutations per second with and
without a Flow on the write path.

Prints, on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is set) MariaDB, for the same
operation (create one ``Opportunity`` with ``Name``, ``Amount``, ``StageName``):

* (a) bare record mutations per second: ``RecordEngine.mutate`` (record + history +
  business event + audit rows, one transaction) with a request id, as every
  ``RecordService`` write carries (replay check; without it the bare write is one
  statement shorter and the before-save share correspondingly larger);
* (b) the same writes with one 5-element Embedded Before-Save Flow subscribed
  (Decision → Assignment → pure ``format_text`` ActionCall → Assignment → End, every
  element executed): ``RecordEngine.mutate(transform=BeforeSaveDispatcher…)``, i.e.
  plan selection through the request-bound view and an ACTIVE activation (read by the
  write's ledger lookup, as ``RecordService`` does), the transform and re-validation
  inside the record transaction; its ratio b/a and the before-save
  overhead over the bare write (``a/b - 1``, target < 15%);
* (c) Bounded Atomic runs per second of a one-``CreateRecord`` Flow, as ``StartRun``
  runs it: ``AtomicRunner.start`` — one transaction creates the root, step and input
  checkpoint and claims the step Running for the runner (ADR 0005), a second is the
  business transaction (the record write, checkpoint, terminal advance); one run counts
  as one record mutation for the ratio c/a.

For each variant the bench also prints its cost drivers per operation: transactions,
SQL statements (SQLAlchemy ``begin`` and ``before_cursor_execute`` events on the engine;
SQLite's own ``BEGIN`` is not counted), CPU milliseconds of this process
(``time.process_time``) and wait milliseconds (the rest of the wall time: the database's
work, the network, scheduling) — for (c) also as multiples of (a)'s, which split c/a into
its two causes — and the raw single-row commit rate of the same database through the
same driver (one ``INSERT`` through SQLAlchemy and its ``COMMIT`` per call), so the ratios
a/raw and c/a of issue 13 are printed in one run.

The raw commit and the two record variants alternate call by call on one database so drift
(database growth, cache warm-up, a host whose speed moves ±20 % within a minute) hits them
alike; the atomic runs are timed after them. Before timing, one write of each variant is
checked (the before-save Flow set ``Priority``/``Discount``/``Description``; the atomic
run succeeded and created its record). Nothing is asserted about speed; figures depend on
the machine.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from bench import on_service_loop
from bench.databases import on_each_database
from bench.durable_bench import _count, _Counters, _raw_commit, _raw_table
from runtime_svc.atomic import AtomicRunner
from runtime_svc.compiler import (
    CompilerInputs,
    ExecutionPlan,
    MetadataViewInput,
    compile_plan,
)
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.definitions.admission import RequestBoundView
from runtime_svc.embedded import BeforeSaveDispatcher
from runtime_svc.kernel import (
    CheckpointInput,
    FlowRunStateStore,
    RetryPolicy,
    RunState,
    StartRunRequest,
)
from runtime_svc.records import (
    Actor,
    MutationResult,
    RecordEngine,
    RecordMutation,
    RecordState,
    RecordView,
    prepare_create,
)
from runtime_svc.runs.resolve import first_step_of
from runtime_svc.schema import records
from runtime_svc.worker import FixedViews
from services import db, migrate
from services.auth import TrustedRuntimeWorkScope
from services.digest import versioned_digest
from services.request_dedupe import DedupeScope, RequestKey
from tests.support.plans import store_plan
from tests.unit.compiler.compiler_corpus import inputs_doc, merge_patch

__all__ = ["run"]

_OBJECT = "Opportunity"
_AMOUNT = 150_000
_WARMUP = 10
_ACTOR = Actor("workload", "bench")
_POLICY = RetryPolicy(lease_duration_ms=120_000)

#: (b): five elements, all executed for the bench's writes (Amount ≥ 100,000).
BEFORE_SAVE_FLOW: dict[str, Any] = {
    "api_name": "bench_before_save_5",
    "version": 1,
    "description": "bench: 5-element Embedded Before-Save transform of Opportunity",
    "process_type": "record_triggered",
    "trigger": {
        "object": _OBJECT,
        "timing": "before_save",
        "events": ["create", "update"],
        "entry_condition": "$Record.Amount > 0",
    },
    "variables": [{"name": "label", "type": "string"}],
    "start": "classify",
    "elements": [
        {
            "api_name": "classify",
            "type": "Decision",
            "rules": [{"name": "large", "condition": "$Record.Amount >= 100000", "next": "price"}],
            "next": "price",
        },
        {
            "api_name": "price",
            "type": "Assignment",
            "assignments": [
                {"target": "$Record.Discount", "value": "MIN(15, $Record.Amount / 10000)"},
                {"target": "$Record.Priority", "value": "'High'"},
            ],
            "next": "make_label",
        },
        {
            "api_name": "make_label",
            "type": "ActionCall",
            "action_type": "format_text",
            "inputs": {
                "text": "CONCAT($Record.Name, ' / ', $Record.Priority)",
                "style": "'upper'",
            },
            "output_variable": "label",
            "next": "set_description",
        },
        {
            "api_name": "set_description",
            "type": "Assignment",
            "assignments": [{"target": "$Record.Description", "value": "label"}],
            "next": "done",
        },
        {"api_name": "done", "type": "End"},
    ],
}

#: (c): one CreateRecord of the same Opportunity, compiled to Bounded Atomic.
ATOMIC_FLOW: dict[str, Any] = {
    "api_name": "bench_atomic_create",
    "version": 1,
    "description": "bench: one Opportunity create, Bounded Atomic",
    "process_type": "autolaunched",
    "run_atomically": True,
    "variables": [
        {"name": "name", "type": "string", "input": True},
        {"name": "amount", "type": "number", "input": True},
        {"name": "opp", "type": "string"},
    ],
    "start": "create",
    "elements": [
        {
            "api_name": "create",
            "type": "CreateRecord",
            "object": _OBJECT,
            "fields": {"Name": "name", "Amount": "amount", "StageName": "'Prospecting'"},
            "output_variable": "opp",
            "next": "done",
        },
        {"api_name": "done", "type": "End"},
    ],
}

#: The bench view subscribes only the bench's before-save Flow (the shared test view also
#: subscribes rejected golden Flows, which admission would refuse: no active plan).
_SUBSCRIPTION = {
    "flow_api_name": BEFORE_SAVE_FLOW["api_name"],
    "flow_version": 1,
    "object": _OBJECT,
    "timing": "before_save",
    "events": ["create", "update"],
    "dispatch_order": 10,
}


@dataclass(frozen=True)
class _Stored:
    scope: TrustedRuntimeWorkScope
    plan_id: str
    plan: ExecutionPlan


@dataclass(frozen=True)
class _Setup:
    org: str
    view: RecordView
    request: RequestBoundView
    atomic: _Stored


def _inputs(org: str) -> dict[str, Any]:
    doc: dict[str, Any] = merge_patch(
        inputs_doc(),
        {
            "binding": {"org_id": org},
            "catalog": {"generation": {"org_id": org}},
            "metadata_view": {"trigger_subscriptions": [_SUBSCRIPTION]},
        },
    )
    return doc


async def _store(
    engine: AsyncEngine, source: dict[str, Any], inputs: CompilerInputs, *, activate: bool
) -> _Stored:
    """Store a Flow version and its compiled plan (and, with ``activate``, an ACTIVE
    activation of it) through the definitions repository."""
    plan = compile_plan(source, inputs)
    stored = await store_plan(engine, source, plan, activate=activate, label="bench")
    return _Stored(stored.scope, stored.plan_id, plan)


async def _setup(engine: AsyncEngine) -> _Setup:
    org = f"org-{uuid.uuid4().hex[:12]}"
    doc = _inputs(org)
    inputs = CompilerInputs.from_dict(doc)
    before = await _store(engine, BEFORE_SAVE_FLOW, inputs, activate=True)
    atomic = await _store(engine, ATOMIC_FLOW, inputs, activate=True)
    if before.plan.profile is not ExecutionProfile.EMBEDDED_BEFORE_SAVE:
        raise BenchCheckError(f"before-save Flow compiled to {before.plan.profile}")
    if atomic.plan.profile is not ExecutionProfile.BOUNDED_ATOMIC:
        raise BenchCheckError(f"atomic Flow compiled to {atomic.plan.profile}")
    view_input = MetadataViewInput.from_dict(doc["metadata_view"])
    return _Setup(
        org=org,
        view=RecordView.from_metadata_view(view_input),
        request=RequestBoundView(before.plan.binding, view_input),
        atomic=atomic,
    )


class BenchCheckError(RuntimeError):
    """A variant did not do the work it is timed for (the figures would be meaningless)."""


class _Variants:
    """The three ways of making one Opportunity record (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, setup: _Setup) -> None:
        self._setup = setup
        self._records = RecordEngine(engine)
        self._dispatcher = BeforeSaveDispatcher()
        self._store = FlowRunStateStore(engine, policy=_POLICY)
        self._atomic = AtomicRunner(engine, self._store, FixedViews(setup.view))
        self.last_record: RecordState | None = None

    def _create(self, i: int) -> RecordMutation:
        fields = {"Name": f"Deal {i}", "Amount": _AMOUNT, "StageName": "Prospecting"}
        return prepare_create(self._setup.view, _OBJECT, "", fields)

    def _request(self, i: int) -> RequestKey:
        """The request key every RecordService write carries (ledger lookup and row in the
        same transaction), so both record variants pay for it alike."""
        request_id = f"req-{uuid.uuid4().hex}"
        scope = DedupeScope(self._setup.org)
        return RequestKey(scope, "CreateRecord", request_id, versioned_digest("bench", [i]))

    @staticmethod
    def _encode(result: MutationResult) -> bytes:
        return result.record.record_id.encode()

    async def bare(self, i: int) -> None:
        s = self._setup
        done = await self._records.mutate_once(
            s.org, s.view, self._create(i), actor=_ACTOR, key=self._request(i), encode=self._encode
        )
        self.last_record = None if done.value is None else done.value.record

    async def before_save(self, i: int) -> None:
        s, dispatcher = self._setup, self._dispatcher
        mutation = self._create(i)
        # As RecordService does: the activation read rides on the ledger lookup.
        activations = dispatcher.activation_read(s.org, s.request, mutation)

        async def transform(
            conn: AsyncConnection, m: RecordMutation, current: RecordState | None
        ) -> RecordMutation:
            return await dispatcher.transform_txn(
                conn, s.org, s.request, s.view, m, current, activations=activations
            )

        done = await self._records.mutate_once(
            s.org,
            s.view,
            mutation,
            actor=_ACTOR,
            key=self._request(i),
            encode=self._encode,
            transform=transform,
            also=activations,
        )
        self.last_record = None if done.value is None else done.value.record

    async def atomic(self, i: int) -> None:
        stored = self._setup.atomic
        first = first_step_of(stored.plan, stored.plan.profile.value)
        request = StartRunRequest(
            plan_id=stored.plan_id,
            first_step=first,
            input=CheckpointInput(
                context={"variables": {"name": f"Deal {i}", "amount": _AMOUNT}},
                plan_cursor={"step": first.plan_step_key},
            ),
        )
        # As StartRun does (ADR 0005): the run is created already claimed and Running
        # for the runner, which then runs the one business transaction.
        _, run = await self._atomic.start(stored.scope, request, 10.0)
        if run.state is not RunState.SUCCEEDED:
            raise RuntimeError(f"bench atomic run ended {run.state}")


async def _opportunities(engine: AsyncEngine, org: str) -> int:
    r = records.c
    async with db.transaction(engine, readonly=True) as conn:
        count = (
            await conn.execute(
                sa.select(sa.func.count())
                .select_from(records)
                .where(r.org_id == org, r.object_name == _OBJECT)
            )
        ).scalar_one()
    return int(count)


async def _check(engine: AsyncEngine, setup: _Setup, v: _Variants) -> None:
    """One write per variant, verified, before anything is timed (a bench of a Flow that
    silently did not run would measure the bare write twice)."""
    await v.bare(-1)
    if v.last_record is None or "Priority" in v.last_record.fields:
        raise BenchCheckError("the bare write returned no record, or a transformed one")
    await v.before_save(-2)
    rec = v.last_record
    if rec is None:
        raise BenchCheckError("before-save write returned no record")
    expected = {"Priority": "High", "Description": "DEAL -2 / HIGH"}
    got = {k: rec.fields.get(k) for k in expected}
    if got != expected or rec.fields.get("Discount") is None:
        raise BenchCheckError(
            f"the before-save Flow did not transform the record: {dict(rec.fields)}"
        )
    before = await _opportunities(engine, setup.org)
    await v.atomic(-3)
    if await _opportunities(engine, setup.org) != before + 1:
        raise BenchCheckError("atomic run wrote no record")


@dataclass
class _Cost:
    """One variant's calls, wall time, and what they cost (transactions, statements, CPU)."""

    calls: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    transactions: int = 0
    write_transactions: int = 0
    statements: int = 0
    round_trips: int = 0
    commits: int = 0

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def per_op(self) -> str:
        n = max(self.calls, 1)
        return (
            f"per op: write txns {self.write_transactions / n:4.2f}"
            f"  txns {self.transactions / n:4.2f}  statements {self.statements / n:5.1f}"
            f"  round trips {self.round_trips / n:5.1f}  COMMITs {self.commits / n:4.2f}"
            f"  CPU ms {self.cpu_s * 1000 / n:6.2f}  wait ms {self.wait_s * 1000 / n:6.2f}"
        )

    @property
    def wait_s(self) -> float:
        """Wall time not spent on this process's CPU: the database's work, the network
        and scheduling."""
        return max(self.seconds - self.cpu_s, 0.0)

    def times(self, other: _Cost) -> str:
        """This variant's CPU and wait per call as multiples of ``other``'s (``x-``
        where ``other`` spent none)."""
        mine, theirs = max(self.calls, 1), max(other.calls, 1)

        def ratio(own: float, base: float) -> str:
            return f"x{(own / mine) / (base / theirs):4.2f}" if base > 0 else "x-"

        return f"CPU {ratio(self.cpu_s, other.cpu_s)}, wait {ratio(self.wait_s, other.wait_s)}"


async def _rates(
    variants: list[Callable[[int], Awaitable[None]]], seconds: float, counters: _Counters
) -> list[_Cost]:
    """Mutations per second of each variant, over ``seconds`` of work per variant (after
    ``_WARMUP`` untimed calls each), with its per-call cost. The variants alternate call
    by call (a, b, c, a, …) so database growth, checkpoints and machine noise hit them
    alike; each variant's rate is its call count over the time spent in its own calls."""
    costs = [_Cost() for _ in variants]
    serial = 0
    for fn in variants:
        for _ in range(_WARMUP):
            await fn(serial)
            serial += 1
    while min(c.seconds for c in costs) < seconds:
        for cost, fn in zip(costs, variants, strict=True):
            txns, writes, stmts, trips, commits = counters.snapshot()
            cpu, start = time.process_time(), time.perf_counter()
            await fn(serial)
            cost.seconds += time.perf_counter() - start
            cost.cpu_s += time.process_time() - cpu
            cost.calls += 1
            cost.transactions += counters.transactions - txns
            cost.write_transactions += counters.write_transactions - writes
            cost.statements += counters.statements - stmts
            cost.round_trips += counters.round_trips - trips
            cost.commits += counters.commits - commits
            serial += 1
    return costs


async def _bench(label: str, url: str, seconds: float) -> None:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=4)
    counters = _count(engine)
    try:
        setup = await _setup(engine)
        v = _Variants(engine, setup)
        await _check(engine, setup, v)
        await _raw_table(engine)
        prefix = uuid.uuid4().hex[:12]

        async def raw_commit(serial: int) -> None:
            await _raw_commit(engine, f"{prefix}-{serial}")

        # The raw commit and the two record variants alternate call by call (their ratios
        # are the figures of interest: a host that drifts ±20 % within a minute moves all
        # three alike); the slower atomic runs are timed on their own afterwards.
        raw_cost, bare_cost, before_cost = await _rates(
            [raw_commit, v.bare, v.before_save], seconds, counters
        )
        (atomic_cost,) = await _rates([v.atomic], seconds, counters)
        raw, bare, before, atomic = (
            raw_cost.rate,
            bare_cost.rate,
            before_cost.rate,
            atomic_cost.rate,
        )
        overhead = (bare / before - 1) * 100
        verdict = "met" if overhead < 15 else "MISSED"
        print(f"{label:<8} raw single-row commits/s              {raw:9.1f}")
        print(f"{label:<8}     {raw_cost.per_op()}")
        print(
            f"{label:<8} (a) bare record mutations/s           {bare:9.1f}"
            f"   ratio a/raw {bare / raw:5.3f} (target >= 0.5)"
        )
        print(f"{label:<8}     {bare_cost.per_op()}")
        print(
            f"{label:<8} (b) + 5-element before-save Flow/s   {before:9.1f}"
            f"   ratio b/a {before / bare:5.3f}   overhead {overhead:5.1f}%"
            f" (target < 15%: {verdict})"
        )
        print(f"{label:<8}     {before_cost.per_op()}")
        print(
            f"{label:<8} (c) Bounded Atomic runs/s            {atomic:9.1f}"
            f"   ratio c/a {atomic / bare:5.3f} (target >= 0.5;"
            f" per run {atomic_cost.times(bare_cost)} of (a))"
        )
        print(f"{label:<8}     {atomic_cost.per_op()}")
    finally:
        await engine.dispose()


async def _main(seconds: float) -> None:
    async def one(label: str, url: str) -> None:
        await _bench(label, url, seconds)

    await on_each_database("sync", one)


def run(seconds: float) -> None:
    """Print the synchronous-profile figures (each variant runs ``seconds`` in total)."""
    print(
        f"Synchronous Flow bench (≥{seconds:.0f}s of calls per variant, alternating call by call;"
        " op = create one Opportunity; (a)/(b) carry a request id like every RecordService write)"
    )
    print(
        "         (c) one run = AtomicRunner.start (create+claim, then the business"
        " transaction): root, step, attempt and checkpoint rows besides the record"
    )
    asyncio.run(_main(seconds))


if __name__ == "__main__":
    on_service_loop()
    run(float(os.environ.get("BENCH_SECONDS", "3")))
