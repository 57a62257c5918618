"""Fixtures of the definitions integration tests: one migrated runtime database per module
and backend (``sqlite``, ``mariadb``), and the servers of :mod:`.harness` over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.definitions.harness import Client, Servers
from tests.support.databases import BACKENDS, module_database


@pytest.fixture(scope="module", **BACKENDS)
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated runtime database shared by one test module, on each backend."""
    yield from module_database(request, tmp_path_factory, prefix="defs")


@pytest.fixture(scope="module")
def servers(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers(module_db_url, Path(tmp_path_factory.mktemp("data"))).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(servers: Servers) -> Iterator[Client]:
    c = servers.client()
    try:
        yield c
    finally:
        c.channel.close()
