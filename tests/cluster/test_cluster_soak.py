"""Seeded soak on the cluster: 300 runs, three runtime processes (``python -m runtime_svc``,
workers and sweeps on) each pointed at its own node, one node SIGKILLed and restarted
while they work, then the exactly-once invariant checker of the soaks
(``tests/support/invariants.py``).

The process on the killed node loses its database mid-whatever: its connection dies in
a claim, a step transaction or a COMMIT. Its leases expire and the other processes'
sweeps recover them through the surviving nodes; a transaction that was certified before
the node died is on every node and is never run again; one that was not never happened.
When the node is back (a full state transfer) its process carries on. A commit-unknown
quarantine, if the dying connection produced one, is reconciled by the operator action
and driven to the end, like an operator would.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState
from runtime_svc.kernel.reconcile import Resolution
from runtime_svc.kernel.store_reconcile import reconcile_quarantine
from runtime_svc.schema import flow_runs
from services import db
from tests.cluster.conftest import Cluster, ClusterDb
from tests.cluster.replicas import running_replicas
from tests.cluster.support import nodes
from tests.integration.worker.support import TERMINAL, run_records, seed, start_run, view_file
from tests.support.invariants import TerminalAttempts, check_exactly_once

SEED = 20261201
RUNS = 300
KILLED = 2
#: Child timings: short leases and backoffs so a dead node's work is recovered in seconds.
CHILD_ENV = {
    "FLOW_RUNTIME_WORKERS": "2",
    "FLOW_RUNTIME_SWEEPS": "true",
    "FLOW_RUNTIME_LEASE_MS": "3000",
    "FLOW_RUNTIME_RETRY_BASE_MS": "50",
    "FLOW_RUNTIME_RETRY_MAX_MS": "500",
    "FLOW_RUNTIME_MAX_ATTEMPTS": "20",
    "FLOW_RUNTIME_IDLE_MS": "100",
    "FLOW_RUNTIME_SWEEP_MS": "300",
    "FLOW_DB_POOL_SIZE": "6",
}
_DEADLINE_S = 420.0


async def _states(engine: AsyncEngine, org: str) -> dict[str, int]:
    t = flow_runs.c
    stmt = select(t.runtime_state, func.count()).where(t.org_id == org).group_by(t.runtime_state)
    async with db.transaction(engine, readonly=True) as conn:
        return {str(k): int(v) for k, v in (await conn.execute(stmt)).all()}


async def _wait(
    engine: AsyncEngine, org: str, done: int, deadline: float, replicas_alive: object
) -> dict[str, int]:
    """Poll until at least ``done`` runs are terminal (bounded by ``deadline``)."""
    terminal_codes = {s.code for s in TERMINAL}
    while True:
        states = await _states(engine, org)
        if sum(n for code, n in states.items() if code in terminal_codes) >= done:
            return states
        assert time.monotonic() < deadline, f"soak stalled: {states}"
        assert callable(replicas_alive) and replicas_alive(), "a runtime process exited"
        await asyncio.sleep(0.5)


@pytest.mark.timeout(600)
async def test_soak_three_runtime_processes_over_three_nodes_with_one_node_lost(
    galera: Cluster, cluster_db: ClusterDb, engines: list[AsyncEngine], tmp_path: Path
) -> None:
    galera.require_node_control()
    rng = random.Random(SEED)
    n = nodes(engines)
    seeded = await seed(engines[0], mutations=2, pure_step=False)
    org = seeded.org
    # Runs accepted through all three nodes, in a seeded order.
    order = [rng.randrange(3) for _ in range(RUNS)]
    run_ids: list[str] = []
    for start in range(0, RUNS, 30):
        batch = await asyncio.gather(
            *(
                start_run(n[order[i]].store, seeded, label=f"r{i}")
                for i in range(start, min(start + 30, RUNS))
            )
        )
        run_ids.extend(r.flow_run_id for r in batch)

    terminal = TerminalAttempts()
    deadline = time.monotonic() + _DEADLINE_S
    with running_replicas(tmp_path) as replicas:
        extra = {**CHILD_ENV, "FLOW_RUNTIME_VIEW_FILE": view_file(tmp_path)}
        for node in range(3):
            replicas.start_runtime(cluster_db.url(node), extra)
        for replica in replicas.runtimes:
            replica.wait_serving()

        def alive() -> bool:
            return all(r.proc is not None and r.proc.poll() is None for r in replicas.runtimes)

        await _wait(engines[0], org, RUNS // 3, deadline, alive)
        await terminal.snapshot(engines[0], org)
        await galera.kill(KILLED)  # the third process's node, mid-soak
        await _wait(engines[0], org, RUNS // 2, deadline, alive)
        await galera.restart(KILLED)
        await terminal.snapshot(engines[1], org)
        states = await _wait(engines[1], org, RUNS, deadline, alive)

        # An ambiguity the dying connection left is the operator's: reconcile and finish.
        quarantined = [
            r for r in run_ids if (await n[1].store.get_run(org, r)).state is RunState.QUARANTINED
        ]
        for run_id in quarantined:
            await reconcile_quarantine(
                engines[1],
                org,
                run_id,
                Resolution.RETRY,
                operator="soak",
                reason="node-loss",
                max_attempts=int(CHILD_ENV["FLOW_RUNTIME_MAX_ATTEMPTS"]),
            )
        if quarantined:
            await _wait(engines[1], org, RUNS, deadline, alive)
    summary = await check_exactly_once(engines[1], org, expected_runs=run_ids, terminal=terminal)
    assert summary.states() == {RunState.SUCCEEDED: RUNS}, (states, quarantined)
    records = await run_records(engines[2], org)
    assert len(records) == RUNS
    assert {r["record_version"] for r in records} == {2}
