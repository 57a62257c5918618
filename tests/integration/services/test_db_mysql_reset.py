"""The MariaDB engine's pool sends its reset-on-return ROLLBACK only when a transaction
may be open (``services/db_mysql.py``): never after a COMMIT, always after a transaction
that was left open or broke — on both supported drivers (asyncmy, aiomysql). ROLLBACKs
are counted at the server (``Com_rollback``), not in the driver."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from services.db_mysql import DRIVERS
from tests.support.databases import admin_connection, driver_engine

pytestmark = pytest.mark.mariadb

_md = sa.MetaData()
_t = sa.Table(
    "reset_aware",
    _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("n", sa.Integer, nullable=False),
)


@pytest.fixture(params=DRIVERS)
async def engine(mariadb_url: str, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    async with driver_engine(mariadb_url, request.param, _md, pool_size=2) as eng:
        yield eng


class _ServerRollbacks:
    """ROLLBACK statements the server executed since this object was made (the global
    ``Com_rollback`` counter; the tests run one at a time, and this reader's own
    connection sends none)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._base = self._read()

    def _read(self) -> int:
        conn = admin_connection(self._url)
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE 'Com_rollback'")
                row: Any = cur.fetchone()
                return int(row[1])
        finally:
            conn.close()

    def __len__(self) -> int:
        return self._read() - self._base

    def __bool__(self) -> bool:
        return len(self) > 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list) and len(self) == len(other)

    __hash__ = None  # type: ignore[assignment]


@pytest.fixture
def rollbacks(engine: AsyncEngine, mariadb_url: str) -> _ServerRollbacks:
    """Each ROLLBACK the server received from now on."""
    return _ServerRollbacks(mariadb_url)


async def test_no_rollback_round_trip_after_a_commit(
    engine: AsyncEngine, rollbacks: _ServerRollbacks
) -> None:
    for i in range(3):
        async with db.transaction(engine) as conn:
            await conn.execute(_t.insert().values(id=i, n=i))
        async with db.transaction(engine, readonly=True) as conn:
            await conn.execute(sa.select(_t).where(_t.c.id == i))
    assert rollbacks == []


async def test_an_open_or_failed_transaction_is_still_rolled_back(
    engine: AsyncEngine, rollbacks: _ServerRollbacks
) -> None:
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(id=1, n=1))
    async with engine.connect() as conn:  # left without a commit
        await conn.execute(sa.update(_t).where(_t.c.id == 1).values(n=99))
    assert len(rollbacks) == 1
    with pytest.raises(IntegrityError):
        async with db.transaction(engine) as conn:
            await conn.execute(_t.insert().values(id=2, n=2))
            await conn.execute(_t.insert().values(id=1, n=3))
    assert len(rollbacks) >= 2
    # Nothing of either transaction stayed, and no row lock is held (this update would
    # wait for a lock still held by a connection back in the pool).
    async with db.transaction(engine) as conn:
        moved = await conn.execute(sa.update(_t).where(_t.c.id == 1).values(n=5))
        assert moved.rowcount == 1
        rows = (await conn.execute(sa.select(_t.c.id, _t.c.n).order_by(_t.c.id))).all()
    assert [tuple(r) for r in rows] == [(1, 5)]


async def test_a_transaction_that_only_read_and_locked_is_rolled_back(
    engine: AsyncEngine, rollbacks: _ServerRollbacks
) -> None:
    """The driver's ``server_status`` is not refreshed by a result set, so it cannot tell
    that a transaction which only ran ``SELECT … FOR UPDATE`` is open: the ROLLBACK must
    still be sent and the row lock released before the connection is pooled again."""
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(id=1, n=1))
    with pytest.raises(RuntimeError):
        async with db.transaction(engine) as conn:
            await conn.execute(sa.select(_t).where(_t.c.id == 1).with_for_update())
            raise RuntimeError("the transaction fails after its locking read")
    assert rollbacks
    async with db.transaction(engine, readonly=True) as conn:
        held = (
            await conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_rows_locked > 0"
                )
            )
        ).scalar_one()
    assert held == 0
