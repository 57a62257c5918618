"""Every org with due work is served (issue 10, item 1): the workers, the sweeper and the
retention purge walk the orgs with a cursor that resumes after the last org served and
wraps around, in bounded batches — with 500 orgs and batches of 100, org 101 and org 500
are reached within five passes (the old ``ORDER BY org_id LIMIT 100`` served the first
100 for ever). On SQLite and MariaDB."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.kernel.store_reads import get_run_txn
from runtime_svc.kernel.store_retention import RetentionSweep
from runtime_svc.schema import (
    execution_plans,
    flow_checkpoints,
    flow_runs,
    flow_step_executions,
    flow_versions,
)
from runtime_svc.worker import FixedViews, Outcome, StepWorker, Sweeper
from services import db, migrate
from services.auth import TrustedRuntimeWorkScope
from services.digest import versioned_digest
from tests.integration.kernel.helpers import FIRST
from tests.integration.worker.support import record_view

ORGS = 500
BATCH = 100


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade(db_url, "runtime_svc")
    eng = db.create_engine(db_url, pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


def _scope(i: int) -> TrustedRuntimeWorkScope:
    org = f"org-{i:04d}"
    return TrustedRuntimeWorkScope(org, "inst", "cap", versioned_digest("binding", {"o": org}))


async def _seed_runs(
    engine: AsyncEngine, orgs: int = ORGS, *, terminal: bool = False
) -> list[tuple[str, str]]:
    """One plan and one run in each of ``orgs`` orgs, in a few bulk statements: the run
    ``Runnable`` with its ``Pending`` first step and input checkpoint (what
    ``create_run`` writes), or — ``terminal`` — ``Cancelled`` an hour ago."""
    now = datetime.now(UTC)
    past = now - timedelta(hours=1)
    digest = versioned_digest("test", {"x": 1})
    scopes = [_scope(i) for i in range(orgs)]
    ids = {s.org_id: uuid.uuid4().hex[:12] for s in scopes}
    run_state, step_state = ("Cancelled", "Cancelled") if terminal else ("Runnable", "Pending")
    async with db.transaction(engine) as conn:
        await conn.execute(
            flow_versions.insert(),
            [
                {
                    "org_id": s.org_id,
                    "flow_version_id": f"fv_{ids[s.org_id]}",
                    "flow_id": "Rotation",
                    "version_number": 1,
                    "source_payload": "{}",
                    "metadata_digest": digest,
                    "created_at": now,
                }
                for s in scopes
            ],
        )
        await conn.execute(
            execution_plans.insert(),
            [
                {
                    **dataclasses.asdict(s),
                    "plan_id": f"plan_{ids[s.org_id]}",
                    "flow_version_id": f"fv_{ids[s.org_id]}",
                    "metadata_digest": digest,
                    "compiler_version": "test",
                    "catalog_generation_id": "gen_1",
                    "catalog_digest": digest,
                    "catalog_revision": 1,
                    "schema_generation": 1,
                    "engine_generation": 1,
                    "catalog_snapshot_digest": digest,
                    "runtime_metadata_view_digest": digest,
                    "trigger_binding_digest": digest,
                    "policy_version": 1,
                    "execution_profile": "durable_orchestration",
                    "plan_digest": digest,
                    "plan_payload": "{}",
                    "bound_summary": "{}",
                    "diagnostic_summary": "[]",
                    "created_at": now,
                }
                for s in scopes
            ],
        )
        await conn.execute(
            flow_runs.insert(),
            [
                {
                    **dataclasses.asdict(s),
                    "flow_run_id": f"run_{ids[s.org_id]}",
                    "flow_version_id": f"fv_{ids[s.org_id]}",
                    "plan_id": f"plan_{ids[s.org_id]}",
                    "execution_profile": "durable_orchestration",
                    "execution_owner": "FlowRuntimeV2",
                    "runtime_state": run_state,
                    "current_step_execution_id": f"step_{ids[s.org_id]}",
                    "current_checkpoint_id": f"ckpt_{ids[s.org_id]}",
                    "state_version": 0,
                    "ownership_epoch": 1,
                    "run_after": None if terminal else now,
                    "queue_class": FIRST.queue_class,
                    "priority": 0,
                    "is_deleted": False,
                    "legal_hold": False,
                    "completed_at": past if terminal else None,
                    "interview_status": "Finished" if terminal else "Running",
                    "current_element": FIRST.plan_step_key,
                    "created_at": past if terminal else now,
                    "updated_at": now,
                }
                for s in scopes
            ],
        )
        await conn.execute(
            flow_checkpoints.insert(),
            [
                {
                    "org_id": s.org_id,
                    "checkpoint_id": f"ckpt_{ids[s.org_id]}",
                    "flow_run_id": f"run_{ids[s.org_id]}",
                    "sequence": 1,
                    "plan_cursor": "{}",
                    "context_schema_version": 1,
                    "context_payload": "{}",
                    "context_digest": digest,
                    "created_at": now,
                }
                for s in scopes
            ],
        )
        await conn.execute(
            flow_step_executions.insert(),
            [
                {
                    "org_id": s.org_id,
                    "step_execution_id": f"step_{ids[s.org_id]}",
                    "flow_run_id": f"run_{ids[s.org_id]}",
                    "plan_step_key": FIRST.plan_step_key,
                    "invocation_ordinal": 0,
                    "step_kind": FIRST.step_kind,
                    "state": step_state,
                    "input_checkpoint_id": f"ckpt_{ids[s.org_id]}",
                    "state_version": 0,
                    "attempt_count": 0,
                    "ownership_epoch": 1,
                    "run_after": None if terminal else now,
                    "queue_class": FIRST.queue_class,
                    "created_at": now,
                    "updated_at": now,
                }
                for s in scopes
            ],
        )
    return [(s.org_id, f"run_{ids[s.org_id]}") for s in scopes]


async def test_the_workers_serve_all_500_orgs_within_five_passes(engine: AsyncEngine) -> None:
    store = FlowRunStateStore(engine)
    runs = await _seed_runs(engine)
    served: list[str] = []

    class Recording(StepWorker):
        async def run_batch(self, org_id: str) -> list[Outcome]:
            served.append(org_id)
            return []

    worker = Recording(engine, store, FixedViews(record_view()), owner="w", org_batch=BATCH)
    for _ in range(ORGS // BATCH):
        await worker.run_once()
    assert sorted(served) == sorted(org for org, _ in runs)
    assert len(served) == ORGS  # no org served twice before every org was served once
    # The sixth pass wraps around to the first orgs.
    await worker.run_once()
    assert served[ORGS:] == sorted(org for org, _ in runs)[:BATCH]


async def test_the_sweeper_reaches_cancellations_beyond_the_first_100_orgs(
    engine: AsyncEngine,
) -> None:
    store = FlowRunStateStore(engine)
    runs = await _seed_runs(engine)
    picked = [runs[i] for i in (0, 100, 250, 420, ORGS - 1)]
    async with db.transaction(engine) as conn:
        for org, run_id in picked:
            await store.cancel_txn(conn, org, run_id, delete=False)
    sweeper = Sweeper(engine, store, org_batch=BATCH)
    totals = [await sweeper.sweep_once() for _ in range(ORGS // BATCH)]
    assert sum(c for _, c in totals) == len(picked)
    async with db.transaction(engine, readonly=True) as conn:
        states = {(await get_run_txn(conn, org, run_id)).state for org, run_id in picked}
    assert states == {RunState.CANCELLED}


async def test_the_retention_purge_reaches_every_org_in_rotation(engine: AsyncEngine) -> None:
    runs = await _seed_runs(engine, 150, terminal=True)
    sweep = RetentionSweep(engine, retention=timedelta(minutes=1), org_batch=50)
    purged = []
    for _ in range(3):
        purged.extend(run for report in await sweep.sweep_once() for run in report.purged)
    assert sorted(purged) == sorted(run_id for _, run_id in runs)
