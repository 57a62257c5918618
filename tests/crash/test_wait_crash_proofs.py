"""Crash proofs of durable waits (§22.4) with REAL runtime child processes on SQLite and
MariaDB: a time wait survives process and deployment restart; a producer that commits
its signal and is SIGKILLed before matching; a wait whose dependency commits and whose
process is SIGKILLed before the fresh reconciliation; a resolver SIGKILLed after
recording the resolution but before the scheduler claimed the step (on the hinted
path); a pre-claimed wake (ADR 0007) SIGKILLed before its worker ran the step.

Each child kills itself at one named fault point (``FLOW_CRASH_AT``); the test asserts
it died there (returncode -9 and the marker file), restarts a child without the hook and
waits (bounded) for the run to finish; then the resumed step's business effect exists
exactly once and the dependency and signal rows tell the story.
"""

from __future__ import annotations

import contextlib
import json
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.kernel.wait_model import DependencyState, SignalState
from runtime_svc.waits.evidence import evidence_digest
from services.auth import (
    bearer_metadata,
)
from services.proto import runtime_v1
from tests.crash.conftest import Child, Harness
from tests.integration.waits.support import (
    SIGNAL_KINDS,
    World,
    approval,
    dependencies,
    events_of,
    new_scope,
    signal_flow,
    signal_submitter_token,
    signals,
    task_subjects,
    timer_flow,
)
from tests.integration.worker.support import wait_until
from tests.support.procs import health_status

pytestmark = pytest.mark.crash

_DEATH_S = 60.0
_FINISH_S = 90.0
#: Wait sweeps every 200 ms in the children, external signal kinds of the tests.
WAIT_ENV = {
    "FLOW_RUNTIME_WAIT_SWEEP_MS": "200",
    "FLOW_RUNTIME_SIGNAL_KINDS": ",".join(SIGNAL_KINDS),
}


def _spawn(h: Harness, crash_at: str | None = None) -> Child:
    return h.spawn(crash_at, env=WAIT_ENV)


async def _expect_sigkill(h: Harness, child: Child, point: str) -> None:
    code = await child.wait_exit(_DEATH_S)
    if code != -9:
        pytest.fail(
            f"inconclusive: the child did not die by SIGKILL at {point} "
            f"(returncode {code}):\n{child.log_text()[-3000:]}"
        )
    assert h.marker.read_text().splitlines()[-1] == point
    assert f"SIGKILL at {point}" in child.log_text()


async def _until_state(
    store: FlowRunStateStore, org: str, run_id: str, child: Child, states: set[RunState]
) -> None:
    async def reached() -> bool:
        if child.proc.poll() is not None:
            pytest.fail(f"child exited {child.proc.returncode}:\n{child.log_text()[-3000:]}")
        return (await store.get_run(org, run_id, include_deleted=True)).state in states

    assert await wait_until(reached, timeout_s=_FINISH_S), child.log_text()[-3000:]


async def _serving(child: Child) -> None:
    async def up() -> bool:
        if child.proc.poll() is not None:
            pytest.fail(f"child exited {child.proc.returncode}:\n{child.log_text()[-3000:]}")
        try:
            return health_status(child.port) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    assert await wait_until(up, timeout_s=_DEATH_S), child.log_text()[-3000:]


def _world(engine: AsyncEngine) -> World:
    world = World(engine, new_scope())
    world.store = FlowRunStateStore(engine)  # the real database clock, as the children
    return world


async def test_time_wait_survives_process_and_deployment_restart(
    harness: Harness, engine: AsyncEngine
) -> None:
    world = _world(engine)
    await world.seed(timer_flow("PT3S", deadline="PT1H"))
    run = await world.start("wait_timer")
    first = _spawn(harness)
    await _until_state(world.store, world.org, run.flow_run_id, first, {RunState.WAITING})
    [dep] = await dependencies(engine, world.org, run.flow_run_id)
    first.proc.kill()  # the process dies with the timer pending: no process holds it
    first.stop()

    # Nothing runs while the due time passes (a deployment between two releases).
    async def due() -> bool:
        async with world.engine.connect() as conn:
            from services.db import db_now

            return dep.next_probe_at is not None and await db_now(conn) > dep.next_probe_at

    assert await wait_until(due, timeout_s=30)
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING

    second = _spawn(harness)  # the next deployment: a new process, same database
    await _until_state(world.store, world.org, run.flow_run_id, second, {RunState.SUCCEEDED})
    second.stop()
    [resolved] = await dependencies(engine, world.org, run.flow_run_id)
    assert resolved.state is DependencyState.RESOLVED
    assert resolved.next_probe_at is None and resolved.resolved_at is not None
    assert resolved.resolved_at >= dep.next_probe_at  # type: ignore[operator]
    assert await task_subjects(engine, world.org) == ["resumed"]
    assert await events_of(engine, world.org, run.flow_run_id) == 1


async def test_producer_commits_its_signal_and_dies_before_matching(
    harness: Harness, engine: AsyncEngine
) -> None:
    world = _world(engine)
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="crash")
    first = _spawn(harness)
    await _until_state(world.store, world.org, run.flow_run_id, first, {RunState.WAITING})
    first.stop()

    point = "after_signal_commit:external.signal"
    producer_side = _spawn(harness, point)
    await _serving(producer_side)
    token = signal_submitter_token(world.scope, harness.tmp, ttl_s=120)
    evidence = {"status": "approved"}
    channel = grpc.insecure_channel(f"127.0.0.1:{producer_side.port}")
    with channel, pytest.raises(grpc.RpcError):  # the process died before acknowledging
        runtime_v1.WakeSignalServiceStub(channel).SubmitWakeSignal(
            runtime_v1.SubmitWakeSignalRequest(
                request_id=uuid.uuid4().hex,
                producer_kind="external.signal",
                producer_key="approval:crash",
                wake_token="t1",
                evidence_json=json.dumps(evidence),
                evidence_digest=evidence_digest(evidence),
            ),
            metadata=bearer_metadata(token),
            timeout=30,
        )
    await _expect_sigkill(harness, producer_side, point)
    # The signal is durable (committed before the kill) and its match is still owed.
    [signal] = await signals(engine, world.org)
    assert signal.state is SignalState.UNMATCHED and signal.next_match_at is not None
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING

    restarted = _spawn(harness)
    await _until_state(world.store, world.org, run.flow_run_id, restarted, {RunState.SUCCEEDED})
    restarted.stop()
    [consumed] = await signals(engine, world.org)
    assert consumed.state is SignalState.CONSUMED and consumed.next_match_at is None
    assert await events_of(engine, world.org, run.flow_run_id) == 1


async def test_dependency_commits_and_the_process_dies_before_fresh_reconciliation(
    harness: Harness, engine: AsyncEngine
) -> None:
    world = _world(engine)
    await world.seed(signal_flow())
    # The notification came first; its producer-side match found no dependency.
    await world.rt.signals.submit(world.work, approval("early", "t1"))
    run = await world.start("wait_signal", key="early")

    point = "after_wait_commit:pause"
    await _expect_sigkill(harness, _spawn(harness, point), point)
    [dep] = await dependencies(engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.PENDING  # committed with the wait transition
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING
    [signal] = await signals(engine, world.org)
    assert signal.state is SignalState.UNMATCHED and signal.next_match_at is None

    restarted = _spawn(harness)  # the periodic reconciler's probe finds the signal
    await _until_state(world.store, world.org, run.flow_run_id, restarted, {RunState.SUCCEEDED})
    restarted.stop()
    [resolved] = await dependencies(engine, world.org, run.flow_run_id)
    assert resolved.wake_signal_id == signal.wake_signal_id
    assert await events_of(engine, world.org, run.flow_run_id) == 1


async def test_resolver_dies_after_recording_resolution_before_the_claim(
    harness: Harness, engine: AsyncEngine
) -> None:
    world = _world(engine)
    await world.seed(timer_flow("PT2S", deadline="PT1H"))
    run = await world.start("wait_timer")

    point = "after_resolution_commit:runtime.timer"
    # On the hinted path (no pre-claimed wake, ADR 0007): the resolution commits the
    # step Pending and the root Runnable, and the scheduler's claim is still to come.
    hinted = harness.spawn(point, env={**WAIT_ENV, "FLOW_RUNTIME_PRECLAIM_WAKE": "false"})
    await _expect_sigkill(harness, hinted, point)
    # The resolution is durable: dependency Resolved, root Runnable. (The dying child's
    # own step worker may see the committed resolution while the resolver still waits
    # for its COMMIT's answer — InnoDB makes a commit visible before the log flush that
    # precedes the answer — and claim the step before the SIGKILL: then the root is
    # Running under a lease of the dead process, which lease expiry recovers below.)
    [dep] = await dependencies(engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED
    assert (await world.run(run.flow_run_id)).state in {RunState.RUNNABLE, RunState.RUNNING}

    restarted = _spawn(harness)
    await _until_state(world.store, world.org, run.flow_run_id, restarted, {RunState.SUCCEEDED})
    restarted.stop()
    assert await task_subjects(engine, world.org) == ["resumed"]
    assert await events_of(engine, world.org, run.flow_run_id) == 1


async def test_preclaimed_wake_killed_before_its_step_runs_is_recovered_once(
    harness: Harness, engine: AsyncEngine
) -> None:
    """ADR 0007: the signal's resolution claimed the resumed step Running for the
    child's worker and committed; the child is SIGKILLed before the worker prepares it.
    Nobody else may claim the Running step; the restarted child's lease expiry recovers
    it and the run finishes with the resumed step's effect exactly once."""
    world = _world(engine)
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="pre")
    point = "after_preclaimed_wake:pause"
    child = _spawn(harness, point)
    await _serving(child)
    # The child's worker runs the wait step (so it holds the plan and the org's
    # admission state): the signal then finds a local worker with room.
    await _until_state(world.store, world.org, run.flow_run_id, child, {RunState.WAITING})
    token = signal_submitter_token(world.scope, harness.tmp, ttl_s=120)
    evidence = {"status": "approved"}
    channel = grpc.insecure_channel(f"127.0.0.1:{child.port}")
    with channel, contextlib.suppress(grpc.RpcError):  # it may die before answering
        runtime_v1.WakeSignalServiceStub(channel).SubmitWakeSignal(
            runtime_v1.SubmitWakeSignalRequest(
                request_id=uuid.uuid4().hex,
                producer_kind="external.signal",
                producer_key="approval:pre",
                wake_token="t1",
                evidence_json=json.dumps(evidence),
                evidence_digest=evidence_digest(evidence),
            ),
            metadata=bearer_metadata(token),
            timeout=30,
        )
    await _expect_sigkill(harness, child, point)
    # Resolution and claim committed together: the step is Running under the dead
    # process's lease, the signal consumed, the dependency resolved — no hint needed.
    assert (await world.run(run.flow_run_id)).state is RunState.RUNNING
    [dep] = await dependencies(engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED
    [signal] = await signals(engine, world.org)
    assert signal.state is SignalState.CONSUMED
    assert harness.entries("after") == 0

    restarted = _spawn(harness)  # lease expiry (1 s) hands the step to the new child
    await _until_state(world.store, world.org, run.flow_run_id, restarted, {RunState.SUCCEEDED})
    restarted.stop()
    assert await task_subjects(engine, world.org) == ["resumed"]
    assert await events_of(engine, world.org, run.flow_run_id) == 1
    assert harness.entries("after") == 1
