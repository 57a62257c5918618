"""The owner's command dispatcher against REAL local servers (aiosmtpd SMTP sink, an
HTTP receiver), on SQLite and MariaDB: provider calls only after acceptance committed,
remote attempts recorded, classification, durable retry, OUTCOME_UNKNOWN reconciled by
lookup / same-key replay / quarantine (never a blind resend), and the completion receipt
committed with its owner-outbox message. Effects are counted at the servers."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.commands.model import AttemptOutcome, CommandState
from effect_owner_svc.commands.store import claim_txn
from effect_owner_svc.schema import owner_outbox
from services.background import Wakeup
from services.db import db_now, run_in_transaction, transaction
from services.effect_contract import (
    EFFECT_COMPLETION_FAMILY,
    EFFECT_COMPLETION_PRODUCER_KIND,
    CompletionEvidence,
    provider_idempotency_key,
    wake_evidence_digest,
)
from services.errors import FenceLostError
from services.outbox import DeliveryState
from services.proto import effect_v1
from tests.integration.effects.harness import count, envelope
from tests.integration.effects.owner_world import (
    FAST,
    WEBHOOK,
    World,
    accept,
    world_with,
)
from tests.support.effect_servers import (
    DROP,
)


async def test_email_is_sent_once_after_acceptance_with_the_idempotency_key_as_message_id(
    world: World,
) -> None:
    scope, resp = await accept(world)
    assert world.sink.received == []  # accepted, nothing sent yet
    await world.drive()
    cmd, attempts = await world.command(scope, resp.command.command_id)
    assert len(world.sink.received) == 1
    mail = world.sink.received[0]
    key = provider_idempotency_key("email.smtp", resp.command.effect_handoff_key)
    assert mail.message_id == f"<{key}@localhost>"
    assert mail.rcpt_tos == ("ada@example.com",) and mail.subject == "Welcome, ada!"
    assert cmd.state is CommandState.SUCCEEDED and cmd.outcome_version == 1
    assert [a.outcome for a in attempts] == [AttemptOutcome.SUCCEEDED]
    assert attempts[0].provider_idempotency_key == key
    # The receipt and its delivery message committed with the outcome.
    [msg] = await world.receipts(scope)
    assert msg.family == EFFECT_COMPLETION_FAMILY
    assert msg.delivery_state is DeliveryState.PENDING
    body = json.loads(msg.payload)
    evidence = CompletionEvidence.from_json(body["evidence_json"])
    assert body["producer_kind"] == EFFECT_COMPLETION_PRODUCER_KIND
    assert body["producer_key"] == resp.command.effect_handoff_key
    assert body["wake_token"] == f"{resp.command.command_id}/1" == msg.key
    assert body["wake_version"] == 1
    assert body["evidence_digest"] == wake_evidence_digest(body["evidence_json"])
    assert evidence.outcome.value == "SUCCEEDED" and evidence.result_digest
    receipt = await world.owner.stub.GetReceipt(
        effect_v1.GetReceiptRequest(scope=scope.proto(), command_id=resp.command.command_id),
        metadata=world.owner.md(scope, roles=()),
    )
    assert receipt.receipt.outcome == effect_v1.CompletionOutcome.COMPLETION_OUTCOME_SUCCEEDED
    assert receipt.receipt.evidence_json == body["evidence_json"]
    await world.drive(rounds=3)
    assert len(world.sink.received) == 1  # terminal: never sent again


async def test_smtp_4xx_is_retried_and_5xx_fails_with_a_receipt(world: World) -> None:
    world.sink.replies = ["451"]
    scope, resp = await accept(world)
    await world.drive()
    cmd, attempts = await world.command(scope, resp.command.command_id)
    assert cmd.state is CommandState.SUCCEEDED
    assert [a.outcome for a in attempts] == [
        AttemptOutcome.FAILED_RETRYABLE,
        AttemptOutcome.SUCCEEDED,
    ]
    world.sink.replies = ["550"]
    scope2, resp2 = await accept(world)
    await world.drive()
    cmd2, _ = await world.command(scope2, resp2.command.command_id)
    assert cmd2.state is CommandState.FAILED and cmd2.safe_error_code == "smtp_data_5xx"
    [msg] = await world.receipts(scope2)
    assert CompletionEvidence.from_json(json.loads(msg.payload)["evidence_json"]).outcome == (
        "FAILED"
    )


async def test_retry_budget_is_bounded(world: World) -> None:
    world.sink.replies = ["451"] * 10
    scope, resp = await accept(world)
    await world.drive()
    cmd, attempts = await world.command(scope, resp.command.command_id)
    assert cmd.state is CommandState.FAILED and cmd.safe_error_code == "retry_budget_exhausted"
    assert len(attempts) == FAST.max_attempts == world.sink.data_commands


async def test_email_accepted_but_response_lost_is_quarantined_never_resent(
    world: World,
) -> None:
    world.sink.replies = [DROP]
    scope, resp = await accept(world)
    await world.drive()
    cmd, attempts = await world.command(scope, resp.command.command_id)
    assert len(world.sink.received) == 1  # the provider did accept it
    assert cmd.state is CommandState.QUARANTINED
    assert cmd.safe_error_code == "outcome_unknown_quarantined"
    assert [a.outcome for a in attempts] == [AttemptOutcome.OUTCOME_UNKNOWN]
    assert attempts[0].safe_error_code == "smtp_data_unacknowledged"
    [msg] = await world.receipts(scope)
    evidence = CompletionEvidence.from_json(json.loads(msg.payload)["evidence_json"])
    assert evidence.outcome == "OUTCOME_UNKNOWN"
    await world.drive(rounds=3)
    assert len(world.sink.received) == 1


async def test_webhook_classification(world: World) -> None:
    world.receiver.replies = [503, 200]
    ok_scope, ok = await accept(world, owner_kind="webhook.http")
    await world.drive()
    cmd, attempts = await world.command(ok_scope, ok.command.command_id)
    assert cmd.state is CommandState.SUCCEEDED
    assert [a.outcome for a in attempts] == [
        AttemptOutcome.FAILED_RETRYABLE,
        AttemptOutcome.SUCCEEDED,
    ]
    keys = {r["key"] for r in world.receiver.requests}
    assert keys == {provider_idempotency_key("webhook.http", ok.command.effect_handoff_key)}
    assert world.receiver.requests[0]["body"] == WEBHOOK
    world.receiver.replies = [422]
    bad_scope, bad = await accept(world, owner_kind="webhook.http")
    await world.drive()
    cmd2, _ = await world.command(bad_scope, bad.command.command_id)
    assert cmd2.state is CommandState.FAILED and cmd2.safe_error_code == "http_422"


async def test_webhook_response_lost_is_replayed_with_the_same_key_and_applied_once(
    world: World,
) -> None:
    world.receiver.replies = [DROP]
    scope, resp = await accept(world, owner_kind="webhook.http")
    await world.drive()
    cmd, attempts = await world.command(scope, resp.command.command_id)
    assert cmd.state is CommandState.SUCCEEDED
    assert [a.outcome for a in attempts] == [
        AttemptOutcome.OUTCOME_UNKNOWN,
        AttemptOutcome.SUCCEEDED,
    ]
    assert len(world.receiver.requests) == 2
    assert len({r["key"] for r in world.receiver.requests}) == 1
    assert len(world.receiver.effects) == 1  # counted at the receiver


async def test_unknown_outcome_is_reconciled_through_the_lookup(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    async with world_with(engine, private_key, tmp_path, idempotent=False, status=True) as world:
        world.receiver.replies = [DROP]
        scope, resp = await accept(world, owner_kind="webhook.http")
        await world.drive()
        cmd, attempts = await world.command(scope, resp.command.command_id)
        assert cmd.state is CommandState.SUCCEEDED
        assert len(attempts) == 1 and world.receiver.lookups == 1
        assert len(world.receiver.requests) == 1  # no resend: the lookup answered


async def test_unknown_outcome_without_lookup_or_idempotent_receiver_is_quarantined(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    async with world_with(engine, private_key, tmp_path, idempotent=False) as world:
        world.receiver.replies = [DROP]
        scope, resp = await accept(world, owner_kind="webhook.http")
        await world.drive()
        cmd, _ = await world.command(scope, resp.command.command_id)
        assert cmd.state is CommandState.QUARANTINED
        assert len(world.receiver.requests) == 1


async def test_a_dispatcher_that_died_in_flight_is_reconciled_and_its_late_result_fenced(
    world: World,
) -> None:
    scope, resp = await accept(world)
    cid = resp.command.command_id
    cmd, _ = await world.command(scope, cid)

    async def claim_and_die(conn: AsyncConnection) -> Any:
        now = await db_now(conn)
        # The dead dispatcher's lease is already over when the next one looks.
        return await claim_txn(
            conn, cmd, owner="dead", lease_until=now - timedelta(seconds=1), now=now
        )

    dead = await run_in_transaction(world.engine, claim_and_die)
    await world.drive()
    cmd, attempts = await world.command(scope, cid)
    # SMTP has no lookup and does not deduplicate: the unknown attempt is quarantined.
    assert cmd.state is CommandState.QUARANTINED
    assert attempts[0].outcome is AttemptOutcome.OUTCOME_UNKNOWN
    assert attempts[0].safe_error_code == "owner_interrupted"
    assert world.sink.received == []
    from effect_owner_svc.commands.model import Complete
    from effect_owner_svc.commands.store import record_attempt_txn
    from effect_owner_svc.providers.base import ProviderOutcome
    from services.effect_contract import CompletionOutcomeCode

    async def late(conn: AsyncConnection) -> Any:
        done = Complete(CommandState.SUCCEEDED, CompletionOutcomeCode.SUCCEEDED)
        return await record_attempt_txn(
            conn, dead, ProviderOutcome.succeeded(), done, await db_now(conn)
        )

    with pytest.raises(FenceLostError):
        await run_in_transaction(world.engine, late)
    assert await count(world.engine, owner_outbox, org_id=scope.org_id) == 1


async def test_receipts_are_keyed_by_command_and_outcome_version(world: World) -> None:
    scope, resp = await accept(world)
    await world.drive()
    async with transaction(world.engine, readonly=True) as conn:
        from effect_owner_svc.schema import completion_receipts

        rows = (
            await conn.execute(
                select(completion_receipts.c.outcome_version).where(
                    completion_receipts.c.org_id == scope.org_id
                )
            )
        ).all()
    assert [r[0] for r in rows] == [1]
    assert (await world.command(scope, resp.command.command_id))[0].outcome_version == 1


async def test_an_accepted_command_is_dispatched_from_its_hint_once(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    """The servicer hands each newly accepted command to this process's dispatcher (the
    wakeup's hint): it is claimed and sent without a discovery pass, and a duplicate or
    stale hint — or a redelivered handoff — never sends twice."""
    wake = Wakeup()
    async with world_with(engine, private_key, tmp_path, on_accepted=wake.notify) as w:
        scope, resp = await accept(w)
        hints = wake.take_hints()
        assert [h.command_id for h in hints] == [resp.command.command_id]  # type: ignore[attr-defined]
        # A redelivered handoff (the runtime lost the answer) is a duplicate: no new hint.
        await w.owner.accept(scope, envelope(scope))
        assert wake.take_hints() == []
        d = w.dispatcher()

        async def no_discovery() -> int:
            raise AssertionError("a hinted command must not need the discovery pass")

        d.run_once = no_discovery  # type: ignore[method-assign]
        assert await d.run_hinted(hints) == 1
        assert len(w.sink.received) == 1
        cmd, attempts = await w.command(scope, resp.command.command_id)
        assert cmd.state is CommandState.SUCCEEDED and len(attempts) == 1
        # The same (now stale) hint twice more, e.g. a duplicate notify: nothing is sent.
        assert await d.run_hinted(hints + hints) == 0  # each claim loses its fence
        assert len(w.sink.received) == 1
        assert await w.dispatcher().run_once() == 0  # and polling finds nothing due


async def test_smtp_sessions_are_reused_and_a_dropped_pooled_session_neither_loses_nor_duplicates(
    world: World,
) -> None:
    """A session that ended its message with 250 carries the next message (one EHLO for
    two sends); when the server dropped the kept session meanwhile, the send fails at
    MAIL FROM — before any of it was transmitted — and goes out once on a fresh
    connection in the same attempt."""
    first, r1 = await accept(world)
    await world.drive(rounds=3)
    second, r2 = await accept(world, run="run-2")
    await world.drive(rounds=3)
    assert len(world.sink.received) == 2 and world.sink.sessions == 1  # reused
    world.sink.drop_sessions()  # the server closes the idle kept session
    third, r3 = await accept(world, run="run-3")
    await world.drive(rounds=3)
    assert len(world.sink.received) == 3 and world.sink.data_commands == 3  # sent once
    assert world.sink.sessions == 2  # on a fresh connection
    for scope, resp in ((first, r1), (second, r2), (third, r3)):
        cmd, attempts = await world.command(scope, resp.command.command_id)
        assert cmd.state is CommandState.SUCCEEDED
        assert [a.outcome for a in attempts] == [AttemptOutcome.SUCCEEDED]


async def test_a_pooled_session_broken_mid_send_is_unknown_and_never_resent(
    world: World,
) -> None:
    """A kept session that breaks after DATA began is OUTCOME_UNKNOWN like a fresh one:
    quarantined, never sent again; the broken session is not kept."""
    await accept(world)
    await world.drive(rounds=3)
    assert world.sink.sessions == 1
    world.sink.replies = [DROP]  # stored, then the connection drops before the reply
    scope, resp = await accept(world, run="run-2")
    await world.drive()
    cmd, attempts = await world.command(scope, resp.command.command_id)
    assert world.sink.sessions == 1  # the message went out on the kept session
    assert cmd.state is CommandState.QUARANTINED
    assert [a.outcome for a in attempts] == [AttemptOutcome.OUTCOME_UNKNOWN]
    assert len(world.sink.received) == 2
    await accept(world, run="run-3")
    await world.drive(rounds=3)
    assert len(world.sink.received) == 3 and world.sink.sessions == 2  # a fresh session


@pytest.mark.parametrize("drop_hints", [False, True])
async def test_a_woken_dispatch_iteration_polls_only_when_the_wake_named_nothing_or_lost_hints(
    engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path, drop_hints: bool
) -> None:
    """Round 6: the command loop's wake does not restart its idle backoff
    (``wake_resets=False``): an iteration that dispatched the named command runs no
    discovery pass — unless the wakeup dropped a hint (a command only a poll finds)."""
    wake = Wakeup(max_hints=1)
    async with world_with(engine, private_key, tmp_path, on_accepted=wake.notify) as w:
        d = w.dispatcher()
        (loop,) = d.loops(wake=wake)
        assert loop._wake_resets is False
        polls = 0
        discover = d.run_once

        async def counted() -> int:
            nonlocal polls
            polls += 1
            return await discover()

        d.run_once = counted  # type: ignore[method-assign]
        if drop_hints:
            wake.notify("elsewhere")  # dropped by the accepted command's hint
        scope, resp = await accept(w)
        assert await loop.run_once() is False
        assert polls == (1 if drop_hints else 0)
        assert len(w.sink.received) == 1
        cmd, _ = await w.command(scope, resp.command.command_id)
        assert cmd.state is CommandState.SUCCEEDED
