"""Fixtures of the §17 identity tests: one migrated runtime database per module and
backend (``sqlite``, ``mariadb``) and a fresh engine per test (both the durable-wait
tests' fixtures), and a per-test :class:`~tests.integration.identity.support.IdentityWorld`
(a new org)."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.identity.support import IdentityWorld
from tests.integration.kernel.conftest import kernel_db_url  # noqa: F401
from tests.integration.waits.conftest import engine  # noqa: F401
from tests.integration.waits.support import new_scope


@pytest.fixture
def world(engine: AsyncEngine) -> IdentityWorld:  # noqa: F811
    return IdentityWorld(engine, new_scope())
