"""The generic request-dedupe ledger (``services.request_dedupe``) on SQLite and MariaDB:
replay of the original response, refusal of a reused id, scope isolation, concurrent
duplicates, reserve/complete, provisional responses and retention."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import pytest
from sqlalchemy import Column, Integer, PrimaryKeyConstraint, String, Table, event, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db
from services.db_batch import (
    Write,
    execute_writes,
    execute_writes_if_absent,
    insert_if_absent_write,
    statements_of,
)
from services.errors import InvalidArgumentError
from services.invariants import InvariantError
from services.request_dedupe import (
    DedupeScope,
    DuplicateRequestRace,
    JoinedRecord,
    RequestIdReusedError,
    RequestKey,
    RequestLedger,
    StoredResponse,
    request_dedupe_table,
)
from services.request_retention import RequestRetention

metadata = db.new_metadata()
ledger_table = request_dedupe_table(metadata, "test_requests")
effects = Table(
    "test_effects",
    metadata,
    Column("org_id", String(db.ID_LEN), nullable=False),
    Column("effect_id", String(db.ID_LEN), nullable=False),
    Column("ordinal", Integer, nullable=False),
    PrimaryKeyConstraint("org_id", "effect_id"),
    **db.TABLE_OPTIONS,
)

SCOPE = DedupeScope("org-1", "inst-1", "cap-1", "b1")
OTHER_INSTALLATION = DedupeScope("org-1", "inst-2", "cap-1", "b1")


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(db_url, pool_size=5)
    async with db.transaction(eng) as conn:
        await conn.run_sync(metadata.create_all)
    yield eng
    await eng.dispose()


def key(scope: DedupeScope = SCOPE, rid: str = "req-1", digest: str = "d1") -> RequestKey:
    return RequestKey(scope, "Mutate", rid, digest)


async def count_effects(engine: AsyncEngine) -> int:
    async with db.transaction(engine, readonly=True) as conn:
        return int((await conn.execute(select(func.count()).select_from(effects))).scalar_one())


def effect_work(counter: list[int]) -> Callable[[AsyncConnection], Awaitable[int]]:
    async def work(conn: AsyncConnection) -> int:
        n = (await conn.execute(select(func.count()).select_from(effects))).scalar_one()
        await conn.execute(
            effects.insert().values(org_id="org-1", effect_id=uuid.uuid4().hex, ordinal=int(n) + 1)
        )
        counter.append(1)
        return int(n) + 1

    return work


async def test_retry_replays_the_original_response_without_running_again(
    engine: AsyncEngine,
) -> None:
    ledger = RequestLedger(ledger_table)
    calls: list[int] = []
    first = await ledger.execute(engine, key(), effect_work(calls), lambda n: b"effect-%d" % n)
    # The state moves on; a replay still answers what the first call answered.
    await ledger.execute(engine, key(rid="req-2"), effect_work(calls), lambda n: b"effect-%d" % n)
    retry = await ledger.execute(engine, key(), effect_work(calls), lambda n: b"effect-%d" % n)

    assert (first.response, first.replayed, first.value) == (b"effect-1", False, 1)
    assert (retry.response, retry.replayed, retry.value) == (b"effect-1", True, None)
    assert len(calls) == 2 and await count_effects(engine) == 2


async def test_reused_id_with_another_body_is_refused_before_any_work(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    calls: list[int] = []
    await ledger.execute(engine, key(), effect_work(calls), lambda n: b"x")
    with pytest.raises(RequestIdReusedError):
        await ledger.execute(engine, key(digest="d2"), effect_work(calls), lambda n: b"x")
    with pytest.raises(RequestIdReusedError):
        await ledger.reserve(engine, key(digest="d2"))
    assert len(calls) == 1 and await count_effects(engine) == 1


async def test_the_same_id_in_another_installation_is_another_request(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    calls: list[int] = []
    a = await ledger.execute(engine, key(), effect_work(calls), lambda n: b"%d" % n)
    # Even with another body: the other installation never learns the id was used.
    b = await ledger.execute(
        engine,
        key(OTHER_INSTALLATION, digest="d2"),
        effect_work(calls),
        lambda n: b"%d" % n,
    )
    assert (a.response, b.response) == (b"1", b"2") and not b.replayed


async def test_concurrent_duplicates_apply_once_and_answer_alike(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    calls: list[int] = []
    gate = asyncio.Event()

    async def work(conn: AsyncConnection) -> int:
        await gate.wait()
        value: int = await effect_work(calls)(conn)
        return value

    async def one() -> bytes | None:
        done = await ledger.execute(engine, key(), work, lambda n: b"effect-%d" % n)
        return done.response

    tasks = [asyncio.ensure_future(one()) for _ in range(4)]
    await asyncio.sleep(0.05)
    gate.set()
    answers = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert set(answers) == {b"effect-1"}
    assert await count_effects(engine) == 1


async def test_reserve_then_complete_keeps_the_first_completion(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    assert await ledger.reserve(engine, key()) is None
    # A retry while the first attempt runs: reserved, no response yet -> run again.
    assert await ledger.reserve(engine, key()) is None
    assert await ledger.complete(engine, key(), b"first") == b"first"
    assert await ledger.complete(engine, key(), b"second") == b"first"
    stored = await ledger.reserve(engine, key())
    assert stored is not None and (stored.payload, stored.completed) == (b"first", True)


async def test_once_replays_and_a_failed_attempt_leaves_no_row(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    runs: list[str] = []

    async def refused() -> str:
        runs.append("refused")
        raise InvalidArgumentError("plan_id is required", field_path="plan_id")

    async def ok() -> str:
        runs.append("ok")
        return "done"

    with pytest.raises(InvalidArgumentError):
        await ledger.once(engine, key(), refused, str.encode)
    # The refusal released its reservation: nothing is left, and the retry (even with
    # another body) is decided again.
    assert await ledger.replay(engine, key()) is None
    assert await ledger.once(engine, key(digest="d2"), ok, str.encode) == b"done"
    assert await ledger.once(engine, key(digest="d2"), ok, str.encode) == b"done"
    assert runs == ["refused", "ok"]
    with pytest.raises(RequestIdReusedError):
        await ledger.once(engine, key(digest="d1"), ok, str.encode)
    # release never drops a row that holds a response.
    await ledger.release(engine, key(digest="d2"))
    assert await ledger.replay(engine, key(digest="d2")) is not None


async def test_a_provisional_response_is_replayed_until_completed(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    calls: list[int] = []
    first = await ledger.execute(
        engine,
        key(),
        effect_work(calls),
        lambda n: b"accepted",
        completed=False,
    )
    assert (first.response, first.completed) == (b"accepted", False)
    again = await ledger.execute(engine, key(), effect_work(calls), lambda n: b"other")
    assert (again.response, again.replayed, again.completed) == (b"accepted", True, False)
    assert await ledger.complete(engine, key(), b"terminal") == b"terminal"
    final = await ledger.replay(engine, key())
    assert final is not None and (final.payload, final.completed) == (b"terminal", True)
    assert len(calls) == 1


async def test_an_encoder_that_declines_records_nothing(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    calls: list[int] = []
    declined = await ledger.execute(engine, key(), effect_work(calls), lambda n: None)
    assert declined.response is None and declined.value == 1
    assert await ledger.replay(engine, key()) is None


async def test_purge_removes_only_old_rows_of_the_org_in_bounded_batches(
    engine: AsyncEngine,
) -> None:
    ledger = RequestLedger(ledger_table)
    for i in range(5):
        await ledger.execute(engine, key(rid=f"old-{i}"), lambda c: asyncio.sleep(0), lambda v: b"")
    other_org = DedupeScope("org-2")
    await ledger.execute(engine, key(other_org), lambda c: asyncio.sleep(0), lambda v: b"")
    async with db.transaction(engine, readonly=True) as conn:
        now = await db.db_now(conn)
    cutoff = now + timedelta(seconds=1)  # everything so far is "old"
    sweep = RequestRetention(engine, ledger, retention=timedelta(hours=1))

    assert await sweep.orgs(after=None, limit=10) == ["org-1", "org-2"]
    assert await sweep.orgs(after="org-1", limit=10) == ["org-2"]
    assert await sweep.purge("org-1", older_than=cutoff, limit=3) == 3
    assert await sweep.purge("org-1", older_than=cutoff, limit=3) == 2
    assert await sweep.purge("org-1", older_than=cutoff, limit=3) == 0
    assert await ledger.replay(engine, key(other_org)) is not None  # another org untouched
    # Rows newer than the cutoff stay.
    await ledger.execute(engine, key(rid="new"), lambda c: asyncio.sleep(0), lambda v: b"n")
    assert await sweep.purge("org-1", older_than=now - timedelta(days=1)) == 0
    assert await ledger.replay(engine, key(rid="new")) is not None


async def test_retention_loop_purges_every_org_in_rotation(engine: AsyncEngine) -> None:
    ledger = RequestLedger(ledger_table)
    orgs = [f"org-{i}" for i in range(5)]
    for org in orgs:
        for i in range(3):
            await ledger.execute(
                engine,
                key(DedupeScope(org), rid=f"r{i}"),
                lambda c: asyncio.sleep(0),
                lambda v: b"",
            )
    await asyncio.sleep(0.01)  # every row is now older than the 1 ms window
    sweep = RequestRetention(
        engine, ledger, retention=timedelta(milliseconds=1), batch_size=2, org_batch=2
    )
    # 2 orgs per pass, 2 rows per transaction: three passes reach all five orgs.
    purged = [await sweep.sweep_once() for _ in range(3)]
    assert purged == [6, 6, 3]
    assert await sweep.orgs(after=None, limit=10) == []
    # A window longer than the rows' age keeps them.
    await ledger.execute(engine, key(), lambda c: asyncio.sleep(0), lambda v: b"kept")
    keep = RequestRetention(engine, ledger, retention=timedelta(hours=1))
    assert await keep.sweep_once() == 0
    async with keep:  # the loop lifecycle: starts, sweeps, shuts down
        await asyncio.sleep(0.01)
    assert keep.stopping and await ledger.replay(engine, key()) is not None


async def test_the_clocked_lookup_reads_the_ledger_and_the_clock_in_one_statement(
    engine: AsyncEngine,
) -> None:
    """``execute_at_txn`` (the record engine's path): the lookup also returns the database
    clock — for a new request too — which ``work`` gets and the ledger row keeps as its
    ``created_at``; a retry replays, a reused id with another body is refused, and a
    reserved row takes the response, exactly as with ``execute_txn``."""
    ledger = RequestLedger(ledger_table)
    seen: list[object] = []

    async def work(conn: AsyncConnection, now: object) -> int:
        seen.append(now)
        return 7

    async def run(k: RequestKey) -> object:
        async def fn(conn: AsyncConnection) -> object:
            return await ledger.execute_at_txn(conn, k, work, lambda n: b"seven-%d" % n)

        return await db.run_in_transaction(engine, fn)

    async with db.transaction(engine, readonly=True) as conn:
        before = await db.db_now(conn)
        stored, clock = await ledger.lookup_clocked_txn(conn, key(rid="clock-new"))
    assert stored is None and clock.tzinfo is not None and clock >= before

    first = await run(key(rid="clock-1"))
    assert getattr(first, "response", None) == b"seven-7" and len(seen) == 1
    async with db.transaction(engine, readonly=True) as conn:
        created = (
            await conn.execute(
                select(ledger_table.c.created_at).where(ledger_table.c.request_id == "clock-1")
            )
        ).scalar_one()
        stored, _ = await ledger.lookup_clocked_txn(conn, key(rid="clock-1"))
    assert created == seen[0]
    assert stored is not None and stored.payload == b"seven-7" and stored.completed

    again = await run(key(rid="clock-1"))
    assert getattr(again, "replayed", False) and len(seen) == 1  # replayed, work not run
    with pytest.raises(RequestIdReusedError):
        await run(key(rid="clock-1", digest="d2"))
    assert len(seen) == 1

    assert await ledger.reserve(engine, key(rid="clock-2")) is None
    reserved = await run(key(rid="clock-2"))
    assert getattr(reserved, "response", None) == b"seven-7" and len(seen) == 2
    assert (await ledger.reserve(engine, key(rid="clock-2"))) == StoredResponse(b"seven-7", True)


_INSERT_EFFECT = effects.insert()


def _effect_insert(effect_id: str, ordinal: int) -> Write:
    return Write(_INSERT_EFFECT, {"org_id": "org-1", "effect_id": effect_id, "ordinal": ordinal})


async def _ledger_rows(engine: AsyncEngine, rid: str) -> int:
    async with db.transaction(engine, readonly=True) as conn:
        stmt = select(func.count()).where(ledger_table.c.request_id == rid)
        return int((await conn.execute(stmt)).scalar_one())


async def test_a_joined_record_rides_last_in_the_works_round_trip(engine: AsyncEngine) -> None:
    """``execute_joined_at``: the work puts the ledger row's INSERT last in its own round
    trip (one batched statement on MariaDB, one by one on SQLite) — recorded once, with
    the value the work returned; a retry replays it without running the work."""
    ledger = RequestLedger(ledger_table)
    batches: list[list[str]] = []

    def on_execute(*args: object) -> None:
        batches.append([" ".join(s.split())[:30] for s in statements_of(str(args[2]))])

    async def work(conn: AsyncConnection, now: object, joined: JoinedRecord[int] | None) -> int:
        writes = [_effect_insert(uuid.uuid4().hex, 1)]
        assert joined is not None
        recording = joined.write(1)
        assert recording is not None
        await execute_writes(conn, [*writes, recording])
        return 1

    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        done = await ledger.execute_joined_at(engine, key(rid="j-1"), work, lambda n: b"one-%d" % n)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", on_execute)
    assert (done.value, done.response, done.replayed, done.completed) == (1, b"one-1", False, True)
    ledger_inserts = [b for b in batches if any("INSERT INTO test_requests" in s for s in b)]
    assert len(ledger_inserts) == 1
    if db.strategy_for(engine.dialect).multi_statements:
        assert ledger_inserts[0][0].startswith("INSERT INTO test_effects")
    assert await _ledger_rows(engine, "j-1") == 1
    again = await ledger.execute_joined_at(engine, key(rid="j-1"), work, lambda n: b"other")
    assert (again.response, again.replayed) == (b"one-1", True)
    assert await count_effects(engine) == 1


async def test_a_joined_record_that_did_not_run_is_recorded_after_the_work(
    engine: AsyncEngine,
) -> None:
    """The round trip stopped before the ledger's write (an insert-if-absent found its
    row), or the work never executed it: the ledger records the value the work returned,
    after it — as ``execute_at`` does."""
    ledger = RequestLedger(ledger_table)
    async with db.transaction(engine) as conn:
        await conn.execute(effects.insert().values(org_id="org-1", effect_id="e-1", ordinal=1))

    async def present(conn: AsyncConnection, now: object, joined: JoinedRecord[int] | None) -> int:
        assert joined is not None
        recording = joined.write(1)
        assert recording is not None
        values = {"org_id": "org-1", "effect_id": "e-1", "ordinal": 1}
        if await execute_writes_if_absent(
            conn, [insert_if_absent_write(effects, values), recording]
        ):
            return 1
        return 2  # the existing row answers

    done = await ledger.execute_joined_at(engine, key(rid="j-2"), present, lambda n: b"n-%d" % n)
    assert (done.value, done.response) == (2, b"n-2")

    async def unused(conn: AsyncConnection, now: object, joined: JoinedRecord[int] | None) -> int:
        assert joined is not None and joined.write(3) is not None
        return 3

    late = await ledger.execute_joined_at(engine, key(rid="j-3"), unused, lambda n: b"n-%d" % n)
    assert late.response == b"n-3"
    for rid, payload in (("j-2", b"n-2"), ("j-3", b"n-3")):
        stored = await ledger.replay(engine, key(rid=rid))
        assert stored == StoredResponse(payload, True) and await _ledger_rows(engine, rid) == 1


async def test_a_joined_record_that_ran_for_another_value_is_an_invariant_error(
    engine: AsyncEngine,
) -> None:
    ledger = RequestLedger(ledger_table)

    async def lying(conn: AsyncConnection, now: object, joined: JoinedRecord[int] | None) -> int:
        assert joined is not None
        recording = joined.write(1)
        assert recording is not None
        await execute_writes(conn, [recording])
        return 2

    with pytest.raises(InvariantError):
        await ledger.execute_joined_at(engine, key(rid="j-4"), lying, lambda n: b"n-%d" % n)
    assert await _ledger_rows(engine, "j-4") == 0  # rolled back


async def test_a_joined_record_whose_key_was_recorded_meanwhile_is_a_race(
    engine: AsyncEngine,
) -> None:
    """A concurrent duplicate recorded the key after the lookup: the joined INSERT's
    duplicate key is :class:`DuplicateRequestRace` (the transaction rolls back whole and
    replays the winner)."""
    ledger = RequestLedger(ledger_table)
    k = key(rid="j-5")

    async def raced(conn: AsyncConnection, now: object, joined: JoinedRecord[int] | None) -> int:
        assert joined is not None
        await ledger.record_txn(conn, k, b"winner")  # the duplicate, in this transaction
        recording = joined.write(1)
        assert recording is not None
        await execute_writes(conn, [_effect_insert("e-5", 5), recording])
        return 1

    async def fn(conn: AsyncConnection) -> object:
        return await ledger.execute_joined_at_txn(conn, k, raced, lambda n: b"n-%d" % n)

    with pytest.raises(DuplicateRequestRace):
        await db.run_in_transaction(engine, fn)
    assert await _ledger_rows(engine, "j-5") == 0 and await count_effects(engine) == 0


async def test_a_reserved_key_gets_no_joined_record(engine: AsyncEngine) -> None:
    """A reserved row takes the response by its UPDATE after the work: the work is offered
    no joined write."""
    ledger = RequestLedger(ledger_table)
    assert await ledger.reserve(engine, key(rid="j-6")) is None
    offered: list[object] = []

    async def work(conn: AsyncConnection, now: object, joined: JoinedRecord[int] | None) -> int:
        offered.append(joined)
        return 6

    done = await ledger.execute_joined_at(engine, key(rid="j-6"), work, lambda n: b"n-%d" % n)
    assert offered == [None] and done.response == b"n-6"
    assert await ledger.replay(engine, key(rid="j-6")) == StoredResponse(b"n-6", True)
