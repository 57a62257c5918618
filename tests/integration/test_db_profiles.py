"""Database profiles against a real MariaDB: what service connections see, and refusal.

* The shared server (``FLOW_TEST_MYSQL_URL``) passes the check through a service engine,
  whose connect options set READ COMMITTED, autocommit off and the short lock wait.
* Bad *session* settings on one throwaway connection of that server are named — the
  shared server's global settings are never touched.
* A throwaway ``mariadbd`` of our own, started with unsafe *global* settings, makes a
  real ``python -m runtime_svc`` refuse to start with exit 3 and a message naming them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest
from sqlalchemy import text

from services.db import LOCK_WAIT_TIMEOUT_S, create_engine
from services.db_profiles import check_settings, read_settings, verify_database
from tests.support.procs import ROOT, free_port, service_env, wait_until

pytestmark = pytest.mark.mariadb


async def test_service_connections_of_the_shared_server_pass(mariadb_url: str) -> None:
    engine = create_engine(mariadb_url)
    try:
        settings = await verify_database(engine)
    finally:
        await engine.dispose()
    assert settings is not None
    isolation = settings.get("transaction_isolation", "tx_isolation")
    assert isolation is not None and isolation[1] == "READ-COMMITTED"
    assert settings.variables["autocommit"] == "OFF"
    assert settings.variables["innodb_lock_wait_timeout"] == str(LOCK_WAIT_TIMEOUT_S)


async def test_sqlite_needs_no_check(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        assert await verify_database(engine) is None
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    ("statement", "setting"),
    [
        ("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ", "tx_isolation"),
        ("SET SESSION autocommit = 1", "autocommit"),
        ("SET SESSION innodb_lock_wait_timeout = 3600", "innodb_lock_wait_timeout"),
        ("SET SESSION sql_mode = ''", "sql_mode"),
        ("SET SESSION TRANSACTION READ ONLY", "tx_read_only"),
    ],
)
async def test_a_bad_session_setting_is_named(
    mariadb_url: str, statement: str, setting: str
) -> None:
    engine = create_engine(mariadb_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            await conn.execute(text(statement))
            settings = await read_settings(conn)
            await conn.invalidate()  # never hand the altered session back to the pool
    finally:
        await engine.dispose()
    problems = check_settings(settings)
    names = [p.setting for p in problems]
    # MariaDB 11.1+ also knows transaction_isolation/transaction_read_only.
    aliases = {"tx_isolation": "transaction_isolation", "tx_read_only": "transaction_read_only"}
    assert names in ([setting], [aliases.get(setting, setting)]), problems


# --- a throwaway server with unsafe global settings ------------------------------------


@pytest.fixture
def unsafe_mariadb(tmp_path: Path) -> Iterator[str]:
    """A private mariadbd with statement binlogs and a non-strict SQL mode; its URL."""
    if shutil.which("mariadbd") is None and not Path("/usr/sbin/mariadbd").exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("mariadbd is not installed (CI=true: .ci/run installs mariadb-server)")
        pytest.skip("mariadbd is not installed")
    mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    data, port = tmp_path / "mdb", free_port()
    subprocess.run(
        [
            "mariadb-install-db",
            "--no-defaults",
            f"--datadir={data}",
            "--user=root",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    proc = subprocess.Popen(
        [
            mariadbd,
            "--no-defaults",
            f"--datadir={data}",
            f"--socket={tmp_path / 'mdb.sock'}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--pid-file={tmp_path / 'mdb.pid'}",
            "--user=root",
            f"--log-error={tmp_path / 'mdb.err'}",
            "--innodb-buffer-pool-size=32M",
            "--character-set-server=utf8mb4",
            # The unsafe part: statement-based binary logging and a non-strict SQL mode.
            f"--log-bin={tmp_path / 'binlog'}",
            "--binlog-format=STATEMENT",
            "--sql-mode=NO_ENGINE_SUBSTITUTION",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "mdb.err").read_text(errors="replace"))
            pymysql.connect(host="127.0.0.1", port=port, user="root", password="").close()
            return True

        wait_until(up, timeout=60, interval=0.2, what="the throwaway mariadbd")
        admin = pymysql.connect(host="127.0.0.1", port=port, user="root", autocommit=True)
        with admin.cursor() as cur:
            cur.execute("CREATE DATABASE flow CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        admin.close()
        yield f"mysql+asyncmy://root:@127.0.0.1:{port}/flow?charset=utf8mb4"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_runtime_refuses_to_start_against_unsafe_server_settings(
    tmp_path: Path, unsafe_mariadb: str
) -> None:
    env = service_env(tmp_path, "runtime", free_port(), db_url=unsafe_mariadb)
    result = subprocess.run(
        [sys.executable, "-m", "runtime_svc", "serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    err = result.stderr
    assert "refusing to start" in err
    assert "binlog_format is 'STATEMENT', needs ROW (or MIXED) while log_bin is ON" in err
    assert "sql_mode is 'NO_ENGINE_SUBSTITUTION', needs STRICT_TRANS_TABLES" in err
    assert "Traceback" not in err
    # Nothing was migrated: the check runs before the schema is touched.
    url = unsafe_mariadb.split("@", 1)[1].split("/", 1)[0]
    host, port = url.split(":")
    conn = pymysql.connect(host=host, port=int(port), user="root", database="flow")
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES")
            assert cur.fetchall() == ()
    finally:
        conn.close()
