"""Pre-claimed enqueue of the generic outbox (ADR 0004) on a real table (``owner_outbox``),
SQLite and MariaDB: a producer's transaction writes the row already leased to its own
process's dispatcher and hands the leased message over after the commit, so the delivery
runs without a claim transaction — and the lease keeps every fence: the handed message
is exactly the stored row, a pre-claimed row is invisible to other dispatchers while its
lease holds, a producer that dies before handing it over leaves a row the repair sweep
returns to ``Retrying`` when the lease expires (delivered once, attempt counted), and a
stale handed message loses the recording fence. Also: the claim and record transactions
return exactly the stored row without re-reading it."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.schema import owner_outbox
from services.background import LoopGroup, Wakeup
from services.db import db_now, run_in_transaction
from services.outbox import (
    Delivered,
    DeliveryResult,
    DeliveryState,
    EnqueueResult,
    FamilyRegistry,
    MessageFamily,
    NewOutboxMessage,
    OutboxDispatcher,
    OutboxMessage,
    PreClaim,
    enqueue_txn,
)
from services.outbox.model import Transition
from services.outbox.store import apply_txn, claim_txn
from tests.integration.outbox.test_outbox_hints import (
    POLICY,
    Consumer,
    _dispatcher,
    _message,
    _state,
)
from tests.support.dbs import new_org


async def _enqueue(
    engine: AsyncEngine, msg: NewOutboxMessage, preclaim: PreClaim | None
) -> EnqueueResult:
    async def fn(conn: AsyncConnection) -> EnqueueResult:
        return await enqueue_txn(conn, OWNER_OUTBOX, msg, preclaim=preclaim)

    return await run_in_transaction(engine, fn)


async def _until_delivered(engine: AsyncEngine, org: str) -> None:
    for _ in range(1000):  # bounded
        if (await _state(engine, org)).delivery_state is DeliveryState.DELIVERED:
            return
        await asyncio.sleep(0.01)


def _woken(engine: AsyncEngine, org: str, consumer: Consumer, **kw: float) -> OutboxDispatcher:
    d = _dispatcher(engine, org, consumer, **kw)
    d.loops("preclaim", wake=Wakeup())  # a woken delivery loop: pre-claims are offered
    return d


async def test_only_a_woken_dispatcher_of_the_family_offers_a_preclaim(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    polling = _dispatcher(engine, org, Consumer())
    assert polling.preclaim(f"test.{org}") is None  # nobody would be handed the row
    woken = _woken(engine, org, Consumer())
    assert woken.preclaim("another.family") is None
    lease = woken.preclaim(f"test.{org}")
    assert lease == PreClaim("hinted", 30_000)


async def test_a_preclaimed_row_is_born_leased_and_the_handed_message_is_the_stored_row(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    consumer = Consumer()
    d = _woken(engine, org, consumer)
    result = await _enqueue(engine, _message(org), d.preclaim(f"test.{org}"))
    leased = result.leased
    assert result.created and leased is not None
    stored = await _state(engine, org)
    assert leased == stored
    assert stored.delivery_state is DeliveryState.DELIVERING and stored.delivery_attempts == 0
    assert stored.lease_owner == "hinted" and stored.lease_token
    assert stored.lease_until is not None and stored.next_attempt_at == stored.lease_until
    # While the lease holds nobody else discovers or claims it.
    other = _dispatcher(engine, org, Consumer())
    assert await other.deliver_once() == 0
    # A duplicate enqueue is not leased again and changes nothing.
    again = await _enqueue(engine, _message(org), d.preclaim(f"test.{org}"))
    assert not again.created and again.leased is None
    assert await _state(engine, org) == stored


async def test_a_handed_message_is_delivered_without_any_claim(engine: AsyncEngine) -> None:
    org = new_org()
    consumer = Consumer()
    wake = Wakeup()
    d = _dispatcher(engine, org, consumer, idle_s=30.0)

    async def no_poll() -> int:
        raise AssertionError("a handed message needs no discovery")

    async def no_claim(*args: object, **kw: object) -> None:
        raise AssertionError("a handed message needs no claim")

    d.deliver_once = no_poll  # type: ignore[method-assign]
    d.process_hint = no_claim  # type: ignore[method-assign,assignment]
    async with LoopGroup(d.loops("preclaim", wake=wake)):
        result = await _enqueue(engine, _message(org), d.preclaim(f"test.{org}"))
        assert result.leased is not None
        d.hand(result.leased)
        await _until_delivered(engine, org)
    msg = await _state(engine, org)
    assert msg.delivery_state is DeliveryState.DELIVERED and msg.delivery_attempts == 1
    assert msg.lease_token is None and consumer.received == ["k1"]


async def test_a_preclaimed_row_never_handed_over_is_repaired_after_its_lease(
    engine: AsyncEngine,
) -> None:
    """The producer's process died after the commit, before handing the message over:
    the row is ``Delivering`` under a lease nobody holds. When it expires the repair
    sweep returns it to ``Retrying`` (the lost attempt counted) and any dispatcher
    delivers it once."""
    org = new_org()
    d = _woken(engine, org, Consumer())
    result = await _enqueue(engine, _message(org), d.preclaim(f"test.{org}"))
    assert result.leased is not None

    async def expire(conn: AsyncConnection) -> None:  # fast-forward past the lease
        now = await db_now(conn)
        await conn.execute(
            update(owner_outbox)
            .where(owner_outbox.c.org_id == org)
            .values(lease_until=now - timedelta(seconds=1), next_attempt_at=now)
        )

    await run_in_transaction(engine, expire)
    consumer = Consumer()
    survivor = _dispatcher(engine, org, consumer)
    report = await survivor.sweep_once()
    assert report.leases_expired == 1
    repaired = await _state(engine, org)
    assert repaired.delivery_state is DeliveryState.RETRYING and repaired.delivery_attempts == 1
    assert repaired.lease_token is None
    for _ in range(200):  # bounded: the retry backoff is a few ms
        if await survivor.deliver_once():
            break
        await asyncio.sleep(0.01)
    done = await _state(engine, org)
    assert done.delivery_state is DeliveryState.DELIVERED and consumer.received == ["k1"]
    # The dead producer's message, handed over late (a stale copy), loses every fence.
    late = _woken(engine, org, consumer)
    assert await late._guarded_leased(result.leased) == 1
    assert consumer.received == ["k1", "k1"]  # at-least-once: the consumer deduplicates
    assert await _state(engine, org) == done  # but nothing is recorded over the new state


async def test_claim_and_record_return_exactly_the_stored_row(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org), None)
    pending = await _state(engine, org)

    async def claim(conn: AsyncConnection) -> OutboxMessage:
        now = await db_now(conn)
        return await claim_txn(
            conn,
            OWNER_OUTBOX,
            pending,
            owner="o",
            lease_until=now.replace(year=now.year + 1),
            now=now,
        )

    leased = await run_in_transaction(engine, claim)
    assert leased == await _state(engine, org)

    async def record(conn: AsyncConnection) -> OutboxMessage:
        now = await db_now(conn)
        delivered = Transition(DeliveryState.DELIVERED, 1, now, None, delivered=True)
        return await apply_txn(conn, OWNER_OUTBOX, leased, delivered, now=now)

    recorded = await run_in_transaction(engine, record)
    assert recorded == await _state(engine, org)
    assert recorded.delivery_state is DeliveryState.DELIVERED and recorded.lease_token is None


class _OneSlow:
    """Holds the delivery of key ``slow`` until released; every other key at once."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.release = asyncio.Event()

    async def deliver(self, message: OutboxMessage) -> DeliveryResult:
        self.received.append(message.key)
        if message.key == "slow":
            await asyncio.wait_for(self.release.wait(), timeout=10)
        return Delivered()


async def test_a_message_handed_during_a_slow_delivery_is_not_held_behind_it(
    engine: AsyncEngine,
) -> None:
    """The delivery loop does not await the batch it started: a message handed over
    while an earlier delivery is still waiting for its consumer is delivered at once.
    Stopping settles what is still in flight."""
    org = new_org()
    consumer = _OneSlow()
    family = MessageFamily(f"test.{org}", consumer.deliver, policy=POLICY)
    d = OutboxDispatcher(engine, OWNER_OUTBOX, FamilyRegistry([family]), owner="hinted")
    wake = Wakeup()
    loops = LoopGroup(d.loops("preclaim", wake=wake))
    async with loops:
        for key in ("slow", "fast"):
            result = await _enqueue(engine, _message(org, key), d.preclaim(f"test.{org}"))
            assert result.leased is not None
            d.hand(result.leased)
            await asyncio.sleep(0)  # the first one is in flight before the second arrives
        for _ in range(1000):  # bounded
            if (await _state(engine, org, "fast")).delivery_state is DeliveryState.DELIVERED:
                break
            await asyncio.sleep(0.01)
        assert (await _state(engine, org, "fast")).delivery_state is DeliveryState.DELIVERED
        assert (await _state(engine, org, "slow")).delivery_state is DeliveryState.DELIVERING
        consumer.release.set()
    await d.settle()
    assert (await _state(engine, org, "slow")).delivery_state is DeliveryState.DELIVERED
    assert sorted(consumer.received) == ["fast", "slow"]


async def _deliver_handed_with_polls(engine: AsyncEngine, *, drop_hints: bool) -> int:
    """Discovery passes of one woken delivery iteration that starts one handed message,
    after ``drop_hints`` overflowed the wakeup's hint bound (the iteration is run
    directly: no timed poll can interleave)."""
    org = new_org()
    consumer = Consumer()
    wake = Wakeup(max_hints=1)
    d = _dispatcher(engine, org, consumer, idle_s=3600.0)
    deliver_loop = d.loops("named", wake=wake)[0]
    polls = 0
    discover = d.deliver_once

    async def counted() -> int:
        nonlocal polls
        polls += 1
        return await discover()

    d.deliver_once = counted  # type: ignore[method-assign]
    if drop_hints:  # hints of another table; the second drops the first
        wake.notify("elsewhere-1")
        wake.notify("elsewhere-2")
    result = await _enqueue(engine, _message(org), d.preclaim(f"test.{org}"))
    assert result.leased is not None
    d.hand(result.leased)
    assert await deliver_loop.run_once() is False
    await _until_delivered(engine, org)  # the handed delivery runs as a task
    await d.settle()
    assert consumer.received == ["k1"]
    return polls


async def test_a_wake_that_named_its_message_runs_no_discovery_pass(engine: AsyncEngine) -> None:
    """Round 6: the handed message was all the wake named, so no discovery query
    follows it and the idle polls keep their schedule (``wake_resets=False``)."""
    assert await _deliver_handed_with_polls(engine, drop_hints=False) == 0


async def test_a_wake_that_dropped_hints_runs_the_discovery_pass(engine: AsyncEngine) -> None:
    """A hint lost to the wakeup's bound may name a committed message only a poll finds
    now: the woken iteration polls after starting the handed delivery."""
    assert await _deliver_handed_with_polls(engine, drop_hints=True) == 1


def test_named_wakes_do_not_restart_the_delivery_loops_backoff(engine: AsyncEngine) -> None:
    """Only the woken delivery loop serves named work; a loop without a wakeup (and the
    sweep) keeps the default."""
    org = new_org()
    woken = _dispatcher(engine, org, Consumer()).loops("w", wake=Wakeup())
    plain = _dispatcher(engine, org, Consumer()).loops("p")
    assert [loop._wake_resets for loop in woken] == [False, True]
    assert [loop._wake_resets for loop in plain] == [True, True]


async def test_a_message_handed_while_the_delivery_loop_runs_starts_at_once(
    engine: AsyncEngine,
) -> None:
    """Round 6: while the woken delivery loop runs, :meth:`hand` starts the delivery
    itself (no wake, no pass of the loop in between); once the loops stopped, a handed
    message is only queued — its lease expires and the sweep repairs it (ADR 0004)."""
    org = new_org()
    consumer = Consumer()
    wake = Wakeup()
    d = _dispatcher(engine, org, consumer, idle_s=3600.0)
    group = LoopGroup(d.loops("direct", wake=wake))
    async with group:
        for _ in range(1000):  # bounded: the delivery loop is iterating
            if d._deliver_loop is not None and d._deliver_loop.running:
                break
            await asyncio.sleep(0.01)

        async def not_the_loop() -> int:
            raise AssertionError("the delivery must not wait for the loop's iteration")

        d.deliver_handed = not_the_loop  # type: ignore[method-assign]
        result = await _enqueue(engine, _message(org), d.preclaim(f"test.{org}"))
        assert result.leased is not None
        d.hand(result.leased)
        await _until_delivered(engine, org)
        assert consumer.received == ["k1"]
    await d.settle()
    assert d._deliver_loop is not None and not d._deliver_loop.running
    second = await _enqueue(engine, _message(org, key="k2"), d.preclaim(f"test.{org}"))
    assert second.leased is not None
    d.hand(second.leased)
    assert list(d._handed) == [second.leased] and not d._inflight
    assert consumer.received == ["k1"]
