"""Fixtures of the catalog API tests: one migrated database and one running catalog
server per test module and backend (``sqlite``, ``mariadb``), and a client per test.

Module scope keeps the suite fast; isolation comes from every test creating its own
org(s) (``harness.new_id``), which is also what the catalog's key discipline guarantees.
The MariaDB case follows ``tests/conftest.py``: skipped locally without
``FLOW_TEST_MYSQL_URL``, failed under ``CI=true``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pymysql
import pytest
from sqlalchemy.engine import make_url

from tests.integration.catalog.harness import CatalogServer, Client, running_catalog


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)],
    ids=["sqlite", "mariadb"],
)
def catalog_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A fresh database per module and backend, dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('catalog-db') / 'catalog.db'}"
        return
    server = make_url(request.getfixturevalue("mariadb_server_url"))
    name = f"flow_catalog_{uuid.uuid4().hex[:16]}"
    admin = pymysql.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 3306,
        user=server.username or "root",
        password=server.password or "",
        charset="utf8mb4",
        autocommit=True,
    )
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        yield server.set(database=name, query={"charset": "utf8mb4"}).render_as_string(
            hide_password=False
        )
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.close()


@pytest.fixture(scope="module")
def catalog_server(
    catalog_db_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CatalogServer]:
    with running_catalog(catalog_db_url, tmp_path_factory.mktemp("catalog-data")) as server:
        yield server


@pytest.fixture
def client(catalog_server: CatalogServer) -> Iterator[Client]:
    with grpc.insecure_channel(catalog_server.target) as channel:
        yield Client(channel, catalog_server.private_key)
