"""The generic outbox on a real table (``owner_outbox``), SQLite and MariaDB: enqueue in
the caller's transaction, leases with fencing tokens, jittered retry and the delivery
budget, acceptance reconciliation, the finalizer hook, the repair sweep and the
org-scoped operator read path."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.schema import owner_outbox
from services.db import db_now, run_in_transaction, transaction
from services.digest import canonical_json, versioned_digest
from services.errors import ConflictError, FenceLostError
from services.outbox import (
    AcceptedReceipt,
    Delivered,
    DeliveryPolicy,
    DeliveryResult,
    DeliveryState,
    FamilyRegistry,
    FinalizationTicket,
    MessageFamily,
    NewOutboxMessage,
    OutboxDispatcher,
    OutboxMessage,
    ReconcileResult,
    Refused,
    RejectedReceipt,
    RetryLater,
    UnknownReceipt,
    count_by_state,
    enqueue_txn,
    get_message,
    list_messages,
)
from services.outbox.store import claim_txn
from tests.support.dbs import new_org

FAST = DeliveryPolicy(
    max_attempts=3, base_delay_ms=1, max_delay_ms=2, lease_ms=30_000, reconcile_max_attempts=2
)


def _message(org: str, key: str = "k1", payload: object = None) -> NewOutboxMessage:
    """A message of the org's own family (``family_of(org)``), so dispatchers of tests
    sharing the module database never deliver each other's messages."""
    body = canonical_json(payload if payload is not None else {"n": 1}).decode()
    return NewOutboxMessage(
        org_id=org,
        app_installation_id="inst-1",
        runtime_capability_id="cap-1",
        runtime_work_binding_digest=versioned_digest("binding", [org]),
        message_id=f"msg-{key}",
        family=family_of(org),
        key=key,
        payload=body,
        payload_digest=versioned_digest("payload", body),
    )


def family_of(org: str) -> str:
    return f"test.{org}"


async def _enqueue(engine: AsyncEngine, msg: NewOutboxMessage) -> None:
    async def fn(conn: AsyncConnection) -> None:
        await enqueue_txn(conn, OWNER_OUTBOX, msg)

    await run_in_transaction(engine, fn)


async def _get(engine: AsyncEngine, org: str, key: str = "k1") -> OutboxMessage:
    async with transaction(engine, readonly=True) as conn:
        found = await get_message(conn, OWNER_OUTBOX, org, f"msg-{key}")
    assert found is not None
    return found


@dataclass
class Consumer:
    """A scripted consumer: pops one result per delivery, counts what it received."""

    results: list[DeliveryResult] = field(default_factory=list)
    reconciles: list[ReconcileResult] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    reconciled: list[str] = field(default_factory=list)

    async def deliver(self, message: OutboxMessage) -> DeliveryResult:
        self.received.append(message.key)
        return self.results.pop(0) if self.results else Delivered()

    async def reconcile(self, message: OutboxMessage) -> ReconcileResult:
        self.reconciled.append(message.key)
        return self.reconciles.pop(0) if self.reconciles else AcceptedReceipt()


@dataclass
class RecordingFinalizer:
    """A fake family finalizer: its 'convergence' is a counter, then the ticket commit."""

    engine: AsyncEngine
    fail: bool = False
    fail_after_commit: bool = False
    calls: list[str] = field(default_factory=list)

    async def finalize(self, ticket: FinalizationTicket) -> None:
        self.calls.append(ticket.disposition.value)
        if self.fail:
            raise RuntimeError("finalizer not ready")
        async with transaction(self.engine) as conn:
            await ticket.commit_txn(conn)
            if self.fail_after_commit:
                raise RuntimeError("convergence failed after the outbox write")


def _dispatcher(engine: AsyncEngine, *families: MessageFamily) -> OutboxDispatcher:
    return OutboxDispatcher(
        engine,
        OWNER_OUTBOX,
        FamilyRegistry(families),
        owner="test-dispatcher",
        rng=random.Random(7),
    )


async def _until(
    fn: Callable[[], Awaitable[object]], done: Callable[[], bool], rounds: int = 50
) -> None:
    for _ in range(rounds):
        if done():
            return
        await fn()
        await asyncio.sleep(0.005)
    assert done(), "condition not reached within bounded rounds"


async def test_enqueue_is_idempotent_and_a_different_message_conflicts(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    await _enqueue(engine, _message(org))  # the caller's own retry: no second row

    async def conflicting(conn: AsyncConnection) -> None:
        await enqueue_txn(conn, OWNER_OUTBOX, _message(org, payload={"n": 2}))

    with pytest.raises(ConflictError):
        await run_in_transaction(engine, conflicting)
    async with transaction(engine, readonly=True) as conn:
        n = (
            await conn.execute(
                select(func.count()).select_from(owner_outbox).where(owner_outbox.c.org_id == org)
            )
        ).scalar_one()
    assert n == 1


async def test_enqueue_commits_or_rolls_back_with_the_callers_transaction(
    engine: AsyncEngine,
) -> None:
    org = new_org()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with transaction(engine) as conn:
            await enqueue_txn(conn, OWNER_OUTBOX, _message(org))
            raise Boom
    async with transaction(engine, readonly=True) as conn:
        assert await get_message(conn, OWNER_OUTBOX, org, "msg-k1") is None


async def test_delivered_after_the_consumer_acknowledges(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer()
    d = _dispatcher(engine, MessageFamily(family_of(org), consumer.deliver, policy=FAST))
    await _until(d.deliver_once, lambda: bool(consumer.received))
    msg = await _get(engine, org)
    assert msg.delivery_state is DeliveryState.DELIVERED
    assert msg.delivery_attempts == 1 and msg.delivered_at is not None
    assert msg.lease_token is None
    assert consumer.received == ["k1"]


async def test_transient_failures_retry_with_backoff_then_deliver(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[RetryLater("unavailable"), RetryLater("unavailable")])
    d = _dispatcher(engine, MessageFamily(family_of(org), consumer.deliver, policy=FAST))
    await d.deliver_once()
    msg = await _get(engine, org)
    assert msg.delivery_state is DeliveryState.RETRYING
    assert msg.last_error_code == "unavailable" and msg.delivery_attempts == 1
    await _until(d.deliver_once, lambda: len(consumer.received) == 3)
    msg = await _get(engine, org)
    assert msg.delivery_state is DeliveryState.DELIVERED and msg.delivery_attempts == 3


async def test_budget_exhaustion_without_reconciler_dead_letters(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[RetryLater("unavailable")] * 5)
    d = _dispatcher(engine, MessageFamily(family_of(org), consumer.deliver, policy=FAST))
    await _until(d.deliver_once, lambda: len(consumer.received) == FAST.max_attempts)
    msg = await _get(engine, org)
    assert msg.delivery_state is DeliveryState.DEAD_LETTERED
    await d.deliver_once()
    assert len(consumer.received) == FAST.max_attempts  # terminal: never claimed again


async def test_exhaustion_reconciles_and_an_accepted_receipt_repairs_delivery(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[RetryLater("lost_ack")] * 5, reconciles=[AcceptedReceipt()])
    fam = MessageFamily(family_of(org), consumer.deliver, reconcile=consumer.reconcile, policy=FAST)
    d = _dispatcher(engine, fam)
    await _until(d.deliver_once, lambda: bool(consumer.reconciled))
    msg = await _get(engine, org)
    assert msg.delivery_state is DeliveryState.DELIVERED
    assert len(consumer.received) == FAST.max_attempts


async def test_refusal_goes_to_reconciliation_at_once(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[Refused("rejected_key")], reconciles=[RejectedReceipt()])
    finalizer = RecordingFinalizer(engine)
    fam = MessageFamily(
        family_of(org),
        consumer.deliver,
        reconcile=consumer.reconcile,
        finalizer=finalizer,
        policy=FAST,
    )
    d = _dispatcher(engine, fam)
    await _until(d.deliver_once, lambda: bool(finalizer.calls))
    msg = await _get(engine, org)
    assert len(consumer.received) == 1
    assert finalizer.calls == ["rejected"]
    assert msg.delivery_state is DeliveryState.HANDOFF_REJECTED


async def test_rejection_is_terminal_only_after_the_finalizer_succeeded(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[Refused("x")], reconciles=[RejectedReceipt()])
    finalizer = RecordingFinalizer(engine, fail=True)
    fam = MessageFamily(
        family_of(org),
        consumer.deliver,
        reconcile=consumer.reconcile,
        finalizer=finalizer,
        policy=FAST,
    )
    d = _dispatcher(engine, fam)
    await _until(d.deliver_once, lambda: bool(finalizer.calls))
    assert (await _get(engine, org)).delivery_state is DeliveryState.REJECTED  # pre-final
    # A finalizer whose own transaction fails after the outbox write rolls it back too.
    finalizer.fail, finalizer.fail_after_commit = False, True
    await d.sweep_once()
    assert (await _get(engine, org)).delivery_state is DeliveryState.REJECTED
    finalizer.fail_after_commit = False
    report = await d.sweep_once()
    assert report.finalized == 1
    assert (await _get(engine, org)).delivery_state is DeliveryState.HANDOFF_REJECTED
    assert finalizer.calls == ["rejected"] * 3


async def test_unknown_receipt_is_dead_lettered_by_the_finalizer(engine: AsyncEngine) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[Refused("x")], reconciles=[UnknownReceipt("digest_conflict")])
    finalizer = RecordingFinalizer(engine)
    fam = MessageFamily(
        family_of(org),
        consumer.deliver,
        reconcile=consumer.reconcile,
        finalizer=finalizer,
        policy=FAST,
    )
    await _until(_dispatcher(engine, fam).deliver_once, lambda: bool(finalizer.calls))
    msg = await _get(engine, org)
    assert finalizer.calls == ["unknown"]
    assert msg.delivery_state is DeliveryState.DEAD_LETTERED
    assert msg.last_error_code == "digest_conflict"


async def test_lost_reconcile_responses_exhaust_into_acceptance_unknown(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    consumer = Consumer(results=[Refused("x")], reconciles=[RetryLater("unavailable")] * 10)
    fam = MessageFamily(family_of(org), consumer.deliver, reconcile=consumer.reconcile, policy=FAST)
    d = _dispatcher(engine, fam)
    # The budget counts every attempt: one refused delivery, then reconciliations up to
    # max_attempts + reconcile_max_attempts in total.
    budget = FAST.max_attempts + FAST.reconcile_max_attempts - 1
    await _until(d.deliver_once, lambda: len(consumer.reconciled) >= budget)
    msg = await _get(engine, org)
    # No finalizer registered yet: the receipt is persisted, the message stays pre-final.
    assert msg.delivery_state is DeliveryState.UNKNOWN
    assert msg.last_error_code == "reconciliation_exhausted"
    report = await d.sweep_once()
    assert report.pre_final_waiting == 1
    assert (await _get(engine, org)).delivery_state is DeliveryState.UNKNOWN


async def test_two_dispatchers_claim_one_message_and_exactly_one_wins(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    msg = await _get(engine, org)

    async def claim(owner: str) -> OutboxMessage | None:
        async def fn(conn: AsyncConnection) -> OutboxMessage:
            now = await db_now(conn)
            return await claim_txn(
                conn,
                OWNER_OUTBOX,
                msg,
                owner=owner,
                lease_until=now + timedelta(seconds=30),
                now=now,
            )

        try:
            return await run_in_transaction(engine, fn)
        except FenceLostError:
            return None

    results = await asyncio.gather(claim("a"), claim("b"))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert winners[0].delivery_state is DeliveryState.DELIVERING


async def test_expired_lease_is_repaired_and_redelivered_and_the_stale_result_is_fenced(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    await _enqueue(engine, _message(org))
    msg = await _get(engine, org)

    async def stale_claim(conn: AsyncConnection) -> OutboxMessage:
        now = await db_now(conn)
        # A dispatcher that claimed and then died: its lease is already over.
        return await claim_txn(
            conn, OWNER_OUTBOX, msg, owner="dead", lease_until=now - timedelta(seconds=1), now=now
        )

    stale = await run_in_transaction(engine, stale_claim)
    consumer = Consumer()
    fam = MessageFamily(family_of(org), consumer.deliver, policy=FAST)
    d = _dispatcher(engine, fam)
    report = await d.sweep_once()
    assert report.leases_expired == 1
    repaired = await _get(engine, org)
    assert repaired.delivery_state is DeliveryState.RETRYING
    assert repaired.last_error_code == "lease_expired" and repaired.delivery_attempts == 1
    await _until(d.deliver_once, lambda: bool(consumer.received))
    assert (await _get(engine, org)).delivery_state is DeliveryState.DELIVERED

    # The dead dispatcher's late result loses the fence and changes nothing.
    from services.outbox.model import Transition
    from services.outbox.store import apply_txn

    async def late(conn: AsyncConnection) -> OutboxMessage:
        now = await db_now(conn)
        t = Transition(DeliveryState.DEAD_LETTERED, 9, now, "late")
        return await apply_txn(conn, OWNER_OUTBOX, stale, t, now=now)

    with pytest.raises(FenceLostError):
        await run_in_transaction(engine, late)
    assert (await _get(engine, org)).delivery_state is DeliveryState.DELIVERED


async def test_operator_reads_are_org_scoped(engine: AsyncEngine) -> None:
    org_a, org_b = new_org(), new_org()
    await _enqueue(engine, _message(org_a, "k1"))
    await _enqueue(engine, _message(org_a, "k2"))
    await _enqueue(engine, _message(org_b, "k1"))
    received: list[str] = []

    async def refuse_k2(message: OutboxMessage) -> DeliveryResult:
        received.append(message.key)
        return Refused("x") if message.key == "k2" else Delivered()

    d = _dispatcher(
        engine,
        MessageFamily(family_of(org_a), refuse_k2, policy=FAST),
        MessageFamily(family_of(org_b), refuse_k2, policy=FAST),
    )
    await _until(d.deliver_once, lambda: len(received) >= 3)
    async with transaction(engine, readonly=True) as conn:
        a_all = await list_messages(conn, OWNER_OUTBOX, org_a)
        a_dead = await list_messages(
            conn, OWNER_OUTBOX, org_a, states=[DeliveryState.DEAD_LETTERED]
        )
        counts_b = await count_by_state(conn, OWNER_OUTBOX, org_b)
        page = await list_messages(conn, OWNER_OUTBOX, org_a, after_id="msg-k1")
        missing = await get_message(conn, OWNER_OUTBOX, new_org(), "msg-k1")
    assert [m.key for m in a_all] == ["k1", "k2"]
    assert {m.org_id for m in a_all} == {org_a}
    assert len(a_dead) == 1
    assert sum(counts_b.values()) == 1
    assert [m.key for m in page] == ["k2"]
    assert missing is None
