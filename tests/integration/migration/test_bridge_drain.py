"""The drain gate and the start guard (§20.3 3; §22.8 V22.8-07 "authoritative fleet and
active-transaction evidence proves zero pre-bridge writers before
FlowInterviewWriteProtocolGeneration=1", V22.8-08 "a pre-bridge binary cannot restart
after the write-protocol gate").

The pre-bridge application and a pre-bridge build of the runtime itself run as real child
processes against the test database.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pymysql
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel.states import CompatibilityStatus
from runtime_svc.legacy.admission import admit_legacy_txn
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import bridge, fleet
from runtime_svc.migration.control import Phase
from runtime_svc.migration.protocol import BinaryRefusedError
from runtime_svc.schema_bridge import flow_interview_writers, flow_interviews
from services import db, migrate
from tests.integration.migration.bridge_support import Issuer, through_org_schema_gate
from tests.integration.migration.conftest import new_scope, register_flow
from tests.integration.migration.flows import pure_flow, write_flow
from tests.integration.worker.support import view_file
from tests.support.prebridge import old_insert
from tests.support.procs import ROOT, ServiceProcess, assert_eventually, free_port, service_env

_PREBRIDGE = fleet.WriterRegistration("old-1", "0.1.0", 0, "legacy", "old-host")


async def _count(engine: AsyncEngine, table: object) -> int:
    async with db.transaction(engine, readonly=True) as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(table))).scalar_one()  # type: ignore[arg-type]
        )


async def test_the_drain_gate_demands_zero_live_pre_bridge_writers(
    fresh_engine: AsyncEngine,
) -> None:
    await bridge.bridge_begin(fresh_engine)
    await fleet.register_writer(fresh_engine, _PREBRIDGE)
    await fleet.register_writer(
        fresh_engine, fleet.WriterRegistration("new-1", "0.2.0", 1, "c1", "new-host")
    )
    await bridge.drain_begin(fresh_engine)

    with pytest.raises(bridge.GateRefusedError) as refused:
        await bridge.drain_verify(fresh_engine, settle_s=0)
    assert refused.value.reasons == ("pre_bridge_writers_live",)
    assert [w["process_id"] for w in refused.value.evidence["live_pre_bridge_writers"]] == ["old-1"]

    await fleet.stop_writer(fresh_engine, "old-1")  # the rollout stopped the old pod
    control = await bridge.drain_verify(fresh_engine, settle_s=0)

    assert control.phase is Phase.DRAINED and control.drained_at is not None
    evidence = control.drain_evidence or {}
    assert evidence["live_pre_bridge_writers"] == []
    assert evidence["open_transactions_before_drain"] == 0
    assert evidence["prebridge_writes_since_drain"] == 0
    assert evidence["bridge_writers"] == 1
    assert evidence["transaction_evidence_kind"] in ("innodb_trx", "sqlite_write_lock")


async def test_a_pre_bridge_write_after_the_drain_started_refuses_the_gate(
    fresh_engine: AsyncEngine,
) -> None:
    await bridge.bridge_begin(fresh_engine)
    await bridge.drain_begin(fresh_engine)
    await asyncio.sleep(0.01)
    await old_insert(fresh_engine, flow="straggler", position="a")  # a writer nobody saw

    with pytest.raises(bridge.GateRefusedError) as refused:
        await bridge.drain_verify(fresh_engine, settle_s=0)
    assert refused.value.reasons == ("pre_bridge_writes_after_drain_start",)

    await bridge.drain_begin(fresh_engine, restart=True)  # the straggler is gone now
    assert (await bridge.drain_verify(fresh_engine, settle_s=0)).phase is Phase.DRAINED


async def test_a_pre_bridge_binary_cannot_register_once_the_drain_started(
    fresh_engine: AsyncEngine,
) -> None:
    await bridge.bridge_begin(fresh_engine)
    await fleet.register_writer(fresh_engine, _PREBRIDGE)  # allowed in the additive window
    await bridge.drain_begin(fresh_engine)

    with pytest.raises(BinaryRefusedError, match="pre_bridge_binary_after_drain"):
        await fleet.register_writer(
            fresh_engine, fleet.WriterRegistration("old-2", "0.1.0", 0, "legacy", "h")
        )
    # Bridge binaries still start.
    await fleet.register_writer(
        fresh_engine, fleet.WriterRegistration("new-2", "0.2.0", 1, "c1", "h")
    )
    assert await _count(fresh_engine, flow_interview_writers) == 2


@pytest.mark.mariadb
async def test_an_open_pre_bridge_transaction_refuses_the_drain_gate(
    mariadb_url: str,
) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    engine = db.create_engine(mariadb_url)
    url = make_url(mariadb_url)
    old = pymysql.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 3306,
        user=url.username or "root",
        password=url.password or "",
        database=url.database,
        autocommit=False,
    )
    try:
        await bridge.bridge_begin(engine)
        with old.cursor() as cursor:  # an old binary's write transaction, not committed
            cursor.execute(
                "INSERT INTO flow_interviews (interview_id, flow_api_name, "
                "flow_version_number, interview_status, context_payload, created_at, "
                "updated_at) VALUES ('int-open', 'f', 1, 'Paused', '{}', "
                "UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
            )
        await asyncio.sleep(1.1)  # the transaction is older than the drain start
        await bridge.drain_begin(engine)
        await asyncio.sleep(bridge.DRAIN_SETTLE_S + 0.1)

        with pytest.raises(bridge.GateRefusedError) as refused:
            await bridge.drain_verify(engine)
        assert "transactions_open_since_before_drain" in refused.value.reasons
        assert refused.value.evidence["open_transactions_before_drain"] == 1

        old.rollback()  # the old transaction ends (here: rolled back by the drain)
        await asyncio.sleep(0.3)  # the server's transaction view refreshes every 0.1 s
        control = await bridge.drain_verify(engine)
        assert control.phase is Phase.DRAINED
        assert (control.drain_evidence or {})["transaction_evidence_kind"] == "innodb_trx"
    finally:
        old.close()
        await engine.dispose()


# --- real processes --------------------------------------------------------------------


def _prebridge_app(db_url: str, count: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.prebridge", db_url, str(count)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _runtime(tmp: Path, db_url: str, *, generation: int) -> ServiceProcess:
    """The runtime service binary; ``generation`` 0 builds it as a pre-bridge binary."""
    port = free_port()
    env = service_env(
        tmp,
        "runtime",
        port,
        db_url=db_url,
        extra={"FLOW_RUNTIME_WORKERS": "0", "FLOW_CATALOG_PORT": str(free_port())},
    )
    proc = ServiceProcess("runtime", port, env, tmp / f"runtime-g{generation}.log")
    if generation == 1:
        return proc.start()
    code = (
        "import sys, runtime_svc.migration.protocol as p; "
        f"p.BINARY_WRITE_PROTOCOL_GENERATION = {generation}; "
        "import runtime_svc.__main__ as m; sys.argv = ['runtime_svc', 'serve']; "
        "sys.exit(m.main())"
    )
    log = open(proc.log_path, "ab")  # noqa: SIM115 - closed by ServiceProcess._close
    proc._log = log
    proc.proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    return proc


@pytest.mark.e2e
async def test_a_pre_bridge_binary_cannot_restart_after_the_gate(
    db_url: str, tmp_path: Path
) -> None:
    await migrate.upgrade(db_url, "runtime_svc")
    engine = db.create_engine(db_url)
    try:
        await bridge.bridge_begin(engine)
        first = await asyncio.to_thread(_prebridge_app, db_url, 1)
        assert first.returncode == 0, first.stderr
        old_runtime = _runtime(tmp_path, db_url, generation=0)
        try:
            await asyncio.to_thread(old_runtime.wait_serving)  # pre-bridge runtime: serves
        finally:
            old_runtime.terminate()

        issuer, scope = Issuer.new(), new_scope()
        await register_flow(engine, scope.org_id, pure_flow("prebridge_app"))
        await through_org_schema_gate(engine, issuer, scope)
        await bridge.enable_write_protocol(engine)

        again = await asyncio.to_thread(_prebridge_app, db_url, 1)
        assert again.returncode == 3, again.stdout + again.stderr
        assert "binary_older_than_write_protocol" in again.stderr
        assert await _count(engine, flow_interviews) == 1  # it wrote nothing
        restarted = _runtime(tmp_path, db_url, generation=0)
        code = await asyncio.to_thread(restarted.wait_exit, 120)
        restarted.kill()
        assert code == 3, restarted.log_text()[-2000:]
        assert "refusing to start" in restarted.log_text()
        bridge_runtime = _runtime(tmp_path, db_url, generation=1)
        try:
            await asyncio.to_thread(bridge_runtime.wait_serving)  # the bridge binary serves
        finally:
            bridge_runtime.terminate()
    finally:
        await engine.dispose()


@pytest.mark.e2e
async def test_the_runtime_process_registers_and_its_legacy_scheduler_drains_due_interviews(
    db_url: str, tmp_path: Path
) -> None:
    await migrate.upgrade(db_url, "runtime_svc")
    engine = db.create_engine(db_url)
    scope = new_scope()
    store = LegacyInterviewStore(engine)
    try:
        version = await register_flow(engine, scope.org_id, write_flow("scheduled_write"))
        async with db.transaction(engine) as conn:
            interview, claim, _ = await admit_legacy_txn(
                conn, scope, version, {"label": "Scheduled"}, store=store
            )
        assert claim is None and interview.status is CompatibilityStatus.PAUSED  # due now

        port = free_port()
        env = service_env(
            tmp_path,
            "runtime",
            port,
            db_url=db_url,
            extra={
                "FLOW_RUNTIME_WORKERS": "0",
                "FLOW_RUNTIME_IDLE_MS": "50",
                "FLOW_RUNTIME_VIEW_FILE": view_file(tmp_path),
                "FLOW_CATALOG_PORT": str(free_port()),
            },
        )
        runtime = ServiceProcess("runtime", port, env, tmp_path / "runtime.log").start()
        try:
            await asyncio.to_thread(runtime.wait_serving)

            async def finished() -> bool:
                got = await store.get(scope.org_id, interview.flow_run_id)
                return got.status is CompatibilityStatus.FINISHED

            await assert_eventually(finished, timeout=60, what="legacy interview finished")
            async with db.transaction(engine, readonly=True) as conn:
                live = await fleet.live_writers_txn(conn, await db.db_now(conn))
            assert [w["write_protocol_generation"] for w in live] == [1]
        finally:
            assert runtime.terminate() == 0
        async with db.transaction(engine, readonly=True) as conn:  # stopped on shutdown
            assert await fleet.live_writers_txn(conn, await db.db_now(conn)) == []
    finally:
        await engine.dispose()
