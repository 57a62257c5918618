"""Fixtures of the catalog API tests: one migrated database and one running catalog
server per test module and backend (``sqlite``, ``mariadb``), and a client per test.

Module scope keeps the suite fast; isolation comes from every test creating its own
org(s) (``harness.new_id``), which is also what the catalog's key discipline guarantees.
The MariaDB case follows ``tests/conftest.py``: skipped locally without
``FLOW_TEST_MYSQL_URL``, failed under ``CI=true``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.integration.catalog.harness import CatalogServer, Client, running_catalog
from tests.support.databases import BACKENDS, mariadb_database


@pytest.fixture(scope="module", **BACKENDS)
def catalog_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A fresh database per module and backend, dropped afterwards (the catalog harness
    migrates it)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('catalog-db') / 'catalog.db'}"
        return
    with mariadb_database(request.getfixturevalue("mariadb_server_url"), "flow_catalog") as url:
        yield url


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
