"""The owner inbox over real gRPC on SQLite and MariaDB (spec §10.7, §15.4, §22.5, §22.6):
one unique handoff key, acceptance with exactly one command, the durable rejection
tombstone, fail-closed mismatches with a quarantine marker, request-id replay and
scoped reads."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.schema import external_commands, owner_inbox
from services.db import transaction
from services.effect_contract import effect_payload_digest
from services.proto import effect_v1
from tests.integration.effects.harness import (
    OwnerClient,
    Scope,
    count,
    envelope,
    running_owner,
)
from tests.support.dbs import new_org
from tests.support.statements import clock_reads, watched_statements

ACCEPTED = effect_v1.InboxFenceState.INBOX_FENCE_STATE_ACCEPTED
REJECTED = effect_v1.InboxFenceState.INBOX_FENCE_STATE_REJECTED


@pytest.fixture
async def owner(engine: AsyncEngine, private_key: Ed25519PrivateKey, tmp_path: Path) -> OwnerClient:
    async with running_owner(engine, private_key, tmp_path) as client:
        yield client  # type: ignore[misc]


async def _code(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    from services.peer_client import rpc_error_reason

    return info.value.code(), rpc_error_reason(info.value)


async def _fence_row(engine: AsyncEngine, org: str, key: str) -> dict[str, object] | None:
    async with transaction(engine, readonly=True) as conn:
        row = (
            (
                await conn.execute(
                    select(owner_inbox).where(
                        owner_inbox.c.org_id == org, owner_inbox.c.effect_handoff_key == key
                    )
                )
            )
            .mappings()
            .first()
        )
    return None if row is None else dict(row)


async def test_repeated_delivery_of_one_handoff_key_is_one_command(
    owner: OwnerClient, engine: AsyncEngine
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    first = await owner.accept(scope, env)
    second = await owner.accept(scope, env)  # a redelivery: new request id, same key
    third = await owner.accept(scope, env)
    assert first.fence.state == ACCEPTED and not first.duplicate
    assert second.duplicate and third.duplicate
    assert first.command.command_id == second.command.command_id == third.command.command_id
    assert first.fence.runtime_outbox_message_id == env.runtime_outbox_message_id
    assert first.fence.payload_digest == env.payload_digest
    assert first.command.state == effect_v1.CommandState.COMMAND_STATE_ACCEPTED
    assert await count(engine, external_commands, org_id=scope.org_id) == 1
    assert await count(engine, owner_inbox, org_id=scope.org_id) == 1


async def test_a_retried_request_id_replays_the_original_response(
    owner: OwnerClient,
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    rid = uuid.uuid4().hex
    first = await owner.accept(scope, env, request_id=rid)
    again = await owner.accept(scope, env, request_id=rid)
    assert again.SerializeToString() == first.SerializeToString()
    other = envelope(scope, step="another_step")
    code, reason = await _code(owner.accept(scope, other, request_id=rid))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "request_id_reused"


async def test_reject_if_unaccepted_returns_an_existing_acceptance(
    owner: OwnerClient, engine: AsyncEngine
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    accepted = await owner.accept(scope, env)
    resp = await owner.reject(
        scope, env.effect_handoff_key, env.payload_digest, env.runtime_outbox_message_id
    )
    assert resp.fence.state == ACCEPTED
    assert resp.fence.command_id == accepted.command.command_id
    assert await count(engine, external_commands, org_id=scope.org_id) == 1


async def test_delivery_after_rejection_cannot_create_a_command(
    owner: OwnerClient, engine: AsyncEngine
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    resp = await owner.reject(
        scope, env.effect_handoff_key, env.payload_digest, env.runtime_outbox_message_id
    )
    assert resp.fence.state == REJECTED and resp.fence.command_id == ""
    again = await owner.reject(
        scope, env.effect_handoff_key, env.payload_digest, env.runtime_outbox_message_id
    )
    assert again.fence.state == REJECTED  # idempotent tombstone
    for _ in range(2):
        code, reason = await _code(owner.accept(scope, env))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and reason == "handoff_rejected"
    assert await count(engine, external_commands, org_id=scope.org_id) == 0
    assert await count(engine, owner_inbox, org_id=scope.org_id) == 1


@pytest.mark.parametrize(
    "other",
    ["app_installation_id", "runtime_capability_id", "runtime_work_binding_digest"],
)
async def test_the_same_key_under_another_scope_of_the_org_quarantines_the_fence_row(
    owner: OwnerClient, engine: AsyncEngine, other: str
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    accepted = await owner.accept(scope, env)
    if other == "runtime_work_binding_digest":
        intruder = Scope(scope.org_id, runtime_work_binding_digest=effect_payload_digest({"x": 1}))
    else:
        intruder = scope.with_(**{other: "other-2"})
    # The intruder's own consistent envelope, carrying the first scope's key.
    foreign = envelope(intruder, key=env.effect_handoff_key)
    for call in (
        owner.accept(intruder, foreign),
        owner.reject(
            intruder, env.effect_handoff_key, env.payload_digest, env.runtime_outbox_message_id
        ),
    ):
        code, reason = await _code(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and reason == "handoff_mismatch"
    row = await _fence_row(engine, scope.org_id, env.effect_handoff_key)
    assert row is not None
    assert row["quarantine_count"] == 2 and row["quarantine_reason"] == "scope_mismatch"
    assert row["state"] == "ACCEPTED"
    assert row["external_command_id"] == accepted.command.command_id
    assert row[other] == getattr(scope, other)  # attributes never change
    assert await count(engine, owner_inbox, org_id=scope.org_id) == 1
    assert await count(engine, external_commands, org_id=scope.org_id) == 1


async def test_the_same_key_under_another_org_is_refused_and_touches_nothing(
    owner: OwnerClient, engine: AsyncEngine
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    await owner.accept(scope, env)
    intruder = Scope(new_org())
    foreign = envelope(intruder, key=env.effect_handoff_key)
    code, reason = await _code(owner.accept(intruder, foreign))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "handoff_mismatch")
    # Exactly the answer a never-seen foreign key gets: nothing is disclosed.
    unseen = envelope(scope, run="never-accepted")
    code2, reason2 = await _code(
        owner.accept(intruder, envelope(intruder, key=unseen.effect_handoff_key))
    )
    assert (code2, reason2) == (code, reason)
    assert await count(engine, owner_inbox, org_id=intruder.org_id) == 0
    assert await count(engine, external_commands, org_id=intruder.org_id) == 0
    row = await _fence_row(engine, scope.org_id, env.effect_handoff_key)
    assert row is not None and row["quarantine_count"] == 0  # another org's row is unreachable


@pytest.mark.parametrize("changed", ["payload_digest", "runtime_outbox_message_id"])
async def test_a_changed_payload_digest_or_outbox_identity_quarantines_the_fence_row(
    owner: OwnerClient, engine: AsyncEngine, changed: str
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    accepted = await owner.accept(scope, env)
    if changed == "payload_digest":
        tampered = envelope(scope, payload={"to": "eve@example.com", "subject": "x", "text": "y"})
        reason_code = "payload_digest_mismatch"
    else:
        tampered = envelope(scope, outbox_id="rob_other")
        reason_code = "outbox_id_mismatch"
    code, reason = await _code(owner.accept(scope, tampered))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "handoff_mismatch")
    row = await _fence_row(engine, scope.org_id, env.effect_handoff_key)
    assert row is not None
    assert row["quarantine_count"] == 1 and row["quarantine_reason"] == reason_code
    assert row["payload_digest"] == env.payload_digest
    assert row["runtime_outbox_message_id"] == env.runtime_outbox_message_id
    assert await count(engine, external_commands, org_id=scope.org_id) == 1
    # The genuine redelivery is still answered from the fence.
    again = await owner.accept(scope, env)
    assert again.duplicate and again.command.command_id == accepted.command.command_id


async def test_two_installations_of_one_org_never_share_a_handoff(
    owner: OwnerClient, engine: AsyncEngine
) -> None:
    a = Scope(new_org())
    b = a.with_(app_installation_id="inst-2")
    env_a, env_b = envelope(a), envelope(b)  # identical run, step, payload and owner kind
    assert env_a.effect_handoff_key != env_b.effect_handoff_key
    ra, rb = await owner.accept(a, env_a), await owner.accept(b, env_b)
    assert ra.command.command_id != rb.command.command_id
    assert await count(engine, external_commands, org_id=a.org_id) == 2


@pytest.mark.parametrize("omitted", ["scope", "key", "digest", "outbox_id"])
async def test_reject_if_unaccepted_with_an_omitted_value_fails_closed(
    owner: OwnerClient, engine: AsyncEngine, omitted: str
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    args = {
        "key": env.effect_handoff_key,
        "digest": env.payload_digest,
        "outbox_id": env.runtime_outbox_message_id,
    }
    if omitted != "scope":
        args[omitted] = ""
    code, _ = await _code(
        owner.reject(
            scope, args["key"], args["digest"], args["outbox_id"], with_scope=omitted != "scope"
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert await count(engine, owner_inbox, org_id=scope.org_id) == 0


@pytest.mark.parametrize("changed", ["digest", "outbox_id"])
async def test_reject_if_unaccepted_with_a_changed_value_fails_closed(
    owner: OwnerClient, engine: AsyncEngine, changed: str
) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    accepted = await owner.accept(scope, env)
    digest = effect_payload_digest({"other": 1}) if changed == "digest" else env.payload_digest
    outbox = "rob_changed" if changed == "outbox_id" else env.runtime_outbox_message_id
    code, reason = await _code(owner.reject(scope, env.effect_handoff_key, digest, outbox))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "handoff_mismatch")
    row = await _fence_row(engine, scope.org_id, env.effect_handoff_key)
    assert row is not None and row["state"] == "ACCEPTED" and row["quarantine_count"] == 1
    assert row["external_command_id"] == accepted.command.command_id


async def test_refusals_before_any_write(owner: OwnerClient, engine: AsyncEngine) -> None:
    scope = Scope(new_org())
    env = envelope(scope)
    no_role = owner.accept(scope, env, md=owner.md(scope, roles=()))
    assert (await _code(no_role))[0] == grpc.StatusCode.PERMISSION_DENIED
    bad_digest = envelope(scope, payload_digest=effect_payload_digest({"x": 2}))
    assert await _code(owner.accept(scope, bad_digest)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "payload_digest_invalid",
    )
    by_ref = envelope(scope)
    by_ref.payload_reference = "cas://somewhere"
    assert (await _code(owner.accept(scope, by_ref)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    unserved = envelope(scope, owner_kind="sms.twilio")
    assert await _code(owner.accept(scope, unserved)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "effect_owner_kind_not_served",
    )
    other = scope.with_(app_installation_id="inst-9")
    mixed = envelope(other)  # envelope of another scope under this scope's credential
    assert (await _code(owner.accept(scope, mixed)))[0] == grpc.StatusCode.PERMISSION_DENIED
    malformed = envelope(scope, key="not-a-key", outbox_id="rob_x")
    assert (await _code(owner.accept(scope, malformed)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert await count(engine, owner_inbox, org_id=scope.org_id) == 0


async def test_reads_are_scoped_and_answer_like_missing_across_scopes(
    owner: OwnerClient,
) -> None:
    scope = Scope(new_org())
    accepted = [await owner.accept(scope, envelope(scope, run=f"run-{i}")) for i in range(3)]
    stub, md = owner.stub, owner.md(scope, roles=())
    cid = accepted[0].command.command_id
    got = await stub.GetCommand(
        effect_v1.GetCommandRequest(scope=scope.proto(), command_id=cid), metadata=md
    )
    assert got.command.command_id == cid and got.fence.state == ACCEPTED
    by_key = await stub.GetCommand(
        effect_v1.GetCommandRequest(
            scope=scope.proto(), effect_handoff_key=accepted[1].command.effect_handoff_key
        ),
        metadata=md,
    )
    assert by_key.command.command_id == accepted[1].command.command_id
    page1 = await stub.ListCommands(
        effect_v1.ListCommandsRequest(scope=scope.proto(), page_size=2), metadata=md
    )
    page2 = await stub.ListCommands(
        effect_v1.ListCommandsRequest(
            scope=scope.proto(), page_size=2, page_token=page1.next_page_token
        ),
        metadata=md,
    )
    listed = [c.command_id for c in (*page1.commands, *page2.commands)]
    assert sorted(listed) == sorted(a.command.command_id for a in accepted)
    assert page2.next_page_token == ""
    # Another installation of the org, and another org: exactly like a missing command.
    for other in (scope.with_(app_installation_id="inst-2"), Scope(new_org())):
        omd = owner.md(other, roles=())
        for req in (
            effect_v1.GetCommandRequest(scope=other.proto(), command_id=cid),
            effect_v1.GetCommandRequest(scope=other.proto(), command_id="cmd_missing"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetCommand(req, metadata=omd)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        empty = await stub.ListCommands(
            effect_v1.ListCommandsRequest(scope=other.proto()), metadata=omd
        )
        assert list(empty.commands) == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetReceipt(
            effect_v1.GetReceiptRequest(scope=scope.proto(), command_id=cid), metadata=md
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # no outcome yet


async def test_acceptance_reads_the_clock_with_its_request_ledger_lookup(
    owner: OwnerClient, engine: AsyncEngine
) -> None:
    """``AcceptHandoff`` is one transaction whose first statement (the request-ledger
    lookup) also reads the database clock: no statement of its own for the clock, and
    the fence row, the command and the ledger row carry that one time."""
    scope = Scope(new_org())
    with watched_statements(engine) as seen:
        accepted = await owner.accept(scope, envelope(scope))
    assert accepted.fence.state == ACCEPTED and not accepted.duplicate
    assert clock_reads(engine, seen) == []
    row = await _fence_row(engine, scope.org_id, accepted.fence.effect_handoff_key)
    assert row is not None
    async with transaction(engine, readonly=True) as conn:
        created = (
            await conn.execute(
                select(external_commands.c.created_at).where(
                    external_commands.c.org_id == scope.org_id
                )
            )
        ).scalar_one()
    assert created == row["decided_at"]
