"""Fixtures of the definitions integration tests: one migrated runtime database per module
and backend (``sqlite``, ``mariadb``), and the servers of :mod:`.harness` over it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest
from sqlalchemy.engine import make_url

from services import migrate
from tests.integration.definitions.harness import Client, Servers


def _mariadb_database(server_url: str) -> tuple[str, str]:
    server = make_url(server_url)
    name = f"flow_defs_{uuid.uuid4().hex[:16]}"
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
    finally:
        admin.close()
    url = server.set(database=name, query={"charset": "utf8mb4"})
    return url.render_as_string(hide_password=False), name


def _drop(server_url: str, name: str) -> None:
    server = make_url(server_url)
    admin = pymysql.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 3306,
        user=server.username or "root",
        password=server.password or "",
        autocommit=True,
    )
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.close()


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)],
    ids=["sqlite", "mariadb"],
)
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated runtime database shared by one test module, on each backend."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('defs') / 'runtime.db'}"
        asyncio.run(migrate.upgrade(url, "runtime_svc"))
        yield url
        return
    server_url: str = request.getfixturevalue("mariadb_server_url")
    url, name = _mariadb_database(server_url)
    try:
        asyncio.run(migrate.upgrade(url, "runtime_svc"))
        yield url
    finally:
        _drop(server_url, name)


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
