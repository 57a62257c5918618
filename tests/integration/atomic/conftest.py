"""Fixtures of the Bounded Atomic integration tests: one migrated runtime database per
module and backend (``sqlite``, ``mariadb``; the kernel tests' fixture), a fresh engine per
test, isolation by a new org per test.

The store's retry policy uses real but short backoff delays: a Bounded Atomic retry is
claimed again by :class:`~runtime_svc.atomic.AtomicRunner` itself once it is due, inside
the caller's budget, so the delay must elapse on the database clock while the runner
polls (bounded by that budget).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore
from services import db
from tests.integration.atomic.support import ATOMIC_POLICY
from tests.integration.kernel.conftest import kernel_db_url  # noqa: F401


@pytest.fixture
async def engine(kernel_db_url: str) -> AsyncIterator[AsyncEngine]:  # noqa: F811
    eng = db.create_engine(kernel_db_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
def store(engine: AsyncEngine) -> FlowRunStateStore:
    return FlowRunStateStore(engine, policy=ATOMIC_POLICY)
