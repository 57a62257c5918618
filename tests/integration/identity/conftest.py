"""Fixtures of the §17 identity tests: one migrated runtime database per module and
backend (``sqlite``, ``mariadb``), a fresh engine per test and a per-test
:class:`~tests.integration.identity.support.IdentityWorld` (a new org)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from tests.integration.identity.support import IdentityWorld
from tests.integration.kernel.conftest import kernel_db_url  # noqa: F401
from tests.integration.waits.support import new_scope


@pytest.fixture
async def engine(kernel_db_url: str) -> AsyncIterator[AsyncEngine]:  # noqa: F811
    eng = db.create_engine(kernel_db_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
def world(engine: AsyncEngine) -> IdentityWorld:
    return IdentityWorld(engine, new_scope())
