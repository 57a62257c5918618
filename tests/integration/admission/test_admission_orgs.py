"""500 orgs with due work are all served — fairly (§22.7, issue 14 item 3), on SQLite and
MariaDB: the rotation of issue 10 makes the walk complete, the deficit scheduler makes
it fair. One of the 500 orgs has eleven times the due work of the others; with admission
it is given at most one quantum per visit, so every other org is reached within the
same five passes, each exactly once, and the hot org's backlog waits for its later
visits instead of delaying theirs.

The worker here claims each admitted candidate (a real fenced claim; the step leaves the
queue) without executing it: the orgs' plans are placeholders, and what is under test is
who gets admitted when.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.controller import AdmissionController
from runtime_svc.kernel import Candidate, FlowRunStateStore, NotEligible
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_executions
from runtime_svc.worker import FixedViews, Outcome, StepWorker
from services import db
from tests.integration.kernel.helpers import FIRST
from tests.integration.worker.support import record_view
from tests.integration.worker.test_worker_org_rotation import _seed_runs
from tests.integration.worker.test_worker_org_rotation import engine as fresh  # noqa: F401

ORGS = 500
BATCH = 100
HOT_EXTRA = 10
QUANTUM = 1


async def _clone_runs(engine: AsyncEngine, org: str, copies: int) -> None:
    """``copies`` more due runs of ``org``: its one seeded run, checkpoint and step row
    copied under new ids."""
    async with db.transaction(engine) as conn:
        rows = {
            t: dict((await conn.execute(select(t).where(t.c.org_id == org))).mappings().one())
            for t in (flow_runs, flow_checkpoints, flow_step_executions)
        }
        for i in range(copies):
            ids = {
                "flow_run_id": f"run_hot_{i}",
                "checkpoint_id": f"ckpt_hot_{i}",
                "step_execution_id": f"step_hot_{i}",
            }
            await conn.execute(
                flow_runs.insert(),
                {
                    **rows[flow_runs],
                    "flow_run_id": ids["flow_run_id"],
                    "current_step_execution_id": ids["step_execution_id"],
                    "current_checkpoint_id": ids["checkpoint_id"],
                },
            )
            await conn.execute(
                flow_checkpoints.insert(),
                {**rows[flow_checkpoints], **{k: ids[k] for k in ("flow_run_id", "checkpoint_id")}},
            )
            await conn.execute(
                flow_step_executions.insert(),
                {**rows[flow_step_executions], **ids, "input_checkpoint_id": ids["checkpoint_id"]},
            )


class ClaimOnly(StepWorker):
    """Claims what admission lets through and records it (no execution)."""

    served: list[str]

    async def process(self, org_id: str, candidate: Candidate) -> Outcome:
        claimed = await self.store.claim(org_id, candidate, lease_owner=self.owner)
        if isinstance(claimed, NotEligible):
            return Outcome.NOT_ELIGIBLE
        self.served.append(org_id)
        return Outcome.COMMITTED

    async def process_chain(
        self, org_id: str, candidate: Candidate, *, gate: Callable[[str], bool] | None = None
    ) -> list[Outcome]:
        return [await self.process(org_id, candidate)]  # a claim has no continuation


async def test_500_orgs_with_due_work_are_all_served_and_a_hot_one_gets_one_quantum(
    fresh: AsyncEngine,  # noqa: F811
) -> None:
    engine = fresh
    runs = await _seed_runs(engine)
    hot = runs[0][0]
    await _clone_runs(engine, hot, HOT_EXTRA)
    store = FlowRunStateStore(engine)
    admission = AdmissionController(engine, budget=4, quantum=QUANTUM)
    worker = ClaimOnly(
        engine,
        store,
        FixedViews(record_view()),
        owner="w",
        org_batch=BATCH,
        admission=admission,
        queue_classes=(FIRST.queue_class,),
    )
    worker.served = []
    for _ in range(ORGS // BATCH):
        await worker.run_once()
    counts = Counter(worker.served)
    assert set(counts) == {org for org, _ in runs}  # every org reached in five passes
    assert set(counts.values()) == {QUANTUM}  # ... each once, the hot org too
    # The hot org's backlog is served on its later visits, one quantum each.
    for _ in range(3):
        await worker.run_once()
    assert Counter(worker.served)[hot] == 1 + QUANTUM
