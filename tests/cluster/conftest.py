"""Fixtures of the cluster tests: one 3-node MariaDB Galera cluster per test session.

* ``galera`` (session) — the cluster: started here on loopback (``tests/cluster/galera.py``,
  ~10-20 s) unless ``FLOW_TEST_CLUSTER_URLS`` names the server URLs of an existing
  MySQL-protocol cluster (comma-separated, one per node, e.g. three TiDB servers or
  three Galera nodes behind no proxy). Without the Galera packages the tests are skipped
  locally and **fail under ``CI=true``**, like the MariaDB suite (``tests/conftest.py``).
* ``cluster_db`` — a fresh, uniquely named database on the cluster (created through one
  node, visible on all), migrated to the runtime schema, dropped after the test;
  ``cluster_db.url(i)`` is its URL on node ``i``.
* Every test starts with every node up: a node a previous test killed is restarted
  first, so a failing node-loss test cannot poison the rest of the session.

Node-loss tests need the local harness (they SIGKILL ``mariadbd``); against an external
cluster they are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pymysql
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db, migrate
from tests.cluster.galera import GaleraCluster, missing_requirements

CLUSTER_URLS_ENV = "FLOW_TEST_CLUSTER_URLS"
KEEP_DIR_ENV = "FLOW_TEST_CLUSTER_KEEP"
_CLUSTER_TEST_TIMEOUT_S = 300
#: Starting three nodes is retried once (e.g. a free port taken between pick and bind).
_START_ATTEMPTS = 2


def _fail_or_skip(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: the cluster suite may not be skipped)")
    pytest.skip(message)


def connect(url: str) -> pymysql.connections.Connection:  # type: ignore[type-arg]
    """An autocommit pymysql connection to the server (and database, if any) of ``url``."""
    parsed = make_url(url)
    return pymysql.connect(
        host=parsed.host or "127.0.0.1",
        port=parsed.port or 3306,
        user=parsed.username or "root",
        password=parsed.password or "",
        database=parsed.database,
        charset="utf8mb4",
        autocommit=True,
        connect_timeout=5,
    )


@dataclass
class Cluster:
    """The cluster under test: server URLs (no database) and, when this session started
    it, the harness that can kill and restart nodes."""

    server_urls: list[str]
    harness: GaleraCluster | None

    @property
    def size(self) -> int:
        return len(self.server_urls)

    def require_node_control(self) -> GaleraCluster:
        """The local harness, or skip: an external cluster's nodes are not ours to kill."""
        if self.harness is None:
            _fail_or_skip(f"node-loss tests need the local Galera harness, not {CLUSTER_URLS_ENV}")
        assert self.harness is not None
        return self.harness

    async def kill(self, index: int) -> None:
        """SIGKILL node ``index`` and wait until the others evicted it."""
        harness = self.require_node_control()
        await asyncio.to_thread(harness.kill, index)
        await asyncio.to_thread(harness.wait_size, self.size - 1)

    async def restart(self, index: int) -> None:
        """Start node ``index`` again and wait until it is Synced."""
        await asyncio.to_thread(self.require_node_control().restart, index)

    def admin(self, index: int | None = None) -> pymysql.connections.Connection:  # type: ignore[type-arg]
        """An autocommit admin connection to node ``index`` (default: the first live one)."""
        indices = range(self.size) if index is None else [index]
        last: Exception | None = None
        for i in indices:
            if self.harness is not None and not self.harness.nodes[i].alive():
                continue
            try:
                return connect(self.server_urls[i])
            except pymysql.err.MySQLError as exc:
                last = exc
        raise RuntimeError(f"no cluster node answers: {last!r}")


@pytest.fixture(scope="session")
def galera() -> Iterator[Cluster]:
    external = [u.strip() for u in os.environ.get(CLUSTER_URLS_ENV, "").split(",") if u.strip()]
    if external:
        yield Cluster(external, None)
        return
    reason = missing_requirements()
    if reason:
        _fail_or_skip(f"no Galera cluster for the cluster tests: {reason}")
    # Not pytest's tmp_path: its parents are private to root, and the rsync state
    # transfer daemon (running as nobody) must reach the data dirs.
    for attempt in range(1, _START_ATTEMPTS + 1):
        base = Path(tempfile.mkdtemp(prefix="nfr-galera-"))
        harness = GaleraCluster(base)
        try:
            harness.start()
            break
        except Exception:
            harness.stop()
            if attempt == _START_ATTEMPTS:
                raise
            shutil.rmtree(base, ignore_errors=True)
    try:
        yield Cluster(harness.server_urls(), harness)
    finally:
        harness.stop()
        if not os.environ.get(KEEP_DIR_ENV):
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def _all_nodes_up(galera: Cluster) -> None:
    """Restart any node an earlier test left dead (a failed node-loss test)."""
    harness = galera.harness
    if harness is None:
        return
    for node in harness.nodes:
        if not node.alive():
            harness.restart(node.index)


@dataclass(frozen=True)
class ClusterDb:
    """One test database on the cluster."""

    cluster: Cluster
    name: str

    def url(self, node: int) -> str:
        """The database's ``mysql+asyncmy`` URL on node ``node``."""
        server = make_url(self.cluster.server_urls[node])
        return server.set(database=self.name, query={"charset": "utf8mb4"}).render_as_string(
            hide_password=False
        )

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(self.cluster.size)]


@contextlib.contextmanager
def new_database(
    galera: Cluster, service_pkg: str, *, migrate_through: int = 0
) -> Iterator[ClusterDb]:
    """A new database on the cluster, migrated for ``service_pkg`` through node
    ``migrate_through`` (DDL replicates in total order), dropped afterwards."""
    name = f"flow_cl_{uuid.uuid4().hex[:16]}"
    # Created on the node that migrates: the other nodes apply the replicated DDL
    # asynchronously, so a connection to another node right after could miss it.
    admin = galera.admin(migrate_through)
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    finally:
        admin.close()
    database = ClusterDb(galera, name)
    try:
        asyncio.run(migrate.upgrade(database.url(migrate_through), service_pkg))
        yield database
    finally:
        with contextlib.suppress(Exception):
            admin = galera.admin()
            try:
                with admin.cursor() as cursor:
                    cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            finally:
                admin.close()


@pytest.fixture
def cluster_db(galera: Cluster) -> Iterator[ClusterDb]:
    """A new runtime database (migrated through node 0), dropped after the test."""
    with new_database(galera, "runtime_svc") as database:
        yield database


@pytest.fixture
async def engines(cluster_db: ClusterDb) -> AsyncIterator[list[AsyncEngine]]:
    """One engine per node on the test database."""
    made = [db.create_engine(url, pool_size=6) for url in cluster_db.urls]
    try:
        yield made
    finally:
        for engine in made:
            await engine.dispose()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under ``tests/cluster`` carries the ``cluster`` marker (``-m "not
    cluster"`` deselects the suite)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)
            if item.get_closest_marker("timeout") is None:
                # The first test also pays for starting the cluster, and node restarts
                # are full state transfers: more than the suite's default per-test bound.
                item.add_marker(pytest.mark.timeout(_CLUSTER_TEST_TIMEOUT_S))
