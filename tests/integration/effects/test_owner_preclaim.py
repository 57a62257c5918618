"""The pre-claimed command (ADR 0008), on SQLite and MariaDB against the REAL local SMTP
sink: an acceptance in a process whose dispatcher has room commits the command leased to
that dispatcher with its first remote attempt IN_FLIGHT, and the provider call starts
after that COMMIT with no claim transaction; a duplicate, a refusal or a dispatcher
without room never leases (the seat is given back, the command waits ``ACCEPTED`` for
the ordinary claim). Effects are counted at the SMTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.commands.model import AttemptOutcome, CommandState
from effect_owner_svc.dispatcher import commands as dispatch_module
from effect_owner_svc.dispatcher.commands import CommandDispatcher, CommandSeats
from services.background import LoopGroup, Wakeup
from services.db import strategy_for
from services.db_batch import statements_of
from services.proto import effect_v1
from tests.integration.effects.harness import Scope, envelope
from tests.integration.effects.owner_world import World, accept, world_with

_DISPATCHING = effect_v1.CommandState.COMMAND_STATE_DISPATCHING
_ACCEPTED = effect_v1.CommandState.COMMAND_STATE_ACCEPTED


@asynccontextmanager
async def preclaiming(
    engine: AsyncEngine,
    private_key: Ed25519PrivateKey,
    tmp: Path,
    *,
    concurrency: int = 8,
    on_accepted: Callable[[Any], None] | None = None,
) -> AsyncIterator[tuple[World, CommandDispatcher, Wakeup]]:
    """The owner service with a running, woken command dispatcher its acceptances
    pre-claim for (the production wiring of ``effect_owner_svc.app``)."""
    seats, wake = CommandSeats(), Wakeup()
    notify = on_accepted or wake.notify
    async with world_with(engine, private_key, tmp, on_accepted=notify, seats=seats) as w:
        d = w.dispatcher(concurrency=concurrency)
        group = LoopGroup(d.loops(wake=wake)).start()
        seats.dispatcher = d
        try:
            for _ in range(200):  # bounded: the loop starts at its first iteration
                if d._loop is not None and d._loop.running:
                    break
                await asyncio.sleep(0.005)
            yield w, d, wake
        finally:
            seats.dispatcher = None
            await group.stop()
            await d.settle()


async def _until_sent(w: World, n: int) -> None:
    for _ in range(400):  # bounded: 4 s
        if len(w.sink.received) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} message(s) expected, got {len(w.sink.received)}")


async def _settled(w: World, scope: Scope, command_id: str) -> Any:
    for _ in range(400):  # bounded: 4 s
        cmd, attempts = await w.command(scope, command_id)
        if cmd.state is CommandState.SUCCEEDED:
            return cmd, attempts
        await asyncio.sleep(0.01)
    raise AssertionError("the command did not settle")


async def test_an_acceptance_with_room_commits_the_lease_and_first_attempt_and_sends_once_without_a_claim(  # noqa: E501
    engine: AsyncEngine,
    private_key: Ed25519PrivateKey,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def no_claim(*_: Any, **__: Any) -> Any:
        raise AssertionError("a pre-claimed command needs no claim transaction")

    monkeypatch.setattr(dispatch_module, "claim_txn", no_claim)
    async with preclaiming(engine, private_key, tmp_path) as (w, d, wake):
        scope, resp = await accept(w)
        # The acceptance answered with the command as it committed: leased, attempt 1.
        assert resp.command.state == _DISPATCHING
        assert wake.take_hints() == []  # handed over, not hinted
        cmd, attempts = await _settled(w, scope, resp.command.command_id)
        assert len(w.sink.received) == 1
        assert [a.outcome for a in attempts] == [AttemptOutcome.SUCCEEDED]
        # Attempt 1 was written by the acceptance's transaction (its clock), not a claim.
        assert attempts[0].started_at == cmd.created_at
        assert cmd.attempt_count == 1 and cmd.lease_token is None  # released at the end
        assert d._reserved == set()
        # A redelivered handoff (lost answer) is a duplicate: not leased, nothing sent.
        again = await w.owner.accept(scope, envelope(scope))
        assert again.duplicate and again.command.command_id == resp.command.command_id
        await asyncio.sleep(0.1)
        assert len(w.sink.received) == 1 and d._reserved == set()
        assert await w.dispatcher().run_once() == 0  # and polling finds nothing due


async def test_a_refused_acceptance_gives_its_seat_back_and_leases_nothing(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    async with preclaiming(engine, private_key, tmp_path, concurrency=1) as (w, d, _):
        scope, resp = await accept(w)
        await _settled(w, scope, resp.command.command_id)
        # The same key with another payload digest: quarantined against the fence row.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await w.owner.accept(scope, envelope(scope, payload={"to": "eve@example.com"}))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert d._reserved == set()  # the only seat is free again
        # ... so the next acceptance is pre-claimed again.
        other, resp2 = await accept(w, run="run-2")
        assert resp2.command.state == _DISPATCHING
        await _settled(w, other, resp2.command.command_id)
        assert len(w.sink.received) == 2


async def test_without_room_the_command_is_accepted_unleased_and_claimed_as_before(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    """Every slot of the gate reserved (here: by hand, as by a concurrent acceptance):
    the command commits ``ACCEPTED`` with no lease or attempt, the wakeup names it, and
    the loop claims it in a transaction of its own and sends it once."""
    async with preclaiming(engine, private_key, tmp_path, concurrency=1) as (w, d, _):
        held = d.reserve("email.smtp")
        assert held is not None and d.reserve("email.smtp") is None  # no room left
        scope, resp = await accept(w)
        assert resp.command.state == _ACCEPTED
        held.release()
        held.release()  # idempotent
        await _until_sent(w, 1)
        cmd, attempts = await _settled(w, scope, resp.command.command_id)
        assert [a.outcome for a in attempts] == [AttemptOutcome.SUCCEEDED]
        assert attempts[0].started_at > cmd.created_at  # a claim of its own, later
        assert len(w.sink.received) == 1


async def test_no_seat_for_an_unserved_kind_or_a_dispatcher_that_is_not_running(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    async with world_with(engine, private_key, tmp_path) as w:
        d = w.dispatcher()
        assert d.reserve("email.smtp") is None  # no loop built yet
        d.loops(wake=Wakeup())
        assert d.reserve("email.smtp") is None  # built, not running
        assert CommandSeats().reserve("email.smtp") is None  # no dispatcher at all
    async with preclaiming(engine, private_key, tmp_path) as (_, d, _):
        assert d.reserve("sms.twilio") is None
        seat = d.reserve("email.smtp")
        assert seat is not None
        seat.release()


async def test_a_preclaimed_acceptance_inserts_fence_command_and_attempt_in_one_round_trip(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    """ADR 0010's addendum: the fence INSERT (if absent) first, then the command, its
    first attempt and the request ledger's row — one round trip where the backend batches
    writes. The redelivered handoff sends the same batch: the server stops at the fence's
    duplicate key, so no second command, attempt or ledger row is ever inserted."""
    trips: list[list[str]] = []

    def on_execute(*args: Any) -> None:
        trips.append([" ".join(p.split()) for p in statements_of(str(args[2]))])

    async with preclaiming(engine, private_key, tmp_path) as (w, _d, _):
        event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
        try:
            scope, resp = await accept(w)
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", on_execute)
        await _settled(w, scope, resp.command.command_id)
        again = await w.owner.accept(scope, envelope(scope))
        assert again.duplicate
        _, attempts = await w.command(scope, resp.command.command_id)
        assert len(attempts) == 1 and len(w.sink.received) == 1
    inserts = [t for t in trips if t[0].startswith("INSERT INTO owner_inbox")]
    assert len(inserts) == 1
    heads = [s.split(" (")[0] for s in inserts[0]]
    if strategy_for(engine.dialect).multi_statements:
        assert heads == [
            "INSERT INTO owner_inbox",
            "INSERT INTO external_commands",
            "INSERT INTO remote_attempts",
            "INSERT INTO owner_requests",
        ]
    else:
        assert heads == ["INSERT INTO owner_inbox"]
