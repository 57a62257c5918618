"""Database fixtures shared by every test.

* ``sqlite_url`` — a fresh SQLite file per test.
* ``mariadb_server_url`` — the MariaDB server from ``FLOW_TEST_MYSQL_URL`` (e.g.
  ``mysql+asyncmy://root:@127.0.0.1:3307``); without it the test is skipped locally and
  fails under ``CI=true`` (ARCHITECTURE §6: a skipped MariaDB suite in CI is a failure).
* ``mariadb_url`` — a fresh, uniquely named database on that server per test, dropped after.
* ``db_url`` — parametrized over ``sqlite`` and ``mariadb``; the ``mariadb`` case carries the
  ``mariadb`` marker (``-m "not mariadb"`` deselects it).

Sub-directory ``conftest.py`` files add their own fixtures on top of these.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support.databases import mariadb_database

# Property tests decide on their examples, never on how fast this machine generates them:
# Hypothesis' wall-clock checks (a 200 ms deadline per example, "input generation is
# slow") fail a correct test on a loaded two-core runner. A test's own ``@settings`` still
# sets its example count.
settings.register_profile("nexus", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("nexus")

MYSQL_URL_ENV = "FLOW_TEST_MYSQL_URL"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """URL of a new SQLite database file (created on first connect)."""
    return f"sqlite+aiosqlite:///{tmp_path / 'db' / 'test.db'}"


@pytest.fixture(scope="session")
def mariadb_server_url() -> str:
    """The MariaDB server URL (no database), from ``FLOW_TEST_MYSQL_URL``."""
    url = os.environ.get(MYSQL_URL_ENV, "").strip()
    if not url:
        message = f"{MYSQL_URL_ENV} is not set: no MariaDB server for this test"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} (CI=true: the MariaDB suite may not be skipped)")
        pytest.skip(message)
    return url


@pytest.fixture
def mariadb_url(mariadb_server_url: str) -> Iterator[str]:
    """URL of a new, empty database on the MariaDB server, dropped after the test."""
    with mariadb_database(mariadb_server_url) as url:
        yield url


@pytest.fixture(
    params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)],
    ids=["sqlite", "mariadb"],
)
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh database URL on each backend: ``sqlite`` and ``mariadb``."""
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url
