"""Shared support of the Bounded Atomic integration tests: a Flow compiled to the
``bounded_atomic`` profile and stored (version, plan, ACTIVE activation) through the
definitions repository, business records seeded through the ordinary record engine, the
``RunService`` / ``AtomicRunner`` wiring, and the database reads the assertions use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.atomic import AtomicRunner
from runtime_svc.compiler import CompilerInputs, ExecutionPlan, compile_plan
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.kernel import FlowRunStateStore, RetryPolicy
from runtime_svc.records import Actor, RecordEngine, RecordView, prepare_create
from runtime_svc.runs import RunService
from runtime_svc.runs.tokens import PageTokenCodec
from runtime_svc.schema import (
    audit_records,
    business_events,
    flow_checkpoints,
    flow_step_attempts,
    flow_step_executions,
    records,
)
from runtime_svc.worker import FixedViews, PhaseHook
from services import db
from services.auth import TrustedRuntimeWorkScope
from tests.integration.worker.support import new_org, record_view
from tests.support.plans import store_plan
from tests.unit.compiler.compiler_corpus import inputs_doc, merge_patch

__all__ = [
    "ATOMIC_POLICY",
    "ATOMIC_STEP",
    "SEED_ACTOR",
    "AtomicSeeded",
    "Business",
    "StepEvidence",
    "attempts_of",
    "business_rows",
    "checkpoint_context",
    "evidence",
    "make_runner",
    "make_service",
    "seed_atomic",
    "seed_business",
    "touch_flow",
]

#: Backoff of tens of milliseconds: a retried Bounded Atomic step is due again well inside
#: a runner budget of seconds; the lease is far longer than any step.
ATOMIC_POLICY = RetryPolicy(
    max_attempts=4,
    base_delay_ms=20,
    max_delay_ms=200,
    jitter_ratio=0.25,
    lease_duration_ms=300_000,
    max_lease_expiries=3,
)

#: The single plan step of a Bounded Atomic plan.
ATOMIC_STEP = "$atomic"
SEED_ACTOR = Actor("user", "seed")


def touch_flow(api_name: str = "atomic_touch", *, parent_first: bool = False) -> dict[str, Any]:
    """Autolaunched: read a line item and its Opportunity, update the CHILD first, then the
    PARENT (opposite to the canonical/parent-first order; ``parent_first`` swaps the two
    updates), then create a Task under the Opportunity. Output: the created Task."""
    flow: dict[str, Any] = {
        "api_name": api_name,
        "version": 1,
        "description": "atomic test Flow: child update, parent update, child create",
        "process_type": "autolaunched",
        "variables": [
            {"name": "oppId", "type": "string", "input": True},
            {"name": "lineId", "type": "string", "input": True},
            {"name": "label", "type": "string", "input": True},
            {"name": "opp", "type": "record", "object": "Opportunity"},
            {"name": "line", "type": "record", "object": "OpportunityLineItem"},
            {"name": "task", "type": "record", "object": "Task", "output": True},
        ],
        "start": "get_line",
        "elements": [
            {
                "api_name": "get_line",
                "type": "GetRecords",
                "object": "OpportunityLineItem",
                "read_mode": "current",
                "first_only": True,
                "filters": [{"field": "Id", "op": "=", "value": "lineId"}],
                "output_variable": "line",
                "next": "get_opp",
            },
            {
                "api_name": "get_opp",
                "type": "GetRecords",
                "object": "Opportunity",
                "read_mode": "current",
                "first_only": True,
                "filters": [{"field": "Id", "op": "=", "value": "oppId"}],
                "output_variable": "opp",
                "next": "upd_line",
            },
            {
                "api_name": "upd_line",
                "type": "UpdateRecord",
                "object": "OpportunityLineItem",
                "record": "line",
                "fields": {"Quantity": "line.Quantity + 1"},
                "next": "upd_opp",
            },
            {
                "api_name": "upd_opp",
                "type": "UpdateRecord",
                "object": "Opportunity",
                "record": "opp",
                "fields": {"Description": "label", "LineTotal": "line.Quantity + 1"},
                "next": "mk_task",
            },
            {
                "api_name": "mk_task",
                "type": "CreateRecord",
                "object": "Task",
                "fields": {"Subject": "label", "WhatId": "oppId", "Status": "'Open'"},
                "output_variable": "task",
            },
        ],
    }
    if parent_first:
        elements = {e["api_name"]: e for e in flow["elements"]}
        elements["get_opp"]["next"] = "upd_opp"
        elements["upd_opp"]["next"] = "upd_line"
        elements["upd_line"]["next"] = "mk_task"
    return flow


@dataclass(frozen=True)
class AtomicSeeded:
    """A stored, ACTIVE Bounded Atomic plan of one org."""

    scope: TrustedRuntimeWorkScope
    plan_id: str
    plan: ExecutionPlan

    @property
    def org(self) -> str:
        return self.scope.org_id


def compile_atomic(
    org_id: str, source: dict[str, Any], patch: dict[str, Any] | None = None
) -> ExecutionPlan:
    """Compile ``source`` for ``org_id`` with the shared inputs (plus ``patch``); the
    policy allows Bounded Atomic, and the test insists the Flow got that profile."""
    doc = merge_patch(
        inputs_doc(),
        {"binding": {"org_id": org_id}, "catalog": {"generation": {"org_id": org_id}}},
    )
    if patch:
        doc = merge_patch(doc, patch)
    plan = compile_plan(source, CompilerInputs.from_dict(doc))
    assert plan.profile is ExecutionProfile.BOUNDED_ATOMIC, plan.profile
    return plan


async def seed_atomic(
    engine: AsyncEngine,
    source: dict[str, Any] | None = None,
    *,
    org_id: str | None = None,
    patch: dict[str, Any] | None = None,
) -> AtomicSeeded:
    """Compile, then store version + plan + ACTIVE activation (what ``StartRun`` resolves)."""
    org = org_id or new_org()
    source = source or touch_flow()
    plan = compile_atomic(org, source, patch)
    stored = await store_plan(engine, source, plan, activate=True, label="atomic")
    return AtomicSeeded(stored.scope, stored.plan_id, plan)


def make_runner(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    *,
    view: RecordView | None = None,
    hook: PhaseHook | None = None,
) -> AtomicRunner:
    return AtomicRunner(engine, store, FixedViews(view or record_view()), hook=hook)


def make_service(
    engine: AsyncEngine, store: FlowRunStateStore, runner: AtomicRunner, *, budget_s: float = 20.0
) -> RunService:
    return RunService(
        engine,
        store,
        PageTokenCodec(b"k" * 32),
        max_wait_s=budget_s,
        atomic=runner,
        atomic_budget_s=budget_s,
    )


@dataclass(frozen=True)
class Business:
    """One Opportunity with one line item (lock-parent child)."""

    opp_id: str
    line_id: str


async def seed_business(engine: AsyncEngine, org: str, *, lines: int = 1) -> Business:
    """An Opportunity and ``lines`` line items, written as ordinary record writes."""
    records_ = RecordEngine(engine)
    view = record_view()
    opp = await records_.mutate(
        org,
        view,
        prepare_create(
            view, "Opportunity", "", {"Name": "Deal", "StageName": "Prospect", "Amount": 10}
        ),
        actor=SEED_ACTOR,
    )
    first = ""
    for i in range(lines):
        line = await records_.mutate(
            org,
            view,
            prepare_create(
                view,
                "OpportunityLineItem",
                "",
                {"OpportunityId": opp.record.record_id, "Quantity": 1, "UnitPrice": 5 + i},
            ),
            actor=SEED_ACTOR,
        )
        first = first or line.record.record_id
    return Business(opp.record.record_id, first)


def _fields(row: Any) -> dict[str, Any]:
    raw = row["fields"]
    value: dict[str, Any] = raw if isinstance(raw, dict) else json.loads(raw)
    return value


async def business_rows(engine: AsyncEngine, org: str) -> dict[str, list[dict[str, Any]]]:
    """Live records of ``org`` by object: ``{"Task": [{"record_id", "version", "fields"}]}``."""
    r = records.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            (
                await conn.execute(
                    select(records)
                    .where(r.org_id == org, r.is_deleted.is_(False))
                    .order_by(r.object_name, r.record_id)
                )
            )
            .mappings()
            .all()
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(str(row["object_name"]), []).append(
            {
                "record_id": row["record_id"],
                "version": int(row["record_version"]),
                "fields": _fields(row),
            }
        )
    return out


async def attempts_of(engine: AsyncEngine, org: str, run_id: str) -> list[dict[str, Any]]:
    """Every attempt of every step of the run, by step then attempt number."""
    s, a = flow_step_executions.c, flow_step_attempts.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            (
                await conn.execute(
                    select(
                        s.plan_step_key,
                        s.input_checkpoint_id,
                        a.step_execution_id,
                        a.attempt_id,
                        a.attempt_number,
                        a.transaction_outcome,
                        a.failure_class,
                        a.safe_error_code,
                        a.retry_decision,
                    )
                    .select_from(
                        flow_step_attempts.join(
                            flow_step_executions,
                            (s.org_id == a.org_id) & (s.step_execution_id == a.step_execution_id),
                        )
                    )
                    .where(s.org_id == org, s.flow_run_id == run_id)
                    .order_by(s.step_execution_id, a.attempt_number)
                )
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


@dataclass(frozen=True)
class StepEvidence:
    """Lifecycle and business rows one run left behind."""

    step_rows: list[dict[str, Any]]
    attempts: list[dict[str, Any]]
    event_attempts: list[str]
    audit_count: int
    checkpoints: list[dict[str, Any]]


async def evidence(engine: AsyncEngine, org: str, run_id: str) -> StepEvidence:
    s, e, au, c = (
        flow_step_executions.c,
        business_events.c,
        audit_records.c,
        flow_checkpoints.c,
    )
    async with db.transaction(engine, readonly=True) as conn:
        steps = [
            dict(r)
            for r in (
                await conn.execute(
                    select(flow_step_executions).where(s.org_id == org, s.flow_run_id == run_id)
                )
            ).mappings()
        ]
        event_attempts = [
            str(x)
            for x in (
                await conn.execute(
                    select(e.attempt_id).where(e.org_id == org, e.flow_run_id == run_id)
                )
            ).scalars()
        ]
        audits = int(
            (
                await conn.execute(
                    select(func.count())
                    .select_from(audit_records)
                    .where(au.org_id == org, au.flow_run_id == run_id)
                )
            ).scalar_one()
        )
        checkpoints = [
            dict(r)
            for r in (
                await conn.execute(
                    select(c.checkpoint_id, c.sequence, c.created_by_attempt_id)
                    .where(c.org_id == org, c.flow_run_id == run_id)
                    .order_by(c.sequence)
                )
            ).mappings()
        ]
    return StepEvidence(
        steps, await attempts_of(engine, org, run_id), event_attempts, audits, checkpoints
    )


async def checkpoint_context(engine: AsyncEngine, org: str, checkpoint_id: str) -> dict[str, Any]:
    c = flow_checkpoints.c
    async with db.transaction(engine, readonly=True) as conn:
        raw = (
            await conn.execute(
                select(c.context_payload).where(c.org_id == org, c.checkpoint_id == checkpoint_id)
            )
        ).scalar_one()
    value: dict[str, Any] = raw if isinstance(raw, dict) else json.loads(raw)
    return value
