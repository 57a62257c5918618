"""Runtime replicas as processes on different nodes of one cluster (catalog on a third):
after-save trigger idempotency with the same mutation replayed through another replica
and node, sequentially and concurrently, and read-your-writes across replicas.

A replay is found by the mutation's outcome marker (the business event keyed by org,
RPC and request id) and returns the run its first application started. Sent to two
nodes at once, both transactions insert that marker; Galera certifies the unique key,
the second COMMIT fails (1213, a proven rollback), the record service retries it whole
and finds the first one's marker: one record, one run, two identical answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cluster.conftest import Cluster, ClusterDb, new_database
from tests.cluster.replicas import Replicas, running_replicas
from tests.cluster.support import count_sync
from tests.integration.definitions.harness import new_request_id
from tests.integration.triggers.test_triggers_after_save_grpc import _create, _run_ids, _tenant


@pytest.fixture
def replicas(galera: Cluster, cluster_db: ClusterDb, tmp_path: Path) -> Iterator[Replicas]:
    with (
        new_database(galera, "catalog_svc", migrate_through=2) as catalog_db,
        running_replicas(tmp_path) as started,
    ):
        started.start_catalog(catalog_db.url(2))
        for node in (0, 1):
            started.start_runtime(
                cluster_db.url(node),
                {"FLOW_RUNTIME_WORKERS": "0", "FLOW_RUNTIME_SWEEPS": "false"},
            )
        for replica in started.runtimes:
            replica.wait_serving()
        yield started


def test_an_after_save_mutation_replayed_through_another_node_starts_one_run(
    replicas: Replicas, cluster_db: ClusterDb
) -> None:
    a, b = (replicas.run_client(r) for r in replicas.runtimes)
    catalog = replicas.catalog_client()
    try:
        pub = _tenant(catalog, a)  # compiled and activated through replica A (node 1)
        org = pub.scope[0]
        request_id = new_request_id()
        first = _create(a, pub, request_id=request_id, Email="ada@example.com")
        (run_id,) = first.triggered_flow_run_ids

        # The client lost A's answer and retries through replica B on node 2.
        replay = _create(b, pub, request_id=request_id, Email="ada@example.com")
        assert list(replay.triggered_flow_run_ids) == [run_id]
        assert replay.record.record_id == first.record.record_id
        assert replay.record.version == first.record.version == 1
        # Read-your-writes across replicas: B lists the run A started.
        assert _run_ids(b, pub) == [run_id]

        # The same new mutation sent to both replicas at once.
        again = new_request_id()
        with ThreadPoolExecutor(max_workers=2) as pool:
            answers = list(
                pool.map(
                    lambda client: _create(
                        client, pub, request_id=again, Email="grace@example.com"
                    ),
                    (a, b),
                )
            )
        assert answers[0].record.record_id == answers[1].record.record_id
        assert list(answers[0].triggered_flow_run_ids) == list(answers[1].triggered_flow_run_ids)
        (second_run,) = answers[0].triggered_flow_run_ids
        assert _run_ids(a, pub) == sorted([run_id, second_run])

        for node in range(3):
            url = cluster_db.url(node)
            assert count_sync(url, "SELECT COUNT(*) FROM flow_runs WHERE org_id = %s", org) == 2
            assert count_sync(url, "SELECT COUNT(*) FROM records WHERE org_id = %s", org) == 2
            events = "SELECT COUNT(*) FROM business_events WHERE org_id = %s"
            assert count_sync(url, events, org) == 2
    finally:
        for client in (a, b):
            client.channel.close()
        catalog.channel.close()
