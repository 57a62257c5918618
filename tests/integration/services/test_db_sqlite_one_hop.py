"""The embedded SQLite engine runs each statement inline on the event-loop thread, or —
when it would wait for a lock or read too long — as one call on the driver thread
(``services/db_sqlite.py``), with pysqlite's own results: rows, description, row count,
last row id, ``executemany``, errors and rollback — and streamed results keep
SQLAlchemy's server-side cursor."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db
from services.db_sqlite import OneHopCursor
from tests.support.databases import tables_engine

_md = sa.MetaData()
_t = sa.Table(
    "one_hop",
    _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(40), nullable=False, unique=True),
    sa.Column("n", sa.Integer, nullable=False),
)


def _count_driver_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the name of every function handed to a connection's driver thread."""
    calls: list[str] = []
    original = aiosqlite.Connection._execute

    async def counted(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(getattr(fn, "__name__", repr(fn)))
        return await original(self, fn, *args, **kwargs)

    monkeypatch.setattr(aiosqlite.Connection, "_execute", counted)
    return calls


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    async with tables_engine(f"sqlite+aiosqlite:///{tmp_path}/one_hop.db", _md, pool_size=2) as eng:
        yield eng


async def test_rows_description_rowcount_and_lastrowid_are_pysqlites(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        first = await conn.execute(_t.insert().values(name="a", n=1))
        second = await conn.execute(_t.insert().values(name="b", n=2))
        assert first.lastrowid == 1 and second.lastrowid == 2
        assert first.inserted_primary_key == (1,)
        many = await conn.execute(_t.insert(), [{"name": f"m{i}", "n": i} for i in range(5)])
        assert many.rowcount == 5
        moved = await conn.execute(sa.update(_t).where(_t.c.n >= 3).values(n=_t.c.n + 100))
        assert moved.rowcount == 2
    async with db.transaction(engine, readonly=True) as conn:
        result = await conn.execute(sa.select(_t.c.name, _t.c.n).order_by(_t.c.id))
        assert list(result.keys()) == ["name", "n"]
        rows = result.all()
        assert rows[0] == ("a", 1) and len(rows) == 7
        assert (await conn.execute(sa.select(_t).where(_t.c.id == -1))).first() is None
        one = (await conn.execute(sa.select(_t).where(_t.c.name == "b"))).mappings().one()
        assert dict(one) == {"id": 2, "name": "b", "n": 2}
        returned = (
            await conn.execute(sa.select(sa.func.count()).select_from(_t).where(_t.c.n > 100))
        ).scalar_one()
        assert returned == 2


async def test_an_error_is_the_dbapi_error_and_the_transaction_rolls_back(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(name="dup", n=1))
    with pytest.raises(IntegrityError):
        async with db.transaction(engine) as conn:
            await conn.execute(_t.insert().values(name="kept-out", n=2))
            await conn.execute(_t.insert().values(name="dup", n=3))
    with pytest.raises(OperationalError):
        async with db.transaction(engine, readonly=True) as conn:
            await conn.execute(sa.text("SELECT * FROM no_such_table"))
    async with db.transaction(engine, readonly=True) as conn:
        names = (await conn.execute(sa.select(_t.c.name))).scalars().all()
    assert names == ["dup"]  # the failed transaction left nothing


async def test_uncontended_statements_run_inline_without_a_driver_thread_call(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with db.transaction(engine) as conn:
        raw = await conn.get_raw_connection()
        assert isinstance(raw.dbapi_connection.cursor(), OneHopCursor)  # type: ignore[union-attr]
        calls = _count_driver_calls(monkeypatch)
        await conn.execute(_t.insert().values(name="x", n=1))
        (await conn.execute(sa.select(_t).where(_t.c.name == "x"))).one()
    assert calls == []  # BEGIN, INSERT, SELECT and COMMIT all inline


async def _names(engine: AsyncEngine) -> list[str]:
    async with db.transaction(engine, readonly=True) as conn:
        return list((await conn.execute(sa.select(_t.c.name).order_by(_t.c.id))).scalars())


async def _ticking(stop: asyncio.Event) -> int:
    """Counts event-loop turns until ``stop``: a stalled loop barely counts."""
    ticks = 0
    while not stop.is_set():
        ticks += 1
        await asyncio.sleep(0.005)
    return ticks


async def test_a_statement_that_would_wait_for_the_lock_waits_on_the_driver_thread(
    engine: AsyncEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection (another process, as far as SQLite knows) holds the write
    lock for 0.3 s: the inline ``BEGIN IMMEDIATE`` does not wait, the statement is run
    on the driver thread with the busy timeout, the event loop keeps turning meanwhile,
    and the write lands once the lock is free."""
    holder = sqlite3.connect(tmp_path / "one_hop.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    calls = _count_driver_calls(monkeypatch)
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticking(stop))
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, holder.commit)
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(name="waited", n=1))
    stop.set()
    assert await ticker >= 20  # ~60 turns of 5 ms in 0.3 s when nothing blocks the loop
    assert calls == ["_statement"]  # only the contended statement; COMMIT inline
    holder.close()
    async with db.transaction(engine, readonly=True) as conn:
        assert (await conn.execute(sa.select(_t.c.n).where(_t.c.name == "waited"))).scalar() == 1


_LONG_READ = sa.text(
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3000000)"
    " SELECT count(*) FROM c"
)


async def test_a_long_read_is_interrupted_and_finished_on_the_driver_thread(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read over its inline budget (here the first statement of a read-only
    transaction, so its BEGIN already took effect inline) is interrupted and run to
    completion on the driver thread, without a second BEGIN; the loop keeps turning."""
    calls = _count_driver_calls(monkeypatch)
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticking(stop))
    async with db.transaction(engine, readonly=True) as conn:
        assert (await conn.execute(_LONG_READ)).scalar_one() == 3_000_000
    stop.set()
    ticks = await ticker
    assert calls == ["_statement"]
    assert ticks >= 2  # the scan (hundreds of ms here) did not hold the loop


async def test_an_interrupted_read_keeps_the_write_transaction_it_ran_in(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_driver_calls(monkeypatch)
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(name="kept", n=7))
        assert (await conn.execute(_LONG_READ)).scalar_one() == 3_000_000
        await conn.execute(_t.insert().values(name="after", n=8))
    assert calls == ["_statement"]
    assert await _names(engine) == ["kept", "after"]


async def test_streamed_results_keep_the_server_side_cursor(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert(), [{"name": f"s{i}", "n": i} for i in range(50)])
    async with engine.connect() as conn:
        stream = await conn.stream(sa.select(_t.c.n).order_by(_t.c.n))
        seen = [n async for n in stream.scalars()]
    assert seen == list(range(50))


async def test_the_pool_reset_rolls_back_only_what_is_open(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_driver_calls(monkeypatch)
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(name="committed", n=1))
    async with db.transaction(engine) as conn:
        pass  # an empty transaction sends nothing
    async with engine.connect() as conn:  # left without a commit: rolled back
        await conn.execute(_t.insert().values(name="abandoned", n=2))
    async with db.transaction(engine) as conn:  # the write lock was released
        await conn.execute(_t.insert().values(name="after", n=3))
    assert await _names(engine) == ["committed", "after"]
    assert calls == []  # commits and the rollback ran inline


async def test_begin_immediate_with_the_first_statement_still_serialises_writers(
    engine: AsyncEngine,
) -> None:
    """Read-modify-write transactions on separate connections lose no update: each
    ``BEGIN IMMEDIATE`` takes the write lock before its own first read, in the same
    hand-off (TOOLING.md: a deferred BEGIN would let both read first)."""
    async with db.transaction(engine) as conn:
        await conn.execute(_t.insert().values(name="counter", n=0))

    async def increment(conn: Any) -> None:
        n = (await conn.execute(sa.select(_t.c.n).where(_t.c.name == "counter"))).scalar_one()
        await asyncio.sleep(0.01)  # the other writer runs meanwhile
        await conn.execute(sa.update(_t).where(_t.c.name == "counter").values(n=n + 1))

    await asyncio.gather(*(db.run_in_transaction(engine, increment) for _ in range(8)))
    async with db.transaction(engine, readonly=True) as conn:
        final = (await conn.execute(sa.select(_t.c.n).where(_t.c.name == "counter"))).scalar_one()
    assert final == 8
