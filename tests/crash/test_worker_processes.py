"""Worker processes (issue 13, ``FLOW_RUNTIME_WORKER_PROCESSES``) on one database.

Real processes on SQLite and MariaDB: a runtime ``serve`` process supervising N
``runtime_svc worker --supervised`` children executes many runs — every run finishes once,
no step commits twice, no business effect is duplicated (the soak checker
``tests.support.invariants.check_exactly_once``); a worker process SIGKILLed at a named
point inside a step leaves a lease that expires, and the pool's processes finish its run
with one effect; the supervisor restarts a worker process that was killed; SIGTERM of the
supervisor — and even its SIGKILL — leaves no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore
from tests.crash.conftest import Child, Harness
from tests.integration.worker.support import (
    MUTATION_STEPS,
    TERMINAL,
    run_records,
    seed,
    start_run,
    wait_until,
)
from tests.support.invariants import check_exactly_once
from tests.support.procs import free_port, health_status

pytestmark = pytest.mark.crash

_RUNS = 12
_FINISH_S = 180.0
_STARTED = re.compile(r"runtime worker process (\d+) started \(pid (\d+)\)")


def _pool_env(processes: int) -> dict[str, str]:
    return {
        "FLOW_RUNTIME_WORKER_PROCESSES": str(processes),
        "FLOW_RUNTIME_WORKERS": "2",
        # The supervisor logs its children's pids at INFO.
        "FLOW_LOG_LEVEL": "INFO",
    }


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's zombie may linger unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(child: Child) -> dict[int, list[int]]:
    """Slot -> pids the supervisor started in it (in order), from its log."""
    out: dict[int, list[int]] = {}
    for slot, pid in _STARTED.findall(child.log_text()):
        out.setdefault(int(slot), []).append(int(pid))
    return out


async def _pool_started(child: Child, processes: int) -> dict[int, list[int]]:
    async def started() -> bool:
        if child.proc.poll() is not None:
            pytest.fail(f"supervisor exited {child.proc.returncode}:\n{child.log_text()[-3000:]}")
        return len(_children(child)) == processes

    assert await wait_until(started, timeout_s=60), child.log_text()[-3000:]
    return _children(child)


async def _all_terminal(child: Child, store: FlowRunStateStore, org: str, ids: list[str]) -> None:
    async def done() -> bool:
        if child.proc.poll() is not None:
            pytest.fail(f"supervisor exited {child.proc.returncode}:\n{child.log_text()[-3000:]}")
        for run_id in ids:
            run = await store.get_run(org, run_id, include_deleted=True)
            if run.state not in TERMINAL:
                return False
        return True

    assert await wait_until(done, timeout_s=_FINISH_S, poll_s=0.3), child.log_text()[-3000:]


async def _assert_each_run_once(engine: AsyncEngine, org: str, ids: list[str]) -> None:
    await check_exactly_once(engine, org, expected_runs=ids)
    accounts = await run_records(engine, org)
    assert len(accounts) == len(ids)  # one record per run (created by its bump1)
    assert all(a["record_version"] == len(MUTATION_STEPS) for a in accounts), accounts


async def _stop_and_assert_no_process(child: Child, pids: list[int]) -> None:
    child.proc.send_signal(signal.SIGTERM)
    code = await child.wait_exit(90)
    assert code == 0, child.log_text()[-3000:]
    assert not [p for p in pids if _alive(p)], child.log_text()[-3000:]


async def test_worker_processes_contend_every_run_once_and_a_killed_one_is_restarted(
    harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    ids = [(await start_run(store, seeded, label=f"P{i}")).flow_run_id for i in range(_RUNS)]
    sup = harness.spawn(env=_pool_env(2))
    slots = await _pool_started(sup, 2)
    # Probes target the supervisor: SERVING once its pool is up.
    assert await wait_until(lambda: _async_true(_serving(sup.port)), timeout_s=60)
    # Once work is under way, SIGKILL one worker process wherever it is (mid-step or not).
    assert await wait_until(
        lambda: _async_true(harness.entries_file.exists()), timeout_s=_FINISH_S
    ), sup.log_text()[-3000:]
    victim = slots[0][0]
    os.kill(victim, signal.SIGKILL)

    async def restarted() -> bool:
        pids = _children(sup).get(0, [])
        return len(pids) >= 2 and _alive(pids[-1])

    assert await wait_until(restarted, timeout_s=60), sup.log_text()[-3000:]
    assert f"(pid {victim}) exited with -9" in sup.log_text()

    await _all_terminal(sup, store, seeded.org, ids)
    await _assert_each_run_once(engine, seeded.org, ids)
    every = [p for pids in _children(sup).values() for p in pids]
    await _stop_and_assert_no_process(sup, every)
    assert "runtime worker process: 2 process(es) stopped" in sup.log_text()


async def _async_true(value: bool) -> bool:
    return value


async def test_worker_process_sigkilled_inside_a_step_another_process_finishes_it_once(
    harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """A worker-only process dies inside bump2's business transaction (after the fence,
    before COMMIT) holding the step's lease; a pool of two worker processes recovers the
    lease when it expires and finishes every run, bump2 committing exactly once."""
    seeded = await seed(engine)
    ids = [(await start_run(store, seeded, label=f"K{i}")).flow_run_id for i in range(4)]
    point = "before_step_commit:bump2"
    doomed = harness.spawn(point, env={"FLOW_RUNTIME_SWEEPS": "false"}, command="worker")
    code = await doomed.wait_exit(120)
    if code != -9:
        pytest.fail(f"inconclusive: exit {code} instead of SIGKILL:\n{doomed.log_text()[-3000:]}")
    assert harness.marker.read_text().splitlines()[-1] == point
    assert harness.entries("bump2") == 1

    metrics_port = free_port()
    sup = harness.spawn(env={**_pool_env(2), "FLOW_METRICS_PORT": str(metrics_port)})
    await _pool_started(sup, 2)
    await _all_terminal(sup, store, seeded.org, ids)
    await _assert_each_run_once(engine, seeded.org, ids)
    # The killed step was entered again (its transaction never committed): at least one
    # entry per run plus the killed one. More entries are legitimate under load — two
    # processes contending on MariaDB can roll a business transaction back (deadlock,
    # lock-wait timeout) and re-enter the step, or a lease can expire while a starved
    # process runs it; what must hold is that every run's writes committed once
    # (_assert_each_run_once above).
    assert harness.entries("bump2") >= len(ids) + 1
    # The supervisor's one /metrics carries its worker processes' claims (every bump3
    # was claimed by one of them), each family once.
    text = await asyncio.to_thread(_scrape, metrics_port)
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    claimed = sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "nexus_flow_claims"
        for s in f.samples
        if s.name == "nexus_flow_claims_total" and "worker_process" in s.labels
    )
    assert claimed >= len(ids), text
    every = [p for pids in _children(sup).values() for p in pids]
    await _stop_and_assert_no_process(sup, every)


async def test_a_sigkilled_supervisor_leaves_no_worker_process(
    harness: Harness, engine: AsyncEngine
) -> None:
    """Even when the supervisor cannot stop them (SIGKILL), its worker processes see
    their stdin close and drain: no orphan keeps executing steps."""
    del engine  # the migrated database the harness needs
    sup = harness.spawn(env=_pool_env(2))
    pids = [p for ps in (await _pool_started(sup, 2)).values() for p in ps]
    assert all(_alive(p) for p in pids)
    sup.proc.kill()
    assert await sup.wait_exit(30) == -9
    gone = await wait_until(lambda: _async_true(not any(_alive(p) for p in pids)), timeout_s=90)
    assert gone, [p for p in pids if _alive(p)]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return str(resp.read().decode("utf-8"))


def _serving(port: int) -> bool:
    try:
        return health_status(port) == 1  # SERVING
    except grpc.RpcError:  # not up yet
        return False


async def test_a_worker_process_stopped_by_sigterm_mid_work_exits_0_and_its_runs_finish_once(
    harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """Graceful shutdown of ``runtime_svc worker`` while it executes: it drains (current
    steps finish or are abandoned to lease expiry) and exits 0; worker processes started
    afterwards finish every run exactly once."""
    seeded = await seed(engine)
    ids = [(await start_run(store, seeded, label=f"T{i}")).flow_run_id for i in range(6)]
    env = {"FLOW_RUNTIME_SWEEPS": "false", "FLOW_RUNTIME_WORKERS": "2", "FLOW_LOG_LEVEL": "INFO"}
    worker = harness.spawn(env=env, command="worker")

    async def working() -> bool:
        if worker.proc.poll() is not None:
            pytest.fail(f"worker exited {worker.proc.returncode}:\n{worker.log_text()[-3000:]}")
        return harness.entries_file.exists() and bool(harness.entries_file.read_text())

    assert await wait_until(working, timeout_s=_FINISH_S), worker.log_text()[-3000:]
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.wait_exit(90) == 0, worker.log_text()[-3000:]
    assert "SIGTERM received; draining" in worker.log_text()

    sup = harness.spawn(env=_pool_env(2))
    await _pool_started(sup, 2)
    await _all_terminal(sup, store, seeded.org, ids)
    await _assert_each_run_once(engine, seeded.org, ids)
    every = [p for pids in _children(sup).values() for p in pids]
    await _stop_and_assert_no_process(sup, every)


def _not_serving(port: int) -> bool:
    try:
        return health_status(port) == 2  # NOT_SERVING
    except grpc.RpcError:
        return False


async def test_a_crash_looping_worker_process_turns_the_supervisor_not_serving(
    harness: Harness, engine: AsyncEngine
) -> None:
    """A worker process that dies again and again right after it starts (here: SIGKILLed
    by the test each time; in production a bad node, OOM, a database it cannot reach)
    makes the supervisor's gRPC health NOT_SERVING — the pod executes no step, and its
    probes must say so instead of a healthy-looking supervisor — and the log names it."""
    del engine  # the migrated database the harness needs
    sup = harness.spawn(env=_pool_env(1))
    await _pool_started(sup, 1)
    assert await wait_until(lambda: _async_true(_serving(sup.port)), timeout_s=60)
    killed: set[int] = set()

    async def kill_each_new_child() -> bool:
        if sup.proc.poll() is not None:
            pytest.fail(f"supervisor exited {sup.proc.returncode}:\n{sup.log_text()[-3000:]}")
        for pid in _children(sup).get(0, []):
            if pid not in killed:
                killed.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return _not_serving(sup.port)

    assert await wait_until(kill_each_new_child, timeout_s=90, poll_s=0.1), sup.log_text()[-3000:]
    assert len(killed) >= 3  # RestartPolicy.unhealthy_after short lives in a row
    assert "crash-looping: slot 0" in sup.log_text()
    await _stop_and_assert_no_process(sup, sorted(killed))
