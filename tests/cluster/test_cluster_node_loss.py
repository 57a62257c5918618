"""A worker's database node SIGKILLed mid-transaction and mid-COMMIT (§22.2 "process
death …", §22.3 "commit response is lost" / "connection is severed during commit", on a
real distributed engine).

The worker reaches the cluster through a load balancer (``tests/cluster/proxy.py``, the
HAProxy of a deployment): when its node dies, its next connection lands on a live node.
What the worker does then is the single-server protocol, now spanning nodes:

* killed **mid-transaction** — the connection dies before COMMIT: the transaction cannot
  have committed anywhere; the worker records ``RollbackUnknown`` and quarantines
  through another node;
* killed **during COMMIT, before the node committed** — ``CommitUnknown``, quarantined;
* killed **during COMMIT, after the node committed** — the write-set was certified, so
  every node has it: the worker's marker read through another node (a causal read)
  finds its own commit and reports ``already committed``: no quarantine, no retry.

A quarantine is then reconciled by the operator action (``runtime_svc.kernel.store_reconcile``,
``python -m runtime_svc.ops``) through a third node, and the run finishes with every
business effect exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import AttemptOutcome, FlowRunStateStore, LeaseFence, RunState
from runtime_svc.kernel.reconcile import Resolution
from runtime_svc.kernel.store_reconcile import inspect_quarantine, reconcile_quarantine
from runtime_svc.worker import Outcome, StepWorker
from services import db
from tests.cluster.conftest import Cluster, ClusterDb
from tests.cluster.proxy import MySqlProxy
from tests.cluster.support import CLUSTER_POLICY, nodes
from tests.integration.worker.support import drive, make_worker, seed, start_run, step_counts

KILLED = 0  # the worker's node


@dataclass
class Balanced:
    """A worker store and engine behind the load balancer (node 1 first)."""

    proxy: MySqlProxy
    engine: AsyncEngine
    store: FlowRunStateStore


@pytest.fixture
async def balanced(galera: Cluster, cluster_db: ClusterDb) -> AsyncIterator[Balanced]:
    harness = galera.require_node_control()
    backends = []
    for url in galera.server_urls:
        parsed = make_url(url)
        backends.append((parsed.host or "127.0.0.1", parsed.port or 3306))
    proxy = await MySqlProxy(backends).start()
    url = make_url(cluster_db.url(0)).set(port=proxy.port).render_as_string(hide_password=False)
    engine = db.create_engine(url, pool_size=4)
    try:
        yield Balanced(proxy, engine, FlowRunStateStore(engine, policy=CLUSTER_POLICY))
    finally:
        await engine.dispose()
        await proxy.stop()
        if not harness.nodes[KILLED].alive():
            await galera.restart(KILLED)


def _worker(lb: Balanced, hook: object) -> StepWorker:
    # One step per batch: each proof is about this one step's lost COMMIT.
    return make_worker(
        lb.engine, lb.store, owner="w-lb", hook=hook, heartbeat=False, continuation_limit=0
    )


async def _finish_elsewhere(engines: list[AsyncEngine], org: str, run_id: str) -> None:
    """Drive the run to its end with a worker on node 2; every step committed once."""
    survivor = nodes(engines)[1]
    worker = make_worker(survivor.engine, survivor.store, owner="w-survivor")
    assert (await drive(worker, org, run_id)).state is RunState.SUCCEEDED
    for key in ("bump1", "bump2", "bump3"):
        counts = await step_counts(engines[2], org, run_id, key)
        assert (counts.committed_attempts, counts.business_events) == (1, 1), key


async def _reconcile_retry(engines: list[AsyncEngine], org: str, run_id: str) -> None:
    result = await reconcile_quarantine(
        engines[2],
        org,
        run_id,
        Resolution.RETRY,
        operator="ops@example",
        reason="node-loss-test",
        max_attempts=CLUSTER_POLICY.max_attempts,
    )
    assert result.run_state is RunState.RUNNABLE


async def test_node_killed_mid_transaction_quarantines_then_the_operator_retry_commits_once(
    galera: Cluster, engines: list[AsyncEngine], balanced: Balanced
) -> None:
    harness = galera.require_node_control()
    n = nodes(engines)
    seeded = await seed(engines[1])
    run = await start_run(n[1].store, seeded)

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn":  # business writes done, lifecycle commit next
            await asyncio.to_thread(harness.kill, KILLED)

    assert await _worker(balanced, hook).run_batch(seeded.org) == [Outcome.QUARANTINED]
    assert balanced.proxy.routed[-1] != balanced.proxy.routed[0]  # failed over

    report = await inspect_quarantine(engines[2], seeded.org, run.flow_run_id)
    assert report.attempt_outcome is AttemptOutcome.ROLLBACK_UNKNOWN
    assert report.evidence is not None and not report.evidence.shows_commit
    counts = await step_counts(engines[2], seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events) == (0, 0)

    await _reconcile_retry(engines, seeded.org, run.flow_run_id)
    await galera.restart(KILLED)
    await _finish_elsewhere(engines, seeded.org, run.flow_run_id)


@pytest.mark.parametrize(
    "node_committed", [False, True], ids=["before-the-node-committed", "after-the-node-committed"]
)
async def test_node_killed_during_commit_is_resolved_by_the_marker_never_by_a_blind_retry(
    galera: Cluster, engines: list[AsyncEngine], balanced: Balanced, node_committed: bool
) -> None:
    harness = galera.require_node_control()
    n = nodes(engines)
    seeded = await seed(engines[1])
    run = await start_run(n[1].store, seeded)

    async def kill() -> None:
        await asyncio.to_thread(harness.kill, KILLED)

    fired: list[asyncio.Event] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not fired:
            fired.append(balanced.proxy.trap_next_commit(kill, forward=node_committed))

    outcomes = await _worker(balanced, hook).run_batch(seeded.org)
    assert fired and fired[0].is_set(), (outcomes, fired)
    counts = await step_counts(engines[2], seeded.org, run.flow_run_id, "bump1")
    view = await n[2].store.support_view(seeded.org, run.flow_run_id)
    if node_committed:
        # The marker, read through a live node, shows the worker's own commit.
        assert outcomes == [Outcome.ALREADY_COMMITTED]
        assert (counts.committed_attempts, counts.business_events) == (1, 1)
        assert view.run.state is RunState.RUNNABLE  # advanced to the next step
    else:
        assert outcomes == [Outcome.QUARANTINED]
        assert (counts.committed_attempts, counts.business_events) == (0, 0)
        assert view.run.state is RunState.QUARANTINED
        assert [a.outcome for a in view.attempts] == [AttemptOutcome.COMMIT_UNKNOWN]
        await _reconcile_retry(engines, seeded.org, run.flow_run_id)
    await galera.restart(KILLED)
    await _finish_elsewhere(engines, seeded.org, run.flow_run_id)
