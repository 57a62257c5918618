"""Fixtures of the FlowRunService integration tests: one migrated runtime database per
module and backend (``sqlite``, ``mariadb``; the definitions tests' fixture) and the
servers of :mod:`.harness` over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.definitions.conftest import module_db_url
from tests.integration.runs.harness import RunClient, RunServers

__all__ = ["module_db_url"]


@pytest.fixture(scope="module")
def servers(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunServers]:
    running = RunServers(module_db_url, Path(tmp_path_factory.mktemp("data"))).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(servers: RunServers) -> Iterator[RunClient]:
    c = servers.run_client()
    try:
        yield c
    finally:
        c.channel.close()
