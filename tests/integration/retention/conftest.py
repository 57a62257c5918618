"""Fixtures of the retention tests: a migrated runtime database per test on each backend
(``db_url``: ``sqlite`` and ``mariadb``), and a world (org, scope, plan, store) built
like the kernel tests' one, so runs are created and driven only through the store API."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore
from services import db, migrate
from tests.integration.kernel.conftest import (
    TEST_POLICY,
    ShiftedClock,
    World,
    new_scope,
    seed_plan,
)


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade(db_url, "runtime_svc")
    eng = db.create_engine(db_url, pool_size=6)
    try:
        yield eng
    finally:
        await eng.dispose()


async def make_world(engine: AsyncEngine) -> World:
    """A fresh org with its own plan, sharing ``engine``."""
    scope = new_scope()
    plan_id, plan_digest = await seed_plan(engine, scope)
    clock = ShiftedClock()
    store = FlowRunStateStore(engine, policy=TEST_POLICY, clock=clock)
    return World(engine, scope, plan_id, plan_digest, clock, store)


@pytest.fixture
async def world(engine: AsyncEngine) -> World:
    return await make_world(engine)
