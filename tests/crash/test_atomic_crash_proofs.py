"""Crash proof of a Bounded Atomic run created already claimed (ADR 0005; spec §12.4,
§22.2 "process death after claim"), on SQLite and MariaDB.

A REAL child process runs ``AtomicRunner.start`` (what ``StartRun`` runs) and SIGKILLs
itself at ``after_create_claimed`` — after the transaction that created the run and
claimed its step ``Running`` for the child committed, before the business transaction.
The step must then be durably ``Running`` under the dead child's lease with one started
attempt and no business write; a restarted runtime (``python -m runtime_svc serve``,
whose workers serve the Bounded Atomic lane) recovers the expired lease and finishes the
run with its business writes exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.runs.resolve import first_step_of
from runtime_svc.schema import flow_runs
from services import db
from tests.crash.atomic_child import CHILD_OWNER
from tests.crash.conftest import ROOT, Harness
from tests.integration.atomic.support import (
    ATOMIC_STEP,
    business_rows,
    evidence,
    seed_atomic,
    seed_business,
)
from tests.integration.worker.support import TERMINAL, wait_until

pytestmark = pytest.mark.crash

_POINT = "after_create_claimed"
_CHILD_S = 120.0
_FINISH_S = 60.0


async def _runs_of(engine: AsyncEngine, org: str) -> list[str]:
    r = flow_runs.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(select(r.flow_run_id).where(r.org_id == org))
        return [str(x) for x in rows.scalars()]


async def test_sigkill_after_create_claimed_then_lease_expiry_finishes_exactly_once(
    harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    before = await business_rows(engine, seeded.org)
    first = first_step_of(seeded.plan, seeded.plan.profile.value)
    spec: dict[str, Any] = {
        "scope": dataclasses.asdict(seeded.scope),
        "plan_id": seeded.plan_id,
        "first_step": dataclasses.asdict(first),
        "context": {"variables": {"oppId": biz.opp_id, "lineId": biz.line_id, "label": "won"}},
        "plan_cursor": {"step": first.plan_step_key},
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env.update(
        {
            "FLOW_CRASH_AT": _POINT,
            "FLOW_CRASH_MARKER_FILE": str(harness.marker),
            "FLOW_LOG_LEVEL": "WARNING",
            "FLOW_OTEL_ENABLED": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    child = subprocess.run(
        [sys.executable, "-m", "tests.crash.atomic_child", harness.db_url, json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=_CHILD_S,
        check=False,
    )
    log = (child.stdout + child.stderr).decode(errors="replace")
    if child.returncode != -9:
        pytest.fail(f"inconclusive: the child did not die by SIGKILL at {_POINT}:\n{log[-3000:]}")
    assert harness.marker.read_text().splitlines()[-1] == _POINT
    assert f"SIGKILL at {_POINT}" in log

    # The creating COMMIT made the run, its step Running under the child's lease and a
    # started attempt durable; nothing of the business transaction exists.
    [run_id] = await _runs_of(engine, seeded.org)
    assert (await store.get_run(seeded.org, run_id)).state is RunState.RUNNING
    ev = await evidence(engine, seeded.org, run_id)
    [step] = ev.step_rows
    assert step["plan_step_key"] == ATOMIC_STEP
    assert step["state"] == "Running" and step["lease_token"] is not None
    assert step["lease_owner"] == CHILD_OWNER and step["attempt_count"] == 1
    [attempt] = ev.attempts
    assert attempt["transaction_outcome"] not in ("Committed", "CommitUnknown")
    assert ev.event_attempts == [] and ev.audit_count == 0
    assert [c["sequence"] for c in ev.checkpoints] == [1]
    assert await business_rows(engine, seeded.org) == before

    # A restarted runtime recovers the expired lease and finishes the run once.
    runtime = harness.spawn()

    async def done() -> bool:
        if runtime.proc.poll() is not None:
            pytest.fail(f"restarted child exited {runtime.proc.returncode}:\n{runtime.log_text()}")
        run = await store.get_run(seeded.org, run_id, include_deleted=True)
        return run.state in TERMINAL

    assert await wait_until(done, timeout_s=_FINISH_S), runtime.log_text()[-3000:]
    runtime.stop()
    assert (await store.get_run(seeded.org, run_id)).state is RunState.SUCCEEDED
    ev = await evidence(engine, seeded.org, run_id)
    [step] = ev.step_rows
    assert step["state"] == "Succeeded" and step["attempt_count"] == 2
    committed = [a for a in ev.attempts if a["transaction_outcome"] == "Committed"]
    assert [a["attempt_number"] for a in committed] == [2]
    assert sorted(ev.event_attempts) == [committed[0]["attempt_id"]] * 3
    assert ev.audit_count == 3
    after = await business_rows(engine, seeded.org)
    assert len(after["Task"]) == 1
    assert after["OpportunityLineItem"][0]["fields"]["Quantity"] == 2
    assert after["Opportunity"][0]["version"] == 2
