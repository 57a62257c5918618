"""The owner's writes on the effect round trip share round trips where the backend
batches writes (ADR 0010 and its addendum), with the same outcome as one by one:
an outcome's attempt UPDATE, receipt INSERT and outbox INSERT go together after the
command's fenced UPDATE, and a lost attempt fence inside that batch leaves nothing
behind. Both backends (the ``world`` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, func, select

from effect_owner_svc.commands.model import CommandState, Complete
from effect_owner_svc.commands.records import CommandRecord
from effect_owner_svc.commands.store import (
    Started,
    claim_txn,
    hold_command_txn,
    record_attempt_txn,
)
from effect_owner_svc.providers.base import ProviderOutcome
from effect_owner_svc.schema import (
    completion_receipts,
    external_commands,
    owner_outbox,
    remote_attempts,
)
from services.db import db_now, strategy_for, transaction
from services.db_batch import statements_of
from services.effect_contract import CompletionOutcomeCode
from services.errors import FenceLostError
from tests.integration.effects.owner_world import World, accept

_DONE = Complete(CommandState.SUCCEEDED, CompletionOutcomeCode.SUCCEEDED)


async def _started(world: World) -> Started:
    scope, resp = await accept(world)
    accepted, _ = await world.command(scope, resp.command.command_id)
    assert isinstance(accepted, CommandRecord)
    async with transaction(world.engine) as conn:
        now = await db_now(conn)
        started = await claim_txn(
            conn, accepted, owner="trips", lease_until=now + timedelta(seconds=30), now=now
        )
    assert isinstance(started, Started)
    return started


async def _count(world: World, table: Any, command_id: str) -> int:
    async with transaction(world.engine, readonly=True) as conn:
        stmt = select(func.count()).where(table.c.external_command_id == command_id)
        return int((await conn.execute(stmt)).scalar_one())


async def _outbox_rows(world: World, org_id: str) -> int:
    async with transaction(world.engine, readonly=True) as conn:
        stmt = select(func.count()).select_from(owner_outbox).where(owner_outbox.c.org_id == org_id)
        return int((await conn.execute(stmt)).scalar_one())


@contextmanager
def _traced(world: World) -> Iterator[list[list[str]]]:
    """The statements of each round trip sent while inside, in order."""
    trips: list[list[str]] = []

    def on_execute(*args: Any) -> None:
        trips.append([" ".join(p.split()) for p in statements_of(str(args[2]))])

    event.listen(world.engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        yield trips
    finally:
        event.remove(world.engine.sync_engine, "before_cursor_execute", on_execute)


async def test_an_outcome_writes_attempt_receipt_and_outbox_in_one_round_trip(
    world: World,
) -> None:
    started = await _started(world)
    with _traced(world) as trips:
        async with transaction(world.engine) as conn:
            now = await db_now(conn)
            receipt = await record_attempt_txn(
                conn, started, ProviderOutcome.succeeded(message_id="m-1"), _DONE, now
            )
    assert receipt is not None
    writes = [t for t in trips if t[0].startswith(("INSERT", "UPDATE"))]
    heads = [[s.split(" SET ")[0].split(" (")[0] for s in t] for t in writes]
    if strategy_for(world.engine.dialect).multi_statements:
        assert heads == [
            ["UPDATE external_commands"],
            [
                "UPDATE remote_attempts",
                "INSERT INTO completion_receipts",
                "INSERT INTO owner_outbox",
            ],
        ]
    else:
        assert len(heads) == 4 and all(len(h) == 1 for h in heads)
    command_id = started.command.command_id
    assert await _count(world, completion_receipts, command_id) == 1
    assert await _outbox_rows(world, started.command.org_id) == 1


async def test_a_lost_attempt_fence_in_the_outcomes_batch_writes_nothing(world: World) -> None:
    """The attempt's UPDATE is the first statement of the batch: when its fence is lost,
    the receipt and outbox INSERTs after it ran too — and all of it rolls back with the
    command's UPDATE."""
    started = await _started(world)
    stale = replace(started, attempt=replace(started.attempt, state_version=7))
    with pytest.raises(FenceLostError):
        async with transaction(world.engine) as conn:
            now = await db_now(conn)
            await record_attempt_txn(
                conn, stale, ProviderOutcome.succeeded(message_id="m-1"), _DONE, now
            )
    command_id = started.command.command_id
    assert await _count(world, completion_receipts, command_id) == 0
    assert await _outbox_rows(world, started.command.org_id) == 0
    async with transaction(world.engine, readonly=True) as conn:
        stmt = select(remote_attempts.c.outcome, remote_attempts.c.state_version).where(
            remote_attempts.c.external_command_id == command_id
        )
        assert [tuple(r) for r in await conn.execute(stmt)] == [("IN_FLIGHT", 1)]
    async with transaction(world.engine, readonly=True) as conn:
        stmt = select(external_commands.c.state, external_commands.c.state_version).where(
            external_commands.c.external_command_id == command_id
        )
        row = (await conn.execute(stmt)).one()
    assert (row.state, row.state_version) == (
        started.command.state.value,
        started.command.state_version,
    )


async def test_a_held_command_records_its_whole_outcome_in_one_round_trip(world: World) -> None:
    """The dispatcher's outcome transaction (``hold_command_txn``): the command's row
    lock and the clock in one statement, then the command's fenced UPDATE, the attempt,
    the receipt and the outbox message together — two round trips where the backend
    batches writes."""
    started = await _started(world)
    with _traced(world) as trips:
        async with transaction(world.engine) as conn:
            now = await hold_command_txn(conn, started.command)
            assert await db_now(conn) == now  # kept as the transaction's clock
            receipt = await record_attempt_txn(
                conn, started, ProviderOutcome.succeeded(message_id="m-1"), _DONE, now, held=True
            )
    assert receipt is not None and receipt.created_at == now
    trips = [t for t in trips if not t[0].startswith("BEGIN")]
    assert trips[0][0].startswith("SELECT") and "external_commands" in trips[0][0]
    if strategy_for(world.engine.dialect).multi_statements:
        assert "FOR UPDATE" in trips[0][0]
        heads = [s.split(" SET ")[0].split(" (")[0] for s in trips[1]]
        assert len(trips) == 2 and heads == [
            "UPDATE external_commands",
            "UPDATE remote_attempts",
            "INSERT INTO completion_receipts",
            "INSERT INTO owner_outbox",
        ]
    command_id = started.command.command_id
    assert await _count(world, completion_receipts, command_id) == 1
    assert await _outbox_rows(world, started.command.org_id) == 1


async def test_a_lost_lease_in_the_held_outcome_batch_writes_nothing(world: World) -> None:
    """The command's fenced UPDATE is the first statement of the held batch: when the
    lease was lost, the attempt, receipt and outbox statements after it ran on the server
    too (under the command's lock this transaction holds) — and all of it rolls back."""
    started = await _started(world)
    stale = replace(started, command=replace(started.command, lease_token="another-lease"))
    with pytest.raises(FenceLostError):
        async with transaction(world.engine) as conn:
            now = await hold_command_txn(conn, stale.command)
            await record_attempt_txn(
                conn, stale, ProviderOutcome.succeeded(message_id="m-1"), _DONE, now, held=True
            )
    command_id = started.command.command_id
    assert await _count(world, completion_receipts, command_id) == 0
    assert await _outbox_rows(world, started.command.org_id) == 0
    async with transaction(world.engine, readonly=True) as conn:
        stmt = select(remote_attempts.c.outcome).where(
            remote_attempts.c.external_command_id == command_id
        )
        assert [r[0] for r in await conn.execute(stmt)] == ["IN_FLIGHT"]
