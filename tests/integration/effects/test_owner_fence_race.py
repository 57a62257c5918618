"""Owner acceptance and ``RejectIfUnaccepted`` race on one durable unique key (§15.4,
§22.5): on two connections, exactly one accepted command or one rejection tombstone
wins, and the loser answers from the winner. Runs on SQLite and MariaDB."""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.inbox.fence import FenceState, HandoffAttributes
from effect_owner_svc.inbox.store import (
    Accepted,
    HandoffRequest,
    Refusal,
    accept_handoff_txn,
    reject_if_unaccepted_txn,
)
from effect_owner_svc.schema import external_commands, owner_inbox
from services import db
from services.db import run_in_transaction, transaction
from tests.integration.effects.harness import Scope, count, envelope
from tests.support.dbs import new_org


def _request(scope: Scope, run: str) -> HandoffRequest:
    env = envelope(scope, run=run)
    return HandoffRequest(
        attributes=HandoffAttributes(
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            effect_handoff_key=env.effect_handoff_key,
            runtime_outbox_message_id=env.runtime_outbox_message_id,
            payload_digest=env.payload_digest,
        ),
        effect_owner_kind="email.smtp",
        payload_schema_version=1,
        payload_json=env.payload_json,
        flow_run_id=run,
        step_execution_id="step-1",
        submission_attempt_id="att-1",
        deadline=None,
        failure_policy="fault_path",
    )


@pytest.fixture
async def second_engine(owner_db_url: str) -> AsyncEngine:
    eng = db.create_engine(owner_db_url, pool_size=4)
    try:
        yield eng  # type: ignore[misc]
    finally:
        await eng.dispose()


@pytest.mark.parametrize("first", ["accept", "reject"])
async def test_the_transaction_holding_the_key_wins_and_the_other_answers_from_it(
    engine: AsyncEngine, second_engine: AsyncEngine, first: str
) -> None:
    scope = Scope(new_org())
    req = _request(scope, "run-held")
    holding = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> Accepted | Refusal | object:
        async with transaction(engine) as conn:
            if first == "accept":
                result: object = await accept_handoff_txn(conn, req)
            else:
                result = await reject_if_unaccepted_txn(conn, req.attributes)
            holding.set()
            await release.wait()  # keep the uncommitted unique-key row locked
            return result

    async def contender() -> object:
        async def fn(conn: AsyncConnection) -> object:
            if first == "accept":
                return await reject_if_unaccepted_txn(conn, req.attributes)
            return await accept_handoff_txn(conn, req)

        return await run_in_transaction(second_engine, fn)

    held = asyncio.create_task(holder())
    await asyncio.wait_for(holding.wait(), 30)
    other = asyncio.create_task(contender())
    await asyncio.sleep(0.3)
    assert not other.done(), "the contender must wait for the key held by the first"
    release.set()
    winner = await asyncio.wait_for(held, 30)
    loser = await asyncio.wait_for(other, 30)
    if first == "accept":
        assert isinstance(winner, Accepted) and not winner.duplicate
        assert getattr(loser, "state", None) is FenceState.ACCEPTED
        assert await count(engine, external_commands, org_id=scope.org_id) == 1
    else:
        assert getattr(winner, "state", None) is FenceState.REJECTED
        assert isinstance(loser, Refusal) and loser.reason is None  # the tombstone
        assert await count(engine, external_commands, org_id=scope.org_id) == 0
    assert await count(engine, owner_inbox, org_id=scope.org_id) == 1


async def test_unsynchronised_races_always_end_with_exactly_one_decision(
    engine: AsyncEngine, second_engine: AsyncEngine
) -> None:
    scope = Scope(new_org())
    rng = random.Random(11)
    runs = [f"run-{i}" for i in range(12)]

    async def accept(run: str) -> object:
        req = _request(scope, run)
        return await run_in_transaction(engine, lambda c: accept_handoff_txn(c, req))

    async def reject(run: str) -> object:
        req = _request(scope, run)
        return await run_in_transaction(
            second_engine, lambda c: reject_if_unaccepted_txn(c, req.attributes)
        )

    for run in runs:
        pair = [accept(run), reject(run)]
        rng.shuffle(pair)
        a, b = await asyncio.gather(*pair)
        results = [a, b]
        accepted = [r for r in results if isinstance(r, Accepted)]
        fences = [r for r in results if getattr(r, "state", None) is not None]
        refused = [r for r in results if isinstance(r, Refusal)]
        if accepted:
            # Acceptance won: the rejection call returned the accepted receipt.
            assert len(accepted) == 1 and fences[0].state is FenceState.ACCEPTED
        else:
            # Rejection won: acceptance was refused by the tombstone.
            assert len(refused) == 1 and refused[0].reason is None
            assert fences[0].state is FenceState.REJECTED
    commands = await count(engine, external_commands, org_id=scope.org_id)
    fences_total = await count(engine, owner_inbox, org_id=scope.org_id)
    accepted_fences = await count(engine, owner_inbox, org_id=scope.org_id, state="ACCEPTED")
    assert fences_total == len(runs)
    assert commands == accepted_fences
