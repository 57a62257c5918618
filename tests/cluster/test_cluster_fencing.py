"""Fences across the nodes of a real Galera cluster (§22.2, §22.3 "real distributed
engine" rows).

Row locks are node-local on Galera, so two workers on two nodes can both lock a row and
both see their conditional UPDATE match it; only one COMMIT survives certification. Each
test holds the competing transactions just before COMMIT (``CommitGate``), so both have
passed every fence *locally*, then lets them commit in a chosen order and proves the
loser's COMMIT failed (1213, a proven rollback) and that it abandoned — never a duplicate
claim, commit or business effect, never a commit-unknown. Where a step's last writes
carry its COMMIT (ADR 0014) the competitor commits before that round trip instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import LeaseFence, NotEligible, RunState, StepState
from runtime_svc.kernel.decisions import CancelRecorded, NoChange, Recovered
from runtime_svc.worker import Outcome, StepWorker
from services import db_batch
from tests.cluster.support import CommitGate, Node, commit_errors, count, nodes
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.worker.support import (
    drive,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)

DEADLOCK = 1213


def _gated_worker(node: Node, owner: str, gate: CommitGate) -> StepWorker:
    """A worker whose *business* transaction stops just before COMMIT (the gate is armed
    inside it, after the lifecycle fence was applied)."""

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn":
            gate.arm()

    # One step per batch: the race is about this step's COMMIT (a continued next step
    # would meet the armed gate again).
    return make_worker(
        node.engine, node.store, owner=owner, hook=hook, heartbeat=False, continuation_limit=0
    )


async def test_two_workers_on_two_nodes_claim_the_same_candidate_and_exactly_one_wins(
    engines: list[AsyncEngine],
) -> None:
    n = nodes(engines)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    [candidate] = await n[1].store.eligible_work(seeded.org, "durable_mutation")
    gates = [CommitGate(engines[0]), CommitGate(engines[1])]
    for gate in gates:
        gate.arm()
    with commit_errors(engines[1]) as errors:
        claims = [
            asyncio.ensure_future(n[i].store.claim(seeded.org, candidate, lease_owner=f"w{i}"))
            for i in (0, 1)
        ]
        # Both claim transactions locked root and step on their own node and applied the
        # claim's conditional UPDATEs (row count 1 each): only COMMIT is left.
        await asyncio.gather(*(g.wait_reached() for g in gates))
        gates[0].open()
        won = await claims[0]
        gates[1].open()
        lost = await claims[1]

    assert isinstance(won, LeaseFence) and won.lease_owner == "w0"
    # The loser's COMMIT failed certification; the whole claim was retried from the
    # start, re-read the (now claimed) root through a causal read, and abandoned.
    assert errors.codes == [DEADLOCK]
    assert isinstance(lost, NotEligible) and lost.reason in ("superseded", "root_not_runnable")
    for engine in engines:
        attempts = await count(
            engine,
            "SELECT COUNT(*) FROM flow_step_attempts WHERE org_id = :o",
            o=seeded.org,
        )
        assert attempts == 1
    snapshot = await n[2].store.support_view(seeded.org, run.flow_run_id)
    assert snapshot.run.state is RunState.RUNNING


async def test_two_worker_processes_on_two_nodes_commit_every_step_once(
    engines: list[AsyncEngine],
) -> None:
    n = nodes(engines)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    workers = [make_worker(n[i].engine, n[i].store, owner=f"w{i}") for i in (0, 1, 2)]
    # Every worker is delivered every candidate: the claim fence sorts them out.
    for _ in range(20):
        state = (await n[2].store.get_run(seeded.org, run.flow_run_id)).state
        if state is RunState.SUCCEEDED:
            break
        candidates = await n[0].store.eligible_work(seeded.org, "durable_mutation")
        for candidate in candidates:
            outcomes = await asyncio.gather(*(w.process(seeded.org, candidate) for w in workers))
            assert outcomes.count(Outcome.COMMITTED) == 1, outcomes
    assert (await n[1].store.get_run(seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    for key in ("bump1", "bump2", "bump3"):
        counts = await step_counts(engines[2], seeded.org, run.flow_run_id, key)
        assert (counts.committed_attempts, counts.business_events) == (1, 1), key
    [account] = await run_records(engines[1], seeded.org)
    assert account["record_version"] == 3


async def test_cancellation_on_another_node_wins_against_a_committing_step(
    engines: list[AsyncEngine],
) -> None:
    """Delete/cancel wins: the worker on node 1 has applied its business writes and its
    final root/step/attempt CAS, the cancellation commits on node 2 first; the worker's
    COMMIT fails certification, so every business write of the step is gone, and the
    worker abandons (the attempt stays ``Cancelled``)."""
    n = nodes(engines)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    gate = CommitGate(engines[0])
    worker = _gated_worker(n[0], "w0", gate)
    with commit_errors(engines[0]) as errors:
        processing = asyncio.ensure_future(worker.run_batch(seeded.org))
        await gate.wait_reached()
        cancelled = await n[1].store.request_cancel(seeded.org, run.flow_run_id)
        assert isinstance(cancelled, CancelRecorded)
        gate.open()
        assert await processing == [Outcome.FENCE_LOST]
    assert errors.codes == [DEADLOCK]

    counts = await step_counts(engines[2], seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events, counts.audit_records) == (0, 0, 0)
    assert await run_records(engines[2], seeded.org) == []
    await n[2].store.complete_cancel(seeded.org, run.flow_run_id)
    view = await n[1].store.support_view(seeded.org, run.flow_run_id)
    assert view.run.state is RunState.CANCELLED
    assert [a.outcome.name for a in view.attempts] == ["CANCELLED"]


async def test_cancellation_on_another_node_wins_against_a_step_whose_commit_rides_its_writes(
    engines: list[AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race on the production path, where the step's last writes carry its
    COMMIT (ADR 0014) and no client can stand between them: the worker on node 1 holds
    its lifecycle locks (node-local) and its fence passed; the cancellation commits on
    node 2 right before the worker's one round trip of writes + COMMIT goes out. That
    round trip fails (a certification conflict, 1213 — a proven rollback), so nothing of
    the step commits, and the worker abandons the step to the cancellation."""
    n = nodes(engines)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    cancelled: list[object] = []
    carried: list[str] = []
    real_round_trip = db_batch.round_trip

    async def round_trip(conn: AsyncConnection, sql: str, *args: Any, **kw: Any) -> None:
        if sql.endswith(";\nCOMMIT") and "INSERT INTO flow_checkpoints" in sql and not cancelled:
            carried.append(sql)
            cancelled.append(await n[1].store.request_cancel(seeded.org, run.flow_run_id))
        await real_round_trip(conn, sql, *args, **kw)

    monkeypatch.setattr(db_batch, "round_trip", round_trip)
    worker = make_worker(n[0].engine, n[0].store, owner="w0", heartbeat=False, continuation_limit=0)
    assert await worker.run_batch(seeded.org) == [Outcome.FENCE_LOST]
    assert [type(c) for c in cancelled] == [CancelRecorded]
    # The step's writes went out with their COMMIT, each fenced UPDATE guarded before it.
    assert len(carried) == 1 and "ROW_COUNT()" in carried[0]

    counts = await step_counts(engines[2], seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events, counts.audit_records) == (0, 0, 0)
    assert await run_records(engines[2], seeded.org) == []
    await n[2].store.complete_cancel(seeded.org, run.flow_run_id)
    view = await n[1].store.support_view(seeded.org, run.flow_run_id)
    assert view.run.state is RunState.CANCELLED
    assert [a.outcome.name for a in view.attempts] == ["CANCELLED"]


async def test_a_step_commit_on_one_node_wins_against_cancellation_on_another(
    engines: list[AsyncEngine],
) -> None:
    """Commit wins: both transactions are at COMMIT; the worker's commits first, the
    cancellation's fails certification and is retried whole — it then sees the committed
    advancement (causal read) and cancels the *next* step, never relabelling the
    committed one."""
    n = nodes(engines)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    worker_gate, cancel_gate = CommitGate(engines[0]), CommitGate(engines[1])
    worker = _gated_worker(n[0], "w0", worker_gate)
    with commit_errors(engines[1]) as errors:
        processing = asyncio.ensure_future(worker.run_batch(seeded.org))
        await worker_gate.wait_reached()
        cancel_gate.arm()
        cancelling = asyncio.ensure_future(n[1].store.request_cancel(seeded.org, run.flow_run_id))
        await cancel_gate.wait_reached()
        worker_gate.open()
        assert await processing == [Outcome.COMMITTED]
        cancel_gate.open()
        assert isinstance(await cancelling, CancelRecorded)
    assert errors.codes == [DEADLOCK]

    counts = await step_counts(engines[2], seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events) == (1, 1)
    await n[2].store.complete_cancel(seeded.org, run.flow_run_id)
    view = await n[2].store.support_view(seeded.org, run.flow_run_id)
    assert view.run.state is RunState.CANCELLED
    assert [a.outcome.name for a in view.attempts] == ["COMMITTED"]
    assert len(await run_records(engines[1], seeded.org)) == 1


async def test_lease_recovery_on_another_node_fences_a_worker_that_is_committing(
    engines: list[AsyncEngine],
) -> None:
    """§12.4 across nodes: the worker on node 1 is at COMMIT when its lease is recovered
    on node 2. Recovery commits first; the worker's COMMIT fails certification and its
    business writes vanish; the retry (a new attempt, claimed on node 3 once due) commits
    the step exactly once."""
    clock = ShiftedClock()
    n = nodes(engines, clock)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    gate = CommitGate(engines[0])
    worker = _gated_worker(n[0], "w0", gate)
    with commit_errors(engines[0]) as errors:
        processing = asyncio.ensure_future(worker.run_batch(seeded.org))
        await gate.wait_reached()
        clock.advance(milliseconds=n[0].store.policy.lease_duration_ms + 1)
        [recovered] = await n[1].store.recover_expired(seeded.org)
        assert isinstance(recovered.decision, Recovered)
        gate.open()
        assert await processing == [Outcome.FENCE_LOST]
    assert errors.codes == [DEADLOCK]
    counts = await step_counts(engines[2], seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events) == (0, 0)

    clock.advance(hours=2)  # past the recovery backoff floor
    replacement = make_worker(n[2].engine, n[2].store, owner="w2")
    assert (await drive(replacement, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    view = await n[0].store.support_view(seeded.org, run.flow_run_id)
    first = [a for a in view.attempts if a.step_execution_id == view.attempts[0].step_execution_id]
    assert [a.outcome.name for a in first] == ["FENCED", "COMMITTED"]
    counts = await step_counts(engines[1], seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events) == (1, 1)


async def test_a_committing_worker_wins_against_lease_recovery_on_another_node(
    engines: list[AsyncEngine],
) -> None:
    clock = ShiftedClock()
    n = nodes(engines, clock)
    seeded = await seed(engines[0])
    run = await start_run(n[0].store, seeded)
    worker_gate, recovery_gate = CommitGate(engines[0]), CommitGate(engines[1])
    worker = _gated_worker(n[0], "w0", worker_gate)
    with commit_errors(engines[1]) as errors:
        processing = asyncio.ensure_future(worker.run_batch(seeded.org))
        await worker_gate.wait_reached()
        clock.advance(milliseconds=n[0].store.policy.lease_duration_ms + 1)
        view = await n[1].store.support_view(seeded.org, run.flow_run_id)
        step_id = view.attempts[0].step_execution_id
        recovery_gate.arm()
        recovering = asyncio.ensure_future(
            n[1].store.recover_step(seeded.org, run.flow_run_id, step_id)
        )
        await recovery_gate.wait_reached()
        worker_gate.open()
        assert await processing == [Outcome.COMMITTED]
        recovery_gate.open()
        assert isinstance(await recovering, NoChange)
    assert errors.codes == [DEADLOCK]
    view = await n[2].store.support_view(seeded.org, run.flow_run_id)
    assert [a.outcome.name for a in view.attempts] == ["COMMITTED"]
    assert view.run.state is RunState.RUNNABLE
    steps = {s.step_execution_id: s.state for s in view.steps}
    assert steps[step_id] is StepState.SUCCEEDED
