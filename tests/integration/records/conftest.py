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

import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from tests.integration.records.harness import Clients, RecordServers
from tests.support.databases import BACKENDS, module_database


@pytest.fixture(scope="module", **BACKENDS)
def records_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated runtime database shared by one test module, on each backend."""
    yield from module_database(request, tmp_path_factory, prefix="records")


@pytest.fixture(scope="module")
def mariadb_records_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated runtime database on MariaDB shared by one test module."""
    yield from module_database(request, tmp_path_factory, prefix="records", backend="mariadb")


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
    backend = "sqlite" if records_db_url.startswith("sqlite") else "mariadb"
    for catalog_url in module_database(
        request, tmp_path_factory, prefix="records_cat", service_pkg="catalog_svc", backend=backend
    ):
        servers = RecordServers(records_db_url, catalog_url, tmp_path_factory.mktemp("data"))
        servers.start()
        try:
            yield servers
        finally:
            servers.stop()


@pytest.fixture(scope="module")
def clients(record_servers: RecordServers) -> Iterator[Clients]:
    runtime = grpc.insecure_channel(f"127.0.0.1:{record_servers.runtime_port}")
    catalog = grpc.insecure_channel(f"127.0.0.1:{record_servers.catalog_port}")
    try:
        yield Clients(runtime, catalog, record_servers.private_key)
    finally:
        runtime.close()
        catalog.close()
