"""A migrated service database shared by one test module, on SQLite or MariaDB.

Tests sharing it isolate themselves by org (every row carries ``org_id``); the MariaDB
case follows ``tests/conftest.py`` (skipped locally without ``FLOW_TEST_MYSQL_URL``,
failed under ``CI=true``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pymysql
import pytest
from sqlalchemy.engine import make_url

from services import migrate

__all__ = ["migrated_database", "new_org"]


def new_org(prefix: str = "org") -> str:
    """A fresh org id: the unit of isolation inside a shared database."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@contextmanager
def migrated_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, service_pkg: str
) -> Iterator[str]:
    """Yield the URL of a database migrated to ``service_pkg``'s head.

    ``request.param`` is ``"sqlite"`` or ``"mariadb"``.
    """
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp(service_pkg) / 'test.db'}"
        asyncio.run(migrate.upgrade(url, service_pkg))
        yield url
        return
    server_url: str = request.getfixturevalue("mariadb_server_url")
    server = make_url(server_url)
    name = f"flow_{service_pkg[:8]}_{uuid.uuid4().hex[:12]}"
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
        rendered = server.set(database=name, query={"charset": "utf8mb4"}).render_as_string(
            hide_password=False
        )
        asyncio.run(migrate.upgrade(rendered, service_pkg))
        yield rendered
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()
