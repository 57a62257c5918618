"""The command store decides on the rows its fenced UPDATEs leave instead of reading them
back (``effect_owner_svc.commands.store._after_fence``): the command a claim, a recorded
outcome or a reconciliation step returns equals what a fresh read of the row returns,
for every shape of write the store makes, on both backends. A lost fence derives
nothing: it raises, and the row is unchanged."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from effect_owner_svc.commands.model import CommandState
from effect_owner_svc.commands.records import CommandRecord
from effect_owner_svc.commands.store import _fence_leased, claim_txn
from services.db import db_now, transaction
from services.errors import FenceLostError
from tests.integration.effects.harness import Scope
from tests.integration.effects.owner_world import World, accept

_RELEASE = {"lease_owner": None, "lease_token": None, "lease_until": None}


async def _stored(world: World, scope: Scope, command_id: str) -> CommandRecord:
    cmd, _ = await world.command(scope, command_id)
    assert isinstance(cmd, CommandRecord)
    return cmd


async def _claimed(world: World) -> tuple[Scope, CommandRecord]:
    scope, resp = await accept(world)
    accepted = await _stored(world, scope, resp.command.command_id)
    assert accepted.state is CommandState.ACCEPTED
    async with transaction(world.engine) as conn:
        now = await db_now(conn)
        started = await claim_txn(
            conn, accepted, owner="derived", lease_until=now + timedelta(seconds=30), now=now
        )
    leased = started.command
    assert leased == await _stored(world, scope, accepted.command_id)
    assert leased.state is CommandState.DISPATCHING and leased.lease_token
    return scope, leased


def _complete(now: Any) -> dict[str, Any]:
    return {
        **_RELEASE,
        "state": CommandState.SUCCEEDED.value,
        "outcome_version": 1,
        "safe_error_code": None,
        "result_digest": "effect-result/v1:sha256:" + "ab" * 32,
        "next_attempt_at": None,
    }


def _retry(now: Any) -> dict[str, Any]:
    return {
        **_RELEASE,
        "state": CommandState.DISPATCHING.value,
        "next_attempt_at": now + timedelta(seconds=7),
        "safe_error_code": "smtp_4xx",
    }


def _reconcile(now: Any) -> dict[str, Any]:
    return {
        **_RELEASE,
        "state": CommandState.OUTCOME_UNKNOWN.value,
        "next_attempt_at": now,
        "safe_error_code": "timeout_after_send",
    }


def _replay(now: Any) -> dict[str, Any]:
    return {"state": CommandState.DISPATCHING.value, "attempt_count": 2, "safe_error_code": "x"}


def _look_again(now: Any) -> dict[str, Any]:
    return {**_RELEASE, "reconcile_attempts": 1, "next_attempt_at": now + timedelta(seconds=3)}


@pytest.mark.parametrize(
    "values", [_complete, _retry, _reconcile, _replay, _look_again], ids=lambda f: f.__name__[1:]
)
async def test_a_fenced_command_write_derives_exactly_the_stored_row(
    world: World, values: Any
) -> None:
    scope, leased = await _claimed(world)
    async with transaction(world.engine) as conn:
        now = await db_now(conn)
        derived = await _fence_leased(conn, leased, values(now), now)
    assert derived == await _stored(world, scope, leased.command_id)
    assert derived.state_version == leased.state_version + 1


async def test_a_lost_lease_derives_nothing_and_changes_nothing(world: World) -> None:
    scope, leased = await _claimed(world)
    stale = replace(leased, lease_token="not-the-lease")
    with pytest.raises(FenceLostError):
        async with transaction(world.engine) as conn:
            now = await db_now(conn)
            await _fence_leased(conn, stale, _complete(now), now)
    assert await _stored(world, scope, leased.command_id) == leased
