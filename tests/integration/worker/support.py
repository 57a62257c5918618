"""Shared support of the worker tests (integration, crash, bench): a compiled Durable
Orchestration plan stored through the definitions repository, its record view, run
creation through the kernel, a bounded "drive until done" helper, and the database
counts the exactly-once assertions read."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, MetadataViewInput, compile_plan
from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    RunRecord,
    RunState,
    StartRunRequest,
)
from runtime_svc.records import RecordView
from runtime_svc.schema import (
    audit_records,
    business_events,
    flow_checkpoints,
    flow_step_attempts,
    flow_step_executions,
    records,
)
from runtime_svc.worker import FixedViews, StepWorker, Sweeper
from services import db
from services.auth import TrustedRuntimeWorkScope
from tests.support.plans import store_plan
from tests.unit.compiler.compiler_corpus import INPUTS, inputs_doc, merge_patch, read_json

__all__ = [
    "MUTATION_STEPS",
    "TERMINAL",
    "Counts",
    "Seeded",
    "drive",
    "final_context",
    "flow_source",
    "make_worker",
    "metadata_view",
    "new_org",
    "record_view",
    "run_records",
    "seed",
    "start_run",
    "step_counts",
    "view_file",
    "wait_until",
]

#: The three mutation steps of the default Flow (plus one PureCompute step, ``calc``).
MUTATION_STEPS = ("bump1", "bump2", "bump3")


def flow_source(mutations: int = 3, *, pure_step: bool = True) -> dict[str, Any]:
    """``worker_steps``: CreateRecord, a pure Assignment (unless ``pure_step`` is false),
    then ``mutations - 1`` UpdateRecords of the created Account, each its own durable
    step."""
    elements: list[dict[str, Any]] = [
        {
            "api_name": "bump1",
            "type": "CreateRecord",
            "object": "Account",
            "fields": {"Name": "label", "Status": "'s1'"},
            "output_variable": "acct",
            "next": "calc" if pure_step else ("bump2" if mutations > 1 else None),
        },
    ]
    if pure_step:
        elements.append(
            {
                "api_name": "calc",
                "type": "Assignment",
                "assignments": [{"target": "n", "op": "set", "value": "n + 1"}],
                "next": "bump2" if mutations > 1 else None,
            }
        )
    for i in range(2, mutations + 1):
        elements.append(
            {
                "api_name": f"bump{i}",
                "type": "UpdateRecord",
                "object": "Account",
                "record": "acct",
                "fields": {"Status": f"'s{i}'", "AnnualRevenue": f"{i * 100}"},
                **({"next": f"bump{i + 1}"} if i < mutations else {}),
            }
        )
    return {
        "api_name": f"worker_steps_{mutations}{'' if pure_step else '_m'}",
        "version": 1,
        "description": "worker test Flow: one record mutation per durable step",
        "process_type": "autolaunched",
        "variables": [
            {"name": "acct", "type": "record", "object": "Account"},
            {"name": "label", "type": "string", "input": True},
            {"name": "n", "type": "number", "input": True},
        ],
        "start": "bump1",
        "elements": elements,
    }


def metadata_view() -> MetadataViewInput:
    return MetadataViewInput.from_dict(read_json(INPUTS / "metadata_view.json"))


def record_view() -> RecordView:
    return RecordView.from_metadata_view(metadata_view())


def view_file(directory: Path) -> str:
    """The metadata view as a JSON file (``FLOW_RUNTIME_VIEW_FILE`` of a child process)."""
    path = directory / "metadata_view.json"
    path.write_text((INPUTS / "metadata_view.json").read_text(encoding="utf-8"))
    return str(path)


def new_org() -> str:
    return f"org-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class Seeded:
    scope: TrustedRuntimeWorkScope
    plan_id: str
    plan: ExecutionPlan

    @property
    def org(self) -> str:
        return self.scope.org_id


def _compile(org_id: str, source: dict[str, Any]) -> ExecutionPlan:
    doc = merge_patch(
        inputs_doc(),
        {
            "binding": {"org_id": org_id},
            "catalog": {"generation": {"org_id": org_id}},
            # Bounded Atomic may not write: the Flow must compile to Durable Orchestration.
            "policy": {"version": 9, "bounded_atomic": {"max_writes": 0}},
        },
    )
    return compile_plan(source, CompilerInputs.from_dict(doc))


async def seed(
    engine: AsyncEngine,
    org_id: str | None = None,
    *,
    mutations: int = 3,
    pure_step: bool = True,
    source: dict[str, Any] | None = None,
) -> Seeded:
    """Compile the worker Flow (or ``source``) for a new org and store version + plan
    through the definitions repository."""
    org = org_id or new_org()
    if source is None:
        source = flow_source(mutations, pure_step=pure_step)
    plan = _compile(org, source)
    stored = await store_plan(engine, source, plan, label="worker")
    return Seeded(stored.scope, stored.plan_id, plan)


async def start_run(
    store: FlowRunStateStore, seeded: Seeded, label: str = "Acme", n: int = 0
) -> RunRecord:
    step = seeded.plan.step(seeded.plan.start_step)
    result = await store.create_run(
        seeded.scope,
        StartRunRequest(
            plan_id=seeded.plan_id,
            first_step=FirstStep(step.key, step.kind.value, "durable_mutation"),
            input=CheckpointInput(context={"variables": {"label": label, "n": n}}),
        ),
    )
    return result.run


TERMINAL = frozenset(
    {RunState.SUCCEEDED, RunState.TERMINAL_FAILED, RunState.QUARANTINED, RunState.CANCELLED}
)


async def drive(
    worker: StepWorker,
    org_id: str,
    run_id: str,
    *,
    sweeper: Sweeper | None = None,
    max_rounds: int = 50,
) -> RunRecord:
    """Run bounded worker (and sweep) batches until the run is terminal."""
    for _ in range(max_rounds):
        run = await worker.store.get_run(org_id, run_id, include_deleted=True)
        if run.state in TERMINAL:
            return run
        await worker.run_batch(org_id)
        if sweeper is not None:
            await sweeper.sweep_org(org_id)
    return await worker.store.get_run(org_id, run_id, include_deleted=True)


def make_worker(
    engine: AsyncEngine, store: FlowRunStateStore, owner: str = "w1", **kw: Any
) -> StepWorker:
    return StepWorker(engine, store, FixedViews(record_view()), owner=owner, **kw)


@dataclass(frozen=True)
class Counts:
    """Rows one step of one run left behind."""

    step_rows: int
    committed_attempts: int
    business_events: int
    audit_records: int


async def step_counts(engine: AsyncEngine, org: str, run_id: str, step_key: str) -> Counts:
    s, a, e, au = flow_step_executions.c, flow_step_attempts.c, business_events.c, audit_records.c
    async with db.transaction(engine, readonly=True) as conn:
        step_ids = list(
            (
                await conn.execute(
                    select(s.step_execution_id).where(
                        s.org_id == org, s.flow_run_id == run_id, s.plan_step_key == step_key
                    )
                )
            ).scalars()
        )

        async def count(stmt: Any) -> int:
            return int((await conn.execute(stmt)).scalar_one())

        committed = await count(
            select(func.count())
            .select_from(flow_step_attempts)
            .where(
                a.org_id == org,
                a.step_execution_id.in_(step_ids),
                a.transaction_outcome == "Committed",
            )
        )
        events = await count(
            select(func.count())
            .select_from(business_events)
            .where(e.org_id == org, e.flow_run_id == run_id, e.step_execution_id.in_(step_ids))
        )
        audits = await count(
            select(func.count())
            .select_from(audit_records)
            .where(au.org_id == org, au.flow_run_id == run_id, au.step_execution_id.in_(step_ids))
        )
    return Counts(len(step_ids), committed, events, audits)


async def run_records(engine: AsyncEngine, org: str) -> list[dict[str, Any]]:
    """Every Account record of ``org`` (id, version, fields)."""
    r = records.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (await conn.execute(select(records).where(r.org_id == org))).mappings().all()
    return [dict(row) for row in rows]


async def final_context(engine: AsyncEngine, org: str, run: RunRecord) -> dict[str, Any]:
    assert run.current_checkpoint_id is not None
    c = flow_checkpoints.c
    async with db.transaction(engine, readonly=True) as conn:
        raw = (
            await conn.execute(
                select(c.context_payload).where(
                    c.org_id == org, c.checkpoint_id == run.current_checkpoint_id
                )
            )
        ).scalar_one()
    value: dict[str, Any] = json.loads(raw)
    return value


async def wait_until(predicate: Any, *, timeout_s: float = 30.0, poll_s: float = 0.1) -> bool:
    """Poll an async predicate (bounded)."""
    loops = int(timeout_s / poll_s)
    for _ in range(loops):
        if await predicate():
            return True
        await asyncio.sleep(poll_s)
    return bool(await predicate())
