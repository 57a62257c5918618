"""``PlanSource.bounds`` (round 6, issue 12): the wait bounds of a policy generation are
read once per process; a cached generation is returned without opening a transaction
(the effect submit asked for them in a read-only transaction of its own on every
effect). Runtime database on SQLite and MariaDB."""

from __future__ import annotations

from typing import Any, cast

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.waits.plans import PlanSource
from tests.support.dbs import new_org


class _NoEngine:
    """An engine that must not be used (any attribute access fails the test)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a cached generation must not touch the database ({name})")


async def test_cached_wait_bounds_open_no_transaction(engine: AsyncEngine) -> None:
    plans = PlanSource()
    org = new_org()
    assert plans.cached_bounds(org, 1) is None
    first = await plans.bounds(engine, org, 1)  # not stored: the defaults, now cached
    assert plans.cached_bounds(org, 1) == first
    assert await plans.bounds(cast(AsyncEngine, _NoEngine()), org, 1) == first
    # Another generation (or org) is read again.
    assert plans.cached_bounds(org, 2) is None
    with pytest.raises(AssertionError, match="must not touch"):
        await plans.bounds(cast(AsyncEngine, _NoEngine()), org, 2)
