"""Shared support of the admission tests and bench: orgs with real compiled Durable
Orchestration plans and runs on a chosen lane, a worker that records the order it
processed candidates in, and the counts the assertions read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.controller import AdmissionController
from runtime_svc.definitions.policy import DEFAULT_POLICY_DOCUMENT
from runtime_svc.definitions.policy_store import PolicyStore
from runtime_svc.kernel import (
    Candidate,
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    StartRunRequest,
)
from runtime_svc.kernel.states import TERMINAL_RUN_STATES
from runtime_svc.schema import flow_runs, flow_step_executions
from runtime_svc.worker import FixedViews, Outcome, StepWorker
from services import db
from tests.integration.worker.support import Seeded, record_view, seed

__all__ = [
    "OrgRuns",
    "RecordingWorker",
    "live_started_runs",
    "publish_admission",
    "seed_org",
    "states",
]


@dataclass(frozen=True)
class OrgRuns:
    seeded: Seeded
    run_ids: tuple[str, ...]

    @property
    def org(self) -> str:
        return self.seeded.org


async def seed_org(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    org: str,
    runs: int,
    *,
    lane: str = "durable_mutation",
    mutations: int = 1,
) -> OrgRuns:
    """A compiled worker Flow (``mutations`` durable steps) in ``org`` and ``runs`` runs
    whose first step is on ``lane``."""
    seeded = await seed(engine, org, mutations=mutations, pure_step=False)
    step = seeded.plan.step(seeded.plan.start_step)
    ids = []
    for i in range(runs):
        result = await store.create_run(
            seeded.scope,
            StartRunRequest(
                plan_id=seeded.plan_id,
                first_step=FirstStep(step.key, step.kind.value, lane),
                input=CheckpointInput(context={"variables": {"label": f"r{i}", "n": i}}),
            ),
        )
        ids.append(result.run.flow_run_id)
    return OrgRuns(seeded, tuple(ids))


async def publish_admission(engine: AsyncEngine, org: str, admission: dict[str, Any]) -> None:
    """Publish a runtime-policy generation of ``org`` with this admission section."""
    await PolicyStore(engine).put(org, {**DEFAULT_POLICY_DOCUMENT, "admission": admission})


@dataclass
class Processed:
    org: str
    run_id: str
    lane: str
    outcome: Outcome


class RecordingWorker(StepWorker):
    """A real worker that logs every candidate it processed, in order."""

    def __init__(
        self,
        engine: AsyncEngine,
        store: FlowRunStateStore,
        *,
        admission: AdmissionController | None,
        owner: str = "w",
        **kw: Any,
    ) -> None:
        super().__init__(
            engine, store, FixedViews(record_view()), owner=owner, admission=admission, **kw
        )
        self.log: list[Processed] = []

    async def process(self, org_id: str, candidate: Candidate) -> Outcome:
        outcome = await super().process(org_id, candidate)
        self.log.append(Processed(org_id, candidate.flow_run_id, candidate.queue_class, outcome))
        return outcome

    async def process_chain(
        self, org_id: str, candidate: Candidate, *, gate: Callable[[str], bool] | None = None
    ) -> list[Outcome]:
        # Every step of the chain (the claimed one and each continued one), in order.
        outcomes = await super().process_chain(org_id, candidate, gate=gate)
        for outcome in outcomes:
            self.log.append(
                Processed(org_id, candidate.flow_run_id, candidate.queue_class, outcome)
            )
        return outcomes


async def states(engine: AsyncEngine, org: str, run_ids: Sequence[str]) -> dict[str, str]:
    """``run id -> runtime_state`` of ``run_ids``."""
    r = flow_runs.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            await conn.execute(
                select(r.flow_run_id, r.runtime_state).where(
                    r.org_id == org, r.flow_run_id.in_(list(run_ids))
                )
            )
        ).all()
    return {str(a): str(b) for a, b in rows}


_TERMINAL = tuple(s.code for s in TERMINAL_RUN_STATES)


async def live_started_runs(engine: AsyncEngine, org: str) -> set[str]:
    """Runs of ``org`` that have been claimed at least once and are not terminal."""
    s, r = flow_step_executions.c, flow_runs.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            select(s.flow_run_id)
            .select_from(
                flow_step_executions.join(
                    flow_runs, (r.org_id == s.org_id) & (r.flow_run_id == s.flow_run_id)
                )
            )
            .where(
                s.org_id == org,
                s.attempt_count > 0,
                r.runtime_state.not_in(_TERMINAL),
            )
            .distinct()
        )
        return {str(x) for x in rows.scalars()}
