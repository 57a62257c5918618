"""Fixtures of the after-save trigger tests: one migrated runtime database per module and
backend (``sqlite``, ``mariadb``; the definitions tests' fixture), a SQLite catalog
database, and the servers of :mod:`.harness` over them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import migrate
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.definitions.conftest import module_db_url
from tests.integration.runs.harness import RunClient
from tests.integration.triggers.harness import TriggerServers

__all__ = ["module_db_url"]


@pytest.fixture(scope="module")
def servers(
    module_db_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TriggerServers]:
    catalog_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('catalog') / 'catalog.db'}"
    asyncio.run(migrate.upgrade(catalog_url, "catalog_svc"))
    running = TriggerServers(
        module_db_url, catalog_url, Path(tmp_path_factory.mktemp("data"))
    ).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(servers: TriggerServers) -> Iterator[RunClient]:
    c = servers.run_client()
    try:
        yield c
    finally:
        c.channel.close()


@pytest.fixture(scope="module")
def catalog(servers: TriggerServers) -> Iterator[CatalogClient]:
    c = servers.catalog_client()
    try:
        yield c
    finally:
        c.channel.close()
