"""Child process of the Bounded Atomic crash proof (``test_atomic_crash_proofs.py``).

Runs what ``StartRun`` runs for a Bounded Atomic Flow — ``AtomicRunner.start``: the run
created already claimed and ``Running`` for this process (ADR 0005), then its business
transaction — against the database named by ``argv[1]``, for the request given as JSON
in ``argv[2]``. Started with ``FLOW_CRASH_AT=after_create_claimed`` it SIGKILLs itself
between the creating ``COMMIT`` and the business transaction. Its lease is 1 s, so a
restarted runtime's recovery hands the step on quickly.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from runtime_svc.atomic import AtomicRunner
from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    RetryPolicy,
    StartRunRequest,
)
from runtime_svc.worker import FixedViews
from services import db
from services.auth import TrustedRuntimeWorkScope
from tests.integration.worker.support import record_view

__all__ = ["CHILD_OWNER", "CHILD_POLICY", "main"]

#: The lease owner the child's runner claims as (the proof reads it back).
CHILD_OWNER = "atomic-crash-child"
CHILD_POLICY = RetryPolicy(
    max_attempts=4,
    base_delay_ms=50,
    max_delay_ms=400,
    jitter_ratio=0.25,
    lease_duration_ms=1_000,
    max_lease_expiries=3,
)


async def main(url: str, spec: dict[str, Any]) -> str:
    engine = db.create_engine(url, pool_size=2)
    try:
        store = FlowRunStateStore(engine, policy=CHILD_POLICY)
        runner = AtomicRunner(engine, store, FixedViews(record_view()), owner=CHILD_OWNER)
        request = StartRunRequest(
            plan_id=spec["plan_id"],
            first_step=FirstStep(**spec["first_step"]),
            input=CheckpointInput(context=spec["context"], plan_cursor=spec["plan_cursor"]),
        )
        created, run = await runner.start(TrustedRuntimeWorkScope(**spec["scope"]), request, 10.0)
        return f"{created.run.flow_run_id} {run.state.code}"
    finally:
        await engine.dispose()


if __name__ == "__main__":
    print(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
