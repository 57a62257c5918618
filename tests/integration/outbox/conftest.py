"""Fixtures of the generic outbox tests: one migrated effect-owner database (its
``owner_outbox``) and one migrated runtime database (its ``runtime_outbox``) per module and
backend; tests isolate themselves by org."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from tests.support.dbs import migrated_database

_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]


@pytest.fixture(scope="module", params=_BACKENDS, ids=["sqlite", "mariadb"])
def outbox_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with migrated_database(request, tmp_path_factory, "effect_owner_svc") as url:
        yield url


@pytest.fixture
async def engine(outbox_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(outbox_db_url, pool_size=6)
    try:
        yield eng
    finally:
        await eng.dispose()
