"""The cluster profile on a real 3-node Galera cluster: per-connection settings, the
start-up refusal naming the setting, the cross-node schema lock, and the Galera facts
the fencing design rests on (node-local row locks, a fence won only at COMMIT, causal
reads)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db, db_cluster, migrate
from tests.cluster.conftest import Cluster, ClusterDb
from tests.support.procs import ROOT, free_port, service_env


async def _session(engine: AsyncEngine) -> tuple[int, str, int]:
    async with db.transaction(engine, readonly=True) as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT @@session.wsrep_sync_wait, @@session.wsrep_OSU_method, "
                    "@@session.wsrep_dirty_reads"
                )
            )
        ).one()
    return int(row[0]), str(row[1]), int(row[2])


async def test_every_connection_to_a_node_gets_causal_reads_and_toi(
    engines: list[AsyncEngine],
) -> None:
    for engine in engines:
        sync_wait, osu, dirty = await _session(engine)
        assert sync_wait & db_cluster.SYNC_WAIT_READ
        assert osu == "TOI"
        assert dirty == 0
        profile = await db_cluster.check_cluster(engine)
        assert profile is not None
        assert profile.cluster_size == 3
        assert profile.provider_options.get("repl.commit_order") == "3"


async def test_check_names_the_setting_when_causal_reads_are_missing(
    cluster_db: ClusterDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a proxy that drops session SETs leaves behind: no per-connection settings.
    monkeypatch.setattr(db_cluster, "SESSION_SETTINGS", (("wsrep_sync_wait", "0"),))
    engine = db.create_engine(cluster_db.url(1))
    try:
        with pytest.raises(db_cluster.ClusterSettingsError) as caught:
            await db_cluster.check_cluster(engine)
    finally:
        await engine.dispose()
    assert [p.setting for p in caught.value.problems] == ["wsrep_sync_wait"]
    assert "wsrep_sync_wait" in str(caught.value)


def test_a_service_refuses_to_start_on_a_node_that_does_not_replicate(
    galera: Cluster, cluster_db: ClusterDb, tmp_path: Path
) -> None:
    """``wsrep_on=OFF`` on one node: its writes would never reach the others, so no fence
    taken there would hold. The runtime process exits before serving and names it."""
    galera.require_node_control()
    admin = galera.admin(2)
    try:
        with admin.cursor() as cursor:
            cursor.execute("SET GLOBAL wsrep_on = OFF")
        env = service_env(
            tmp_path,
            "runtime",
            free_port(),
            db_url=cluster_db.url(2),
            extra={"FLOW_OTEL_ENABLED": "false", "FLOW_RUNTIME_WORKERS": "0"},
        )
        proc = subprocess.run(
            [sys.executable, "-m", "runtime_svc", "serve"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    finally:
        with admin.cursor() as cursor:
            cursor.execute("SET GLOBAL wsrep_on = ON")
        admin.close()
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "refusing to start" in proc.stderr
    assert "wsrep_on" in proc.stderr


async def test_two_replicas_migrate_one_empty_database_through_two_nodes_at_once(
    galera: Cluster,
) -> None:
    """The schema lock is a row, so it holds across nodes (``GET_LOCK`` would not): two
    upgrades started together through nodes 1 and 2 both succeed and the schema is
    exactly the models."""
    name = f"flow_cl_migrate_{uuid.uuid4().hex[:12]}"
    admin = galera.admin()
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        database = ClusterDb(galera, name)
        results = await asyncio.gather(
            migrate.upgrade(database.url(0), "runtime_svc"),
            migrate.upgrade(database.url(1), "runtime_svc"),
            return_exceptions=True,
        )
        assert results == [None, None], results
        assert await migrate.verify(database.url(2), "runtime_svc") == []
        assert await migrate.current(database.url(2), "runtime_svc") == migrate.heads("runtime_svc")
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


async def test_row_locks_are_node_local_and_the_first_commit_wins(
    cluster_db: ClusterDb, engines: list[AsyncEngine]
) -> None:
    """The Galera fact behind "a fence is won only at COMMIT": two sessions on two nodes
    both lock one row and both conditional UPDATEs match it; the second COMMIT is a
    certification failure (1213) — a proven rollback that ``run_in_transaction`` retries
    whole, never a commit-unknown."""
    async with db.transaction(engines[0]) as conn:
        await conn.execute(text("CREATE TABLE fence (id INT PRIMARY KEY, v INT NOT NULL)"))
    async with db.transaction(engines[0]) as conn:
        await conn.execute(text("INSERT INTO fence VALUES (1, 0)"))

    a = await engines[0].connect()
    b = await engines[1].connect()
    try:
        await a.begin()
        await b.begin()
        for conn in (a, b):
            assert (
                await conn.execute(text("SELECT v FROM fence WHERE id = 1 FOR UPDATE"))
            ).scalar_one() == 0
            moved = await conn.execute(text("UPDATE fence SET v = v + 1 WHERE id = 1 AND v = 0"))
            assert moved.rowcount == 1  # both "won" the fence locally
        await a.commit()
        with pytest.raises(DBAPIError) as caught:
            await b.commit()
        assert db.classify_db_error(caught.value) is db.DbErrorClass.RETRYABLE_CONFLICT
    finally:
        await a.close()
        await b.close()

    # Causal reads: the first node's commit is visible on the third at once.
    async with db.transaction(engines[2], readonly=True) as conn:
        assert (await conn.execute(text("SELECT v FROM fence WHERE id = 1"))).scalar_one() == 1


async def test_a_certification_failure_at_commit_is_retried_whole_by_run_in_transaction(
    cluster_db: ClusterDb, engines: list[AsyncEngine]
) -> None:
    async with db.transaction(engines[0]) as conn:
        await conn.execute(text("CREATE TABLE counter (id INT PRIMARY KEY, v INT NOT NULL)"))
        await conn.execute(text("INSERT INTO counter VALUES (1, 0)"))
    release = asyncio.Event()
    calls = 0

    async def body(conn: AsyncConnection) -> int:
        nonlocal calls
        calls += 1
        lock = text("SELECT v FROM counter WHERE id = 1 FOR UPDATE")
        v = int((await conn.execute(lock)).scalar_one())
        await conn.execute(
            text("UPDATE counter SET v = :n WHERE id = 1 AND v = :v"), {"n": v + 1, "v": v}
        )
        if calls == 1:
            locked.set()
            await release.wait()  # hold the first attempt open until the other node commits
        return v + 1

    locked = asyncio.Event()
    first = asyncio.ensure_future(
        db.run_in_transaction(engines[0], body, backoff=db.Backoff(0.001, 0.01))
    )
    await asyncio.wait_for(locked.wait(), 30)
    async with db.transaction(engines[1]) as conn:  # node 2's row lock is its own
        # Read first, like every service transaction: the causal read waits until node 2
        # applied what node 1 committed (the table included); a write alone would not.
        await conn.execute(text("SELECT v FROM counter WHERE id = 1 FOR UPDATE"))
        await conn.execute(text("UPDATE counter SET v = v + 10 WHERE id = 1"))
    release.set()
    assert await first == 11  # the retry started over from the committed 10
    assert calls == 2
