"""Fixtures of the effect-owner integration tests: one migrated owner database per module
and backend (``sqlite``, ``mariadb``; tests isolate themselves by org), an engine per
test, a signing key per module."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from services.auth import generate_keypair
from tests.integration.effects.owner_world import World, world_with
from tests.support.dbs import migrated_database

_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]


@pytest.fixture(scope="module", params=_BACKENDS, ids=["sqlite", "mariadb"])
def owner_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with migrated_database(request, tmp_path_factory, "effect_owner_svc") as url:
        yield url


@pytest.fixture
async def engine(owner_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(owner_db_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture(scope="module")
def private_key() -> Ed25519PrivateKey:
    return generate_keypair()[0]


@pytest.fixture
async def world(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> AsyncIterator[World]:
    async with world_with(engine, private_key, tmp_path) as w:
        yield w
