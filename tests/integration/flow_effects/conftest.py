"""Fixtures of the runtime-side effect tests: one migrated runtime database and one
migrated effect-owner database per module and backend (``sqlite``, ``mariadb``), fresh
engines per test, and a per-test :class:`~tests.integration.flow_effects.world.EffectWorld`
(a new org, so tests sharing the databases never collide)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from tests.integration.flow_effects.world import EffectWorld, effect_world
from tests.support.dbs import migrated_database

_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]


@pytest.fixture(scope="module", params=_BACKENDS, ids=["sqlite", "mariadb"])
def effect_dbs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    with (
        migrated_database(request, tmp_path_factory, "runtime_svc") as runtime,
        migrated_database(request, tmp_path_factory, "effect_owner_svc") as owner,
    ):
        yield runtime, owner


@pytest.fixture
async def runtime_engine(effect_dbs: tuple[str, str]) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(effect_dbs[0], pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def owner_engine(effect_dbs: tuple[str, str]) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(effect_dbs[1], pool_size=6)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def world(
    runtime_engine: AsyncEngine, owner_engine: AsyncEngine, tmp_path: Path
) -> AsyncIterator[EffectWorld]:
    async with effect_world(runtime_engine, owner_engine, tmp_path) as w:
        yield w
