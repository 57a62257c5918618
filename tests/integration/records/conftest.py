"""Fixtures of the record-engine integration tests.

* ``records_db_url`` — one migrated runtime database per test module and backend
  (``sqlite``, ``mariadb``); tests isolate themselves by working in fresh orgs.
* ``mariadb_records_db_url`` — the same, MariaDB only (lock/race tests: SQLite has one
  writer at a time, so it cannot show lock-order behaviour).
* ``engine`` / ``maria_engine`` — an async engine over it, per test (the event loop is
  per test).
* ``org`` — a fresh org id.

The MariaDB cases follow ``tests/conftest.py``: skipped locally without
``FLOW_TEST_MYSQL_URL``, failed under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pymysql
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db, migrate
from tests.integration.records.harness import Clients, RecordServers


def _admin(server_url: str) -> Any:
    server = make_url(server_url)
    return pymysql.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 3306,
        user=server.username or "root",
        password=server.password or "",
        charset="utf8mb4",
        autocommit=True,
    )


def _mariadb_db(request: pytest.FixtureRequest) -> Iterator[str]:
    server_url: str = request.getfixturevalue("mariadb_server_url")
    name = f"flow_records_{uuid.uuid4().hex[:16]}"
    admin = _admin(server_url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        url = make_url(server_url).set(database=name, query={"charset": "utf8mb4"})
        rendered = url.render_as_string(hide_password=False)
        asyncio.run(migrate.upgrade(rendered, "runtime_svc"))
        yield rendered
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)],
    ids=["sqlite", "mariadb"],
)
def records_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated runtime database shared by one test module, on each backend."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('records') / 'runtime.db'}"
        asyncio.run(migrate.upgrade(url, "runtime_svc"))
        yield url
        return
    yield from _mariadb_db(request)


@pytest.fixture(scope="module")
def mariadb_records_db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated runtime database on MariaDB shared by one test module."""
    yield from _mariadb_db(request)


@pytest.fixture
async def engine(records_db_url: str) -> AsyncIterator[AsyncEngine]:
    e = db.create_engine(records_db_url, pool_size=8)
    try:
        yield e
    finally:
        await e.dispose()


@pytest.fixture
async def maria_engine(mariadb_records_db_url: str) -> AsyncIterator[AsyncEngine]:
    e = db.create_engine(mariadb_records_db_url, pool_size=12)
    try:
        yield e
    finally:
        await e.dispose()


@pytest.fixture
def org() -> str:
    return f"org-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def record_servers(
    records_db_url: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RecordServers]:
    """The real catalog (own database, same backend) and the RecordService, per module."""
    drop: str | None = None
    if records_db_url.startswith("sqlite"):
        catalog_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('catalog') / 'catalog.db'}"
    else:
        server_url: str = request.getfixturevalue("mariadb_server_url")
        drop = f"flow_records_cat_{uuid.uuid4().hex[:12]}"
        admin = _admin(server_url)
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{drop}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        admin.close()
        url = make_url(server_url).set(database=drop, query={"charset": "utf8mb4"})
        catalog_url = url.render_as_string(hide_password=False)
    try:
        asyncio.run(migrate.upgrade(catalog_url, "catalog_svc"))
        servers = RecordServers(records_db_url, catalog_url, tmp_path_factory.mktemp("data"))
        servers.start()
        try:
            yield servers
        finally:
            servers.stop()
    finally:
        if drop is not None:
            admin = _admin(request.getfixturevalue("mariadb_server_url"))
            with admin.cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS `{drop}`")
            admin.close()


@pytest.fixture(scope="module")
def clients(record_servers: RecordServers) -> Iterator[Clients]:
    runtime = grpc.insecure_channel(f"127.0.0.1:{record_servers.runtime_port}")
    catalog = grpc.insecure_channel(f"127.0.0.1:{record_servers.catalog_port}")
    try:
        yield Clients(runtime, catalog, record_servers.private_key)
    finally:
        runtime.close()
        catalog.close()
