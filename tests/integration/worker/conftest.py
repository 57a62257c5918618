"""Fixtures of the worker integration tests: one migrated runtime database per module and
backend (``sqlite``, ``mariadb``), a fresh engine per test; isolation by a new org per
test. The store's clock is shiftable so lease expiry and backoff are reached by moving the
database clock, never by sleeping."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RetryPolicy
from services import db
from tests.integration.kernel.conftest import ShiftedClock, kernel_db_url  # noqa: F401

#: Short real delays are never waited for: tests shift the clock past them.
WORKER_POLICY = RetryPolicy(
    max_attempts=4,
    base_delay_ms=60_000,
    max_delay_ms=3_600_000,
    jitter_ratio=0.25,
    lease_duration_ms=300_000,
    max_lease_expiries=3,
)


@pytest.fixture
async def engine(kernel_db_url: str) -> AsyncIterator[AsyncEngine]:  # noqa: F811
    eng = db.create_engine(kernel_db_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
def clock() -> ShiftedClock:
    return ShiftedClock()


@pytest.fixture
def store(engine: AsyncEngine, clock: ShiftedClock) -> FlowRunStateStore:
    return FlowRunStateStore(engine, policy=WORKER_POLICY, clock=clock)
