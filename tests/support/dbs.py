"""A migrated service database shared by one test module, on SQLite or MariaDB.

Tests sharing it isolate themselves by org (every row carries ``org_id``); the MariaDB
case follows ``tests/conftest.py`` (skipped locally without ``FLOW_TEST_MYSQL_URL``,
failed under ``CI=true``). The database itself comes from
:func:`tests.support.databases.module_database` (one implementation for every fixture).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.databases import module_database

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
    yield from module_database(
        request, tmp_path_factory, prefix=service_pkg[:8], service_pkg=service_pkg
    )
