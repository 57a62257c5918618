"""Effect crash proofs with REAL child processes (durable-workflow-seam Required Proof at
the effect boundaries the owner and the runtime's dispatcher own; spec §22.5).

Each test kills a real ``effect_owner_svc`` / ``runtime_svc`` child at one named
``FLOW_CRASH_AT`` point, asserts it died exactly there (returncode -9 and the marker
file; anything else is inconclusive and fails), restarts it without the hook and waits
(bounded, event-driven) until the exchange converged. Then it counts at every side: the
owner's commands and fence rows, its remote attempts (the step-entry counter of a
provider call), its receipts and outbox rows, the runtime outbox row, and the effects
the SMTP sink / HTTP receiver / WakeSignalService themselves received.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.schema import (
    completion_receipts,
    external_commands,
    owner_inbox,
    owner_outbox,
    remote_attempts,
)
from runtime_svc.outbox import RUNTIME_OUTBOX, enqueue_effect_submit_txn
from services import db
from services.db import run_in_transaction, transaction
from services.outbox import DeliveryState, get_message
from tests.crash.effects_support import EffectStack, effect_stack, expect_sigkill
from tests.integration.effects.harness import Scope, count, envelope, submit_intent
from tests.support.dbs import migrated_database, new_org

pytestmark = pytest.mark.crash

_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]
_CONVERGE_S = 60.0
WEBHOOK_PAYLOAD = {"event": "contact.welcomed", "contact": "c-1"}


@pytest.fixture(scope="module", params=_BACKENDS, ids=["sqlite", "mariadb"])
def effect_dbs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    with (
        migrated_database(request, tmp_path_factory, "effect_owner_svc") as owner,
        migrated_database(request, tmp_path_factory, "runtime_svc") as runtime,
    ):
        yield owner, runtime


@pytest.fixture
async def owner_engine(effect_dbs: tuple[str, str]) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(effect_dbs[0], pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def runtime_engine(effect_dbs: tuple[str, str]) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(effect_dbs[1], pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def stack(tmp_path: Path, effect_dbs: tuple[str, str]) -> AsyncIterator[EffectStack]:
    async with effect_stack(tmp_path, *effect_dbs) as s:
        yield s


async def _until(what: str, predicate: Callable[[], Awaitable[bool]], stack: EffectStack) -> None:
    for _ in range(int(_CONVERGE_S / 0.1)):
        if await predicate():
            return
        for child in stack.children:
            if child.proc.poll() not in (None, -9):
                pytest.fail(f"{child.name} exited {child.proc.returncode}:\n{child.log_text()}")
        await asyncio.sleep(0.1)
    logs = "\n".join(c.log_text()[-2000:] for c in stack.children)
    pytest.fail(f"timed out waiting for {what}:\n{logs}")


async def _command(engine: AsyncEngine, org: str) -> dict[str, Any]:
    async with transaction(engine, readonly=True) as conn:
        row = (
            (await conn.execute(select(external_commands).where(external_commands.c.org_id == org)))
            .mappings()
            .one()
        )
    return dict(row)


async def _attempts(engine: AsyncEngine, org: str) -> list[str]:
    async with transaction(engine, readonly=True) as conn:
        rows = (
            await conn.execute(
                select(remote_attempts.c.outcome)
                .where(remote_attempts.c.org_id == org)
                .order_by(remote_attempts.c.attempt_number)
            )
        ).all()
    return [str(r[0]) for r in rows]


def _wakes(stack: EffectStack, org: str) -> list[Any]:
    return [req for key, req in stack.wake.signals.items() if key[0] == org]


async def _receipt_delivered(engine: AsyncEngine, org: str) -> bool:
    async with transaction(engine, readonly=True) as conn:
        states = (
            await conn.execute(
                select(owner_outbox.c.delivery_state).where(owner_outbox.c.org_id == org)
            )
        ).all()
    return [s[0] for s in states] == [DeliveryState.DELIVERED.value]


async def _outbox_row(engine: AsyncEngine, org: str) -> dict[str, Any]:
    async with transaction(engine, readonly=True) as conn:
        row = (
            (await conn.execute(select(owner_outbox).where(owner_outbox.c.org_id == org)))
            .mappings()
            .one()
        )
    return dict(row)


async def _assert_one_command_one_receipt(engine: AsyncEngine, org: str) -> None:
    assert await count(engine, owner_inbox, org_id=org) == 1
    assert await count(engine, external_commands, org_id=org) == 1
    assert await count(engine, completion_receipts, org_id=org) == 1
    assert await count(engine, owner_outbox, org_id=org) == 1


async def test_durable_seam_crash_after_the_provider_accepted_replays_the_same_key_into_one_effect(
    stack: EffectStack, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the provider accepted, before the owner recorded the
    outcome — the restarted owner replays with the same idempotency key and the receiver
    applies one effect."""
    point = "after_provider_accepted:webhook.http"
    scope = Scope(new_org())
    owner = stack.spawn_owner(point)
    await owner.wait_serving()
    env = envelope(scope, owner_kind="webhook.http", payload=WEBHOOK_PAYLOAD)
    resp = await stack.accept(scope, env)
    await expect_sigkill(owner, stack.marker, point)
    # The provider applied it; the owner never recorded the answer.
    assert len(stack.receiver.effects) == 1 and len(stack.receiver.requests) == 1
    assert await _attempts(owner_engine, scope.org_id) == ["IN_FLIGHT"]
    assert (await _command(owner_engine, scope.org_id))["state"] == "DISPATCHING"

    restarted = stack.spawn_owner()
    await restarted.wait_serving()

    async def converged() -> bool:
        return bool(_wakes(stack, scope.org_id)) and await _receipt_delivered(
            owner_engine, scope.org_id
        )

    await _until("the replayed outcome's receipt", converged, stack)
    command = await _command(owner_engine, scope.org_id)
    assert command["state"] == "SUCCEEDED" and command["outcome_version"] == 1
    # Entered twice (the unknown attempt, then the same-key replay), effective once.
    assert await _attempts(owner_engine, scope.org_id) == ["OUTCOME_UNKNOWN", "SUCCEEDED"]
    assert {r["key"] for r in stack.receiver.requests} == {command["provider_idempotency_key"]}
    assert len(stack.receiver.requests) == 2 and len(stack.receiver.effects) == 1
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)
    [wake] = _wakes(stack, scope.org_id)
    assert wake.wake_token == f"{resp.command.command_id}/1"


async def test_durable_seam_crash_after_smtp_accepted_quarantines_and_never_resends(
    stack: EffectStack, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the SMTP server accepted the message, before the owner
    recorded it — SMTP has no lookup and no deduplication, so the restarted owner
    quarantines the command (receipt OUTCOME_UNKNOWN) and the sink holds one message."""
    point = "after_provider_accepted:email.smtp"
    scope = Scope(new_org())
    owner = stack.spawn_owner(point)
    await owner.wait_serving()
    await stack.accept(scope, envelope(scope))
    await expect_sigkill(owner, stack.marker, point)
    assert len(stack.sink.received) == 1

    restarted = stack.spawn_owner()
    await restarted.wait_serving()
    await _until(
        "the quarantine receipt",
        lambda: _receipt_delivered(owner_engine, scope.org_id),
        stack,
    )
    command = await _command(owner_engine, scope.org_id)
    assert command["state"] == "QUARANTINED"
    assert await _attempts(owner_engine, scope.org_id) == ["OUTCOME_UNKNOWN"]
    assert len(stack.sink.received) == 1  # counted at the SMTP server: never resent
    [wake] = _wakes(stack, scope.org_id)
    assert json.loads(wake.evidence_json)["outcome"] == "OUTCOME_UNKNOWN"
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)


@pytest.mark.parametrize("preclaim", ["true", "false"], ids=["preclaimed", "claimed"])
async def test_durable_seam_crash_before_the_provider_call_is_reconciled_not_resent_blindly(
    stack: EffectStack, owner_engine: AsyncEngine, preclaim: str
) -> None:
    """durable seam: crash after the remote attempt was recorded in flight, before the
    provider was called — the restarted owner cannot know whether the call happened, so
    the idempotent receiver gets the same key (one effect), never a new one.

    ``preclaimed``: the attempt was committed by the acceptance itself (ADR 0008), the
    process dies between that COMMIT and the call; ``claimed``: by the dispatcher's claim
    transaction after an ``ACCEPTED`` acceptance (``FLOW_EFFECT_PRECLAIM_COMMAND=false``).
    """
    point = "before_provider_call:webhook.http"
    scope = Scope(new_org())
    owner = stack.spawn_owner(point, FLOW_EFFECT_PRECLAIM_COMMAND=preclaim)
    await owner.wait_serving()
    env = envelope(scope, owner_kind="webhook.http", payload=WEBHOOK_PAYLOAD)
    try:
        await stack.accept(scope, env)
    except grpc.aio.AioRpcError:
        # Pre-claimed, the call (and the crash) may come before the answer left.
        assert preclaim == "true"
    await expect_sigkill(owner, stack.marker, point)
    assert stack.receiver.requests == []
    dead = await _command(owner_engine, scope.org_id)
    async with transaction(owner_engine, readonly=True) as conn:
        [started] = (
            await conn.execute(
                select(remote_attempts.c.started_at).where(remote_attempts.c.org_id == scope.org_id)
            )
        ).scalars()
    # In flight under the dead process's lease; pre-claimed = written with the acceptance.
    assert dead["state"] == "DISPATCHING" and dead["lease_token"]
    assert (started == dead["created_at"]) is (preclaim == "true")

    restarted = stack.spawn_owner()
    await restarted.wait_serving()
    await _until("the receipt", lambda: _receipt_delivered(owner_engine, scope.org_id), stack)
    assert (await _command(owner_engine, scope.org_id))["state"] == "SUCCEEDED"
    assert await _attempts(owner_engine, scope.org_id) == ["OUTCOME_UNKNOWN", "SUCCEEDED"]
    assert len(stack.receiver.requests) == 1 and len(stack.receiver.effects) == 1


async def test_durable_seam_crash_after_the_receipt_committed_redelivers_one_wake(
    stack: EffectStack, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the outcome, completion receipt and owner-outbox
    message committed, before delivery — the restarted owner delivers it; one wake.

    The message was enqueued pre-claimed (ADR 0004): it died ``Delivering`` under the
    dead process's lease, so it is the repair sweep that returns it once the lease
    expired (the lost attempt counted) and the restarted owner delivers it."""
    point = "after_receipt_commit:email.smtp"
    scope = Scope(new_org())
    owner = stack.spawn_owner(point)
    await owner.wait_serving()
    await stack.accept(scope, envelope(scope))
    await expect_sigkill(owner, stack.marker, point)
    assert _wakes(stack, scope.org_id) == []
    assert (await _command(owner_engine, scope.org_id))["state"] == "SUCCEEDED"
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)
    orphan = await _outbox_row(owner_engine, scope.org_id)
    assert orphan["delivery_state"] == DeliveryState.DELIVERING.value
    assert orphan["lease_token"] and orphan["delivery_attempts"] == 0

    restarted = stack.spawn_owner()
    await restarted.wait_serving()
    await _until("the wake", lambda: _receipt_delivered(owner_engine, scope.org_id), stack)
    assert len(_wakes(stack, scope.org_id)) == 1
    # One lost attempt (the dead process's lease) and the one delivery.
    assert (await _outbox_row(owner_engine, scope.org_id))["delivery_attempts"] == 2
    assert len(stack.sink.received) == 1
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)


async def test_durable_seam_crash_after_the_runtime_acknowledged_the_receipt_redelivers_the_same_token(  # noqa: E501
    stack: EffectStack, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the WakeSignalService committed the receipt's signal,
    before the owner marked it delivered — redelivery carries the same wake token and the
    runtime side deduplicates it to one wake."""
    point = "after_outbox_delivery:effect.completion.receipt"
    scope = Scope(new_org())
    owner = stack.spawn_owner(point)
    await owner.wait_serving()
    await stack.accept(scope, envelope(scope))
    await expect_sigkill(owner, stack.marker, point)
    assert len(_wakes(stack, scope.org_id)) == 1
    calls_before = stack.wake.calls

    restarted = stack.spawn_owner()
    await restarted.wait_serving()
    await _until("delivery", lambda: _receipt_delivered(owner_engine, scope.org_id), stack)
    assert stack.wake.calls > calls_before  # it was delivered again ...
    assert len(_wakes(stack, scope.org_id)) == 1  # ... and is still one wake
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)


async def test_durable_seam_crash_after_inbox_acceptance_before_the_response_yields_one_command(
    stack: EffectStack, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the owner committed the acceptance, before it answered —
    the caller's retry of the same request finds the one accepted command."""
    point = "after_inbox_accept:email.smtp"
    scope = Scope(new_org())
    env = envelope(scope)
    # The dying owner runs no command dispatcher: its polling could otherwise claim the
    # command in the moment between the acceptance's COMMIT and the crash point (the
    # commit's own awaits), be killed mid-call, and turn this proof into the
    # interrupted-attempt one (quarantine, nothing received) — a different boundary.
    owner = stack.spawn_owner(point, FLOW_EFFECT_DISPATCHERS="0")
    await owner.wait_serving()
    with pytest.raises(grpc.aio.AioRpcError):
        await stack.accept(scope, env, request_id="req-1")
    await expect_sigkill(owner, stack.marker, point)
    restarted = stack.spawn_owner()
    await restarted.wait_serving()
    # The same request replays the response the dead owner committed but never sent;
    # a redelivery under a new request id finds the same command.
    again = await stack.accept(scope, env, request_id="req-1")
    redelivered = await stack.accept(scope, env, request_id="req-2")
    assert not again.duplicate and redelivered.duplicate
    assert again.command.command_id == redelivered.command.command_id
    await _until("the receipt", lambda: _receipt_delivered(owner_engine, scope.org_id), stack)
    assert len(stack.sink.received) == 1
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)


async def test_durable_seam_crash_after_owner_acceptance_before_marking_delivered_redelivers_into_one_command(  # noqa: E501
    stack: EffectStack, owner_engine: AsyncEngine, runtime_engine: AsyncEngine
) -> None:
    """durable seam: the runtime's dispatcher is killed after the owner durably accepted
    the handoff, before it marked the canonical outbox row delivered — the restarted
    runtime redelivers the same key and the owner inbox collapses it into one command."""
    point = "after_outbox_delivery:flow.effect.submit"
    scope = Scope(new_org())
    owner = stack.spawn_owner()
    await owner.wait_serving()
    deadline = datetime.now(UTC) + timedelta(hours=1)
    intent = submit_intent(scope, run="run-crash", deadline=deadline)
    await run_in_transaction(runtime_engine, lambda c: enqueue_effect_submit_txn(c, intent))
    runtime = stack.spawn_runtime(point)
    await expect_sigkill(runtime, stack.marker, point)

    async def message() -> Any:
        async with transaction(runtime_engine, readonly=True) as conn:
            return await get_message(conn, RUNTIME_OUTBOX, scope.org_id, intent.message_id)

    assert (await message()).delivery_state is DeliveryState.DELIVERING
    assert await count(owner_engine, external_commands, org_id=scope.org_id) == 1

    stack.spawn_runtime()

    async def delivered() -> bool:
        return (await message()).delivery_state is DeliveryState.DELIVERED

    await _until("the runtime outbox row delivered", delivered, stack)
    await _until("the receipt", lambda: _receipt_delivered(owner_engine, scope.org_id), stack)
    row = await message()
    assert row.delivery_attempts == 2  # the lost one (lease expired) and the redelivery
    assert len(stack.sink.received) == 1
    await _assert_one_command_one_receipt(owner_engine, scope.org_id)
