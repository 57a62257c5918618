"""Batched writes (services.db_batch) against real SQLite and MariaDB databases: one round
trip where the backend runs multi-statements, the same outcome as the statements one by
one — row counts, checks and duplicate keys decided in statement order, nothing after a
failed statement run, parameters typed as SQLAlchemy types them."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    PrimaryKeyConstraint,
    String,
    Table,
    bindparam,
    event,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine.cursor import CursorResultMetaData
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db
from services.db_batch import (
    BATCH_SEPARATOR,
    Companion,
    Read,
    Write,
    execute_reads,
    execute_writes,
    execute_writes_if_absent,
    fenced_writes,
    insert_if_absent_write,
    statements_of,
)
from services.errors import FenceLostError
from tests.support.statements import watched_statements

metadata = db.new_metadata()
notes = Table(
    "batch_notes",
    metadata,
    Column("org_id", String(db.ID_LEN), nullable=False),
    Column("note_id", String(db.ID_LEN), nullable=False),
    Column("state_version", BigInteger, nullable=False),
    Column("body", db.JsonText(256), nullable=True),
    Column("seen_at", db.UtcDateTime(), nullable=True),
    PrimaryKeyConstraint("org_id", "note_id"),
    **db.TABLE_OPTIONS,
)
tallies = Table(
    "batch_tallies",
    metadata,
    Column("org_id", String(db.ID_LEN), nullable=False),
    Column("tally_id", String(db.ID_LEN), nullable=False),
    Column("state_version", BigInteger, nullable=False),
    Column("counter", Integer, nullable=False),
    PrimaryKeyConstraint("org_id", "tally_id"),
    **db.TABLE_OPTIONS,
)
_serial = itertools.count()
stamped = Table(
    "batch_stamped",
    metadata,
    Column("org_id", String(db.ID_LEN), nullable=False),
    Column("stamp_id", String(db.ID_LEN), nullable=False),
    # A Python-side default: only SQLAlchemy's execution context fills it in.
    Column("serial", Integer, nullable=False, default=lambda: next(_serial)),
    PrimaryKeyConstraint("org_id", "stamp_id"),
    **db.TABLE_OPTIONS,
)

ORG = "org-1"
_INSERT_NOTE = insert(notes)
_INSERT_TALLY = insert(tallies)
_INSERT_STAMPED = insert(stamped)
_BUMP = (
    update(tallies)
    .where(
        tallies.c.org_id == bindparam("k_org"),
        tallies.c.tally_id == bindparam("k_id"),
        tallies.c.state_version == bindparam("k_version"),
    )
    .values(counter=bindparam("v_counter"), state_version=tallies.c.state_version + 1)
)


class Duplicate(Exception):
    pass


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(db_url, pool_size=3)
    async with db.transaction(eng) as conn:
        await conn.run_sync(metadata.create_all)
    yield eng
    await eng.dispose()


@contextmanager
def round_trips(engine: AsyncEngine) -> Iterator[list[str]]:
    """Every cursor execution ``engine`` sends inside the block (one per round trip)."""
    seen: list[str] = []

    def on_execute(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", on_execute)


def _batches(engine: AsyncEngine) -> bool:
    return db.strategy_for(engine.dialect).multi_statements


def _note(note_id: str, **overrides: Any) -> Write:
    values = {"org_id": ORG, "note_id": note_id, "state_version": 0, **overrides}
    return Write(_INSERT_NOTE, values, on_duplicate=lambda: Duplicate(note_id))


def _bump(tally_id: str, version: int, counter: int, check: Any = None) -> Write:
    params = {"k_org": ORG, "k_id": tally_id, "k_version": version, "v_counter": counter}
    return Write(_BUMP, params, check=check)


async def _note_ids(conn: AsyncConnection) -> list[str]:
    rows = await conn.execute(select(notes.c.note_id).order_by(notes.c.note_id))
    return list(rows.scalars())


async def test_writes_share_one_round_trip_where_the_backend_runs_multi_statements(
    engine: AsyncEngine,
) -> None:
    seen_at = datetime(2026, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)
    async with db.transaction(engine) as conn:
        await conn.execute(
            _INSERT_TALLY, {"org_id": ORG, "tally_id": "t", "state_version": 2, "counter": 0}
        )
    with round_trips(engine) as trips, watched_statements(engine) as statements:
        async with db.transaction(engine) as conn:
            counts = await execute_writes(
                conn,
                [
                    # A literal % and a quote in a bound value: bound by the driver, never
                    # inlined into the statement text.
                    _note("n1", body='{"text": "50% of \'it\'"}', seen_at=seen_at),
                    _note("n2"),
                    _bump("t", 2, 7),
                ],
            )
    assert counts == [1, 1, 1]
    writes = [t for t in trips if not t.startswith(("BEGIN", "COMMIT"))]
    assert len(writes) == (1 if _batches(engine) else 3)
    # Statement listeners see every statement of the round trip.
    assert [s.split()[0] for s in statements if not s.startswith("BEGIN")] == [
        "INSERT",
        "INSERT",
        "UPDATE",
    ]
    async with db.transaction(engine, readonly=True) as conn:
        row = (await conn.execute(select(notes).where(notes.c.note_id == "n1"))).one()
        tally = (await conn.execute(select(tallies))).one()
    assert row.body == '{"text": "50% of \'it\'"}'
    assert row.seen_at == seen_at  # typed by UtcDateTime's bind and result processors
    assert (tally.state_version, tally.counter) == (3, 7)


async def test_a_duplicate_raises_the_writes_error_and_nothing_after_it_runs(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_note("n2")])
    async with db.transaction(engine) as conn:
        with pytest.raises(Duplicate) as caught:
            await execute_writes(conn, [_note("n1"), _note("n2"), _note("n3")])
        assert isinstance(caught.value.__cause__, IntegrityError)
        # The transaction is still usable: what ran before the duplicate is there, what
        # came after it never ran.
        assert await _note_ids(conn) == ["n1", "n2"]
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == ["n1", "n2"]


async def test_a_duplicate_without_its_own_error_is_the_driver_error(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_note("n1")])
    with pytest.raises(IntegrityError) as caught:
        async with db.transaction(engine) as conn:
            plain = Write(_INSERT_NOTE, {"org_id": ORG, "note_id": "n1", "state_version": 0})
            await execute_writes(conn, [_note("n0"), plain])
    assert db.classify_db_error(caught.value) is db.DbErrorClass.DUPLICATE_KEY
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == ["n1"]  # n0 went with the rollback


def _absent_note(note_id: str) -> Write:
    return insert_if_absent_write(notes, {"org_id": ORG, "note_id": note_id, "state_version": 0})


async def test_an_insert_if_absent_answers_in_the_batch_where_a_duplicate_stops_it(
    engine: AsyncEngine,
) -> None:
    """``execute_writes_if_absent``: the row was new → ``True``, one round trip with the
    writes around it; already there → ``False``, the writes before it ran, the ones
    after it did not, and the transaction goes on (``insert_if_absent``'s meaning)."""
    with round_trips(engine) as trips:
        async with db.transaction(engine) as conn:
            assert await execute_writes_if_absent(conn, [_note("n1"), _absent_note("n2")])
    assert len([t for t in trips if t.startswith("INSERT")]) == (1 if _batches(engine) else 2)
    async with db.transaction(engine) as conn:
        # First in the batch and present: nothing after it ran.
        assert not await execute_writes_if_absent(conn, [_absent_note("n2"), _note("n3")])
        assert await _note_ids(conn) == ["n1", "n2"]
        # Last and present: everything before it ran and stays.
        assert not await execute_writes_if_absent(conn, [_note("n4"), _absent_note("n1")])
        assert await _note_ids(conn) == ["n1", "n2", "n4"]
        # A real duplicate before it is still that write's error.
        with pytest.raises(Duplicate):
            await execute_writes_if_absent(conn, [_note("n4"), _absent_note("n5")])
        await execute_writes(conn, [_note("n6")])  # still usable
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == ["n1", "n2", "n4", "n6"]


async def test_execute_writes_if_absent_needs_exactly_one_insert_if_absent(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        with pytest.raises(ValueError):
            await execute_writes_if_absent(conn, [_note("n1")])
        with pytest.raises(ValueError):
            await execute_writes_if_absent(conn, [_absent_note("n1"), _absent_note("n2")])
        assert await _note_ids(conn) == []


async def test_checks_decide_in_statement_order_before_a_later_failure(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_note("n1")])
    checked: list[int] = []

    async def must_match(rowcount: int) -> None:
        checked.append(rowcount)
        if rowcount != 1:
            raise LookupError("the tally moved")

    # The UPDATE matches nothing and the INSERT after it is a duplicate: one by one, the
    # UPDATE's check fails first, so that is what a batch raises too.
    with pytest.raises(LookupError):
        async with db.transaction(engine) as conn:
            await execute_writes(conn, [_bump("missing", 0, 1, must_match), _note("n1")])
    assert checked == [0]


async def test_fenced_writes_lose_the_fence_with_the_single_statements_error(
    engine: AsyncEngine,
) -> None:
    async with db.transaction(engine) as conn:
        await conn.execute(
            _INSERT_TALLY, {"org_id": ORG, "tally_id": "t", "state_version": 4, "counter": 0}
        )
    stale = db.FencedWrite(tallies, ORG, {"tally_id": "t"}, 3, {"counter": 9}, {})
    with pytest.raises(FenceLostError) as caught:
        async with db.transaction(engine) as conn:
            await execute_writes(conn, [*fenced_writes(conn, [stale], together=True), _note("n9")])
    assert caught.value.attributes["entity"] == "batch_tallies"
    assert (caught.value.expected_version, caught.value.found_version) == (3, 4)
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == []
        assert (await conn.execute(select(tallies.c.counter))).scalar_one() == 0


async def test_statements_that_need_the_execution_context_run_on_their_own(
    engine: AsyncEngine,
) -> None:
    with round_trips(engine) as trips:
        async with db.transaction(engine) as conn:
            counts = await execute_writes(
                conn,
                [
                    Write(_INSERT_STAMPED, {"org_id": ORG, "stamp_id": "s1"}),
                    _note("n1"),
                ],
            )
    assert counts == [1, 1]
    writes = [t for t in trips if not t.startswith(("BEGIN", "COMMIT"))]
    assert len(writes) == 2 and not any(BATCH_SEPARATOR in t for t in writes)
    async with db.transaction(engine, readonly=True) as conn:
        serial = (await conn.execute(select(stamped.c.serial))).scalar_one()
    assert isinstance(serial, int)  # the Python-side default was applied


async def test_a_connection_lost_under_a_batch_is_classified_as_for_one_statement(
    engine: AsyncEngine,
) -> None:
    if not _batches(engine):
        pytest.skip("SQLite runs in process: no connection to lose")
    with pytest.raises(DBAPIError) as caught:
        async with db.transaction(engine) as conn:
            connection_id = (await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
            async with db.transaction(engine) as killer:
                await killer.execute(text(f"KILL {int(connection_id)}"))
            await execute_writes(conn, [_note("n1"), _note("n2")])
    # Wrapped by SQLAlchemy and the connection invalidated, as for a single statement:
    # the worker's classification (never a retry of a possibly-run write) is unchanged.
    assert caught.value.connection_invalidated
    assert db.classify_db_error(caught.value) is db.DbErrorClass.OUTCOME_UNKNOWN
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == []


_NOTES_LOCKED = (
    select(notes, (notes.c.state_version + 1).label("next_version"))
    .where(notes.c.org_id == bindparam("org"), notes.c.note_id >= bindparam("from_id"))
    .order_by(notes.c.note_id)
    .with_for_update()
)
_TALLY_LOCKED = (
    select(tallies.c.tally_id, tallies.c.counter)
    .where(tallies.c.org_id == bindparam("org"), tallies.c.tally_id == bindparam("id"))
    .with_for_update()
)


async def test_reads_share_one_round_trip_and_return_the_rows_of_single_reads(
    engine: AsyncEngine,
) -> None:
    """``execute_reads``: the reads' rows — typed by each column's result processor
    (``UtcDateTime``, JSON text, integers, a computed column) and read by position or
    by key — equal the rows each statement returns alone; one round trip where the
    backend runs multi-statements; an empty result set is empty (the reads after it
    still run)."""
    seen_at = datetime(2026, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)
    async with db.transaction(engine) as conn:
        await execute_writes(
            conn,
            [
                _note("n1", body='{"a": 1}', seen_at=seen_at),
                _note("n2", state_version=4),
                Write(
                    _INSERT_TALLY,
                    {"org_id": ORG, "tally_id": "t", "state_version": 1, "counter": 9},
                ),
            ],
        )
    reads = [
        Read(_NOTES_LOCKED, {"org": ORG, "from_id": "n"}),
        Read(_NOTES_LOCKED, {"org": ORG, "from_id": "x"}),  # nothing
        Read(_TALLY_LOCKED, {"org": ORG, "id": "t"}),
    ]
    with round_trips(engine) as trips:
        async with db.transaction(engine) as conn:
            batched = await execute_reads(conn, reads)
    async with db.transaction(engine) as conn:
        single = [list(await conn.execute(r.statement, dict(r.params))) for r in reads]
    assert len([t for t in trips if not t.startswith(("BEGIN", "COMMIT"))]) == (
        1 if _batches(engine) else 3
    )
    assert [[tuple(row) for row in rows] for rows in batched] == [
        [tuple(row) for row in rows] for rows in single
    ]
    first, second = batched[0]
    assert (first.note_id, first.seen_at, first.body, first.next_version) == (
        "n1",
        seen_at,
        '{"a": 1}',
        1,
    )
    assert second[1] == "n2" and second.next_version == 5 and second.seen_at is None
    assert batched[1] == []
    assert [tuple(r) for r in batched[2]] == [("t", 9)]


async def test_a_batched_read_builds_no_result_metadata_and_leaves_no_result_open(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round trip goes to the driver's cursor (ADR 0012): SQLAlchemy builds no
    result metadata from the last set's description (it would, afresh, for every round
    trip of driver SQL), the rows are still typed per column (the processors chosen
    once per shape), and the connection takes the next statement at once (every set
    was read)."""
    if not _batches(engine):
        pytest.skip("SQLite runs the reads one by one through SQLAlchemy's own results")
    seen_at = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_note("m1", seen_at=seen_at)])
    reads = [
        Read(_NOTES_LOCKED, {"org": ORG, "from_id": "m"}),
        Read(_NOTES_LOCKED, {"org": ORG, "from_id": "m"}),
    ]
    built: list[int] = []
    real_init = CursorResultMetaData.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(CursorResultMetaData, "__init__", counting_init)
    for _ in range(2):
        async with db.transaction(engine) as conn:
            first, second = await execute_reads(conn, reads)
            assert [(r.note_id, r.seen_at, r.next_version) for r in first + second] == [
                ("m1", seen_at, 1),
                ("m1", seen_at, 1),
            ]
            assert (await conn.execute(text("SELECT 7"))).scalar_one() == 7
    assert built == [1, 1]  # the two ``SELECT 7`` results only


async def test_a_read_whose_columns_cannot_be_keys_runs_on_its_own(engine: AsyncEngine) -> None:
    """A column key a batched row could not carry (here ``_private``) sends that read on
    its own, through SQLAlchemy's rows — the same rows, one round trip more."""
    async with db.transaction(engine) as conn:
        await execute_writes(conn, [_note("k1")])
    odd = Read(select(notes.c.note_id.label("_private")).where(notes.c.org_id == ORG), {})
    plain = Read(_TALLY_LOCKED, {"org": ORG, "id": "none"})
    with round_trips(engine) as trips:
        async with db.transaction(engine) as conn:
            rows, empty = await execute_reads(conn, [odd, plain])
    assert [tuple(r) for r in rows] == [("k1",)] and empty == []
    assert len([t for t in trips if not t.startswith(("BEGIN", "COMMIT"))]) == 2


async def test_a_failing_read_raises_the_drivers_error_as_alone(engine: AsyncEngine) -> None:
    """A read the server refuses — first or after another — raises the driver's error
    (wrapped by SQLAlchemy), as it does alone; the transaction rolls back."""
    broken = Read(select(notes.c.note_id).where(text("no_such_column = 1")), {})
    fine = Read(_TALLY_LOCKED, {"org": ORG, "id": "t"})
    for reads in ([broken, fine], [fine, broken, fine]):
        with pytest.raises(DBAPIError) as caught:
            async with db.transaction(engine) as conn:
                await execute_reads(conn, reads)
        assert "no_such_column" in str(caught.value)


async def test_a_read_rides_after_inserts_if_absent_only_when_every_write_ran(
    engine: AsyncEngine,
) -> None:
    """``execute_writes_if_absent(then=…)`` (ADR 0016): where the backend runs
    multi-statements the read rides after the writes in their round trip and its rows —
    typed as alone, and seeing the writes before it — are set on the companion; a
    duplicate stops the round trip before the read (its rows stay ``None``); elsewhere,
    or with ``commit``, it is left unsent for the caller."""
    seen_at = datetime(2026, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)
    async with db.transaction(engine) as conn:
        await execute_writes(
            conn,
            [
                Write(
                    _INSERT_TALLY,
                    {"org_id": ORG, "tally_id": "t", "state_version": 1, "counter": 9},
                )
            ],
        )
    tally = Companion(Read(_TALLY_LOCKED, {"org": ORG, "id": "t"}))
    with round_trips(engine) as trips:
        async with db.transaction(engine) as conn:
            inserted = await execute_writes_if_absent(
                conn, [_note("r1", seen_at=seen_at), _absent_note("r2")], then=tally
            )
    assert inserted
    if _batches(engine):
        assert len([t for t in trips if not t.startswith(("BEGIN", "COMMIT"))]) == 1
        assert tally.rows is not None and [tuple(r) for r in tally.rows] == [("t", 9)]
        assert tally.rows[0].counter == 9
    else:
        assert tally.rows is None
    # The read runs after the writes: it sees them (typed as a read alone).
    notes_after = Companion(Read(_NOTES_LOCKED, {"org": ORG, "from_id": "r"}))
    async with db.transaction(engine) as conn:
        assert await execute_writes_if_absent(conn, [_absent_note("r3")], then=notes_after)
    if _batches(engine):
        assert notes_after.rows is not None
        assert [(r.note_id, r.seen_at, r.next_version) for r in notes_after.rows] == [
            ("r1", seen_at, 1),
            ("r2", None, 1),
            ("r3", None, 1),
        ]
    # A duplicate stops the round trip before the read: left for the caller.
    stopped = Companion(Read(_TALLY_LOCKED, {"org": ORG, "id": "t"}))
    async with db.transaction(engine) as conn:
        assert not await execute_writes_if_absent(conn, [_absent_note("r1")], then=stopped)
    assert stopped.rows is None
    # With the writes' COMMIT nothing may follow them: left unsent.
    late = Companion(Read(_TALLY_LOCKED, {"org": ORG, "id": "t"}))
    async with db.transaction(engine) as conn:
        assert await execute_writes_if_absent(conn, [_absent_note("r4")], commit=True, then=late)
    assert late.rows is None
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == ["r1", "r2", "r3", "r4"]


async def test_a_failing_riding_read_raises_its_own_error_and_nothing_commits(
    engine: AsyncEngine,
) -> None:
    """A read the server refuses after the writes ran raises the driver's error of that
    read (not a write's, not a row guard's), its rows stay ``None``, and the writes
    before it roll back with the transaction."""
    broken = Companion(Read(select(notes.c.note_id).where(text("no_such_column = 1")), {}))
    with pytest.raises(DBAPIError) as caught:
        async with db.transaction(engine) as conn:
            await execute_writes_if_absent(conn, [_note("f1"), _absent_note("f2")], then=broken)
            if not _batches(engine):  # left unsent: the caller runs it itself
                assert broken.rows is None
                await execute_reads(conn, [broken.read])
    assert "no_such_column" in str(caught.value)
    assert broken.rows is None
    async with db.transaction(engine, readonly=True) as conn:
        assert await _note_ids(conn) == []


def test_statement_listeners_split_a_round_trip_into_its_statements() -> None:
    assert statements_of("INSERT a" + BATCH_SEPARATOR + "UPDATE b") == ["INSERT a", "UPDATE b"]
    assert statements_of("SELECT 1") == ["SELECT 1"]
