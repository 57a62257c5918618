"""Test databases: a uniquely named MariaDB database (created, then dropped) and the
migrated per-module database every integration package shares between its tests, on each
backend (``sqlite``, ``mariadb``). One implementation for every ``conftest.py``; the
MariaDB server comes from ``FLOW_TEST_MYSQL_URL`` (``tests/conftest.py``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db, migrate

__all__ = [
    "BACKENDS",
    "StatementWatch",
    "admin_connection",
    "commits_sent",
    "driver_engine",
    "mariadb_database",
    "module_database",
]

#: ``params``/``ids`` of a fixture parametrized over the two backends.
BACKENDS = {
    "params": ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)],
    "ids": ["sqlite", "mariadb"],
}


def admin_connection(server_url: str) -> pymysql.connections.Connection:  # type: ignore[type-arg]
    """An autocommit PyMySQL connection to the server of ``server_url`` (any database)."""
    server = make_url(server_url)
    return pymysql.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 3306,
        user=server.username or "root",
        password=server.password or "",
        charset="utf8mb4",
        autocommit=True,
    )


async def commits_sent(engine: AsyncEngine) -> int:
    """``COMMIT`` s the pooled connection's reset-aware adapter sent on their own so far
    (one carried by a transaction's last writes is not counted: ADR 0013/0014)."""
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        commits: int = raw.dbapi_connection.commits  # type: ignore[union-attr]
        return commits


class StatementWatch:
    """The SQL of every cursor execution on ``engine`` while in use (a batched round
    trip is one entry)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.sync = engine.sync_engine
        self.sql: list[str] = []

    def _before(self, _c: Any, _cur: Any, sql: str, *_: Any) -> None:
        self.sql.append(sql)

    def __enter__(self) -> StatementWatch:
        sa.event.listen(self.sync, "before_cursor_execute", self._before)
        return self

    def __exit__(self, *_: object) -> None:
        sa.event.remove(self.sync, "before_cursor_execute", self._before)


async def status_counters(conn: AsyncConnection, scope: str = "SESSION") -> dict[str, int]:
    """MariaDB's numeric status counters (``SHOW SESSION STATUS`` or, with ``scope`` =
    ``"GLOBAL"``, the server's), e.g. ``Created_tmp_disk_tables``, ``Handler_read_next``."""
    if scope not in ("SESSION", "GLOBAL"):
        raise ValueError(scope)
    rows = await conn.execute(sa.text(f"SHOW {scope} STATUS"))
    return {str(k): int(v) for k, v in rows if str(v).isdigit()}


def kill_session(server_url: str, session: int) -> None:
    """``KILL CONNECTION`` the server session ``session`` (its ``CONNECTION_ID()``), as a
    server restart or a proxy would drop it."""
    admin = admin_connection(server_url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"KILL CONNECTION {session}")
    finally:
        admin.close()


@asynccontextmanager
async def tables_engine(
    url: str | URL, metadata: sa.MetaData, *, pool_size: int
) -> AsyncIterator[AsyncEngine]:
    """An engine on ``url`` with ``metadata``'s tables created; disposed afterwards."""
    engine = db.create_engine(url, pool_size=pool_size)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        yield engine
    finally:
        await engine.dispose()


@asynccontextmanager
async def driver_engine(
    server_url: str, driver: str, metadata: sa.MetaData, *, pool_size: int
) -> AsyncIterator[AsyncEngine]:
    """An engine on ``server_url``'s database through the MySQL ``driver`` (asyncmy or
    aiomysql), with ``metadata``'s tables created; disposed afterwards."""
    url = make_url(server_url).set(drivername=f"mysql+{driver}")
    async with tables_engine(url, metadata, pool_size=pool_size) as engine:
        if engine.dialect.driver != driver:
            raise AssertionError(f"the engine runs on {engine.dialect.driver}, not {driver}")
        yield engine


@contextmanager
def mariadb_database(server_url: str, prefix: str = "flow_test") -> Iterator[str]:
    """A new, empty database on the MariaDB server (binary collation); its URL for the
    block, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    admin = admin_connection(server_url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        url = make_url(server_url).set(database=name, query={"charset": "utf8mb4"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


def module_database(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    prefix: str,
    service_pkg: str = "runtime_svc",
    backend: str | None = None,
) -> Iterator[str]:
    """A migrated database of ``service_pkg`` on ``backend`` (default: the fixture's
    ``request.param``), for a module-scoped fixture to ``yield from``."""
    chosen = backend or str(request.param)
    if chosen == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp(prefix) / 'test.db'}"
        asyncio.run(migrate.upgrade(url, service_pkg))
        yield url
        return
    server_url: str = request.getfixturevalue("mariadb_server_url")
    with mariadb_database(server_url, f"flow_{prefix}") as url:
        asyncio.run(migrate.upgrade(url, service_pkg))
        yield url
