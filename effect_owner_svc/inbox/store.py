"""The owner inbox: ``AcceptHandoff`` and ``RejectIfUnaccepted`` on one unique key
(spec §10.7, §15.1, §15.4; STYLE 8).

Both transactions start with an ``INSERT`` of the fence row on its primary key
``(org_id, effect_handoff_key)`` — acceptance inserts ``ACCEPTED`` together with its one
``ExternalCommand``, rejection inserts a ``REJECTED`` tombstone — so they serialize on the
database's unique-key lock: whichever commits first wins, and the other gets the
duplicate, reads the winner under ``FOR UPDATE`` and answers from it. A read that finds
no row is never used as proof of non-acceptance.

On a duplicate the request's validation attributes are compared with the row
(:func:`~effect_owner_svc.inbox.fence.mismatch`); a difference writes a quarantine
marker on the existing row, commits it, and only then refuses with
:class:`~effect_owner_svc.errors.HandoffMismatchError` — nothing else is written and no
second row can exist. A key that was not minted for the caller's trusted scope is
refused the same way (after marking the row of that key in the caller's org, if any).

Lock order inside the owner: inbox row → command → remote attempt → receipt → owner
outbox (the dispatcher never takes an inbox lock).

An acceptance in a process whose command dispatcher has room may insert its command
already leased to that dispatcher, with the first remote attempt ``IN_FLIGHT`` (the
*pre-claimed command*, ADR 0008): the claim transaction a dispatcher would run next
decides nothing this transaction does not know, and the provider is still called only
after this transaction committed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, bindparam, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.commands.model import CommandState
from effect_owner_svc.commands.records import (
    CommandRecord,
    FenceRecord,
    command_from_row,
    fence_from_row,
)
from effect_owner_svc.commands.store import (
    Started,
    preclaimed_command_values,
    start_preclaimed_write,
)
from effect_owner_svc.errors import HandoffMismatchError, HandoffRejectedError
from effect_owner_svc.inbox.fence import (
    FenceState,
    HandoffAttributes,
    MismatchReason,
    key_scope_mismatch,
    mismatch,
)
from effect_owner_svc.schema import external_commands, owner_inbox
from services.db import db_now, insert_if_absent, run_in_transaction, scoped_select
from services.db_batch import Write, execute_writes_if_absent, insert_if_absent_write
from services.effect_contract import provider_idempotency_key
from services.faults import CrashPoint, crash_point
from services.outbox import PreClaim
from services.telemetry import current_carrier

__all__ = [
    "Accepted",
    "HandoffRequest",
    "Refusal",
    "accept_handoff",
    "accept_handoff_txn",
    "get_fence_txn",
    "new_command_id",
    "refuse_foreign_key",
    "reject_if_unaccepted",
    "reject_if_unaccepted_txn",
]


def new_command_id() -> str:
    """An unpredictable command identity (the handoff key, not this id, is the dedupe
    key; the id is what receipts and wake tokens name)."""
    return f"cmd_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class HandoffRequest:
    """A validated ``AcceptHandoff`` envelope (see ``effect_owner_svc.api``)."""

    attributes: HandoffAttributes
    effect_owner_kind: str
    payload_schema_version: int
    payload_json: str
    flow_run_id: str
    step_execution_id: str
    submission_attempt_id: str
    deadline: datetime | None
    failure_policy: str | None


@dataclass(frozen=True)
class Accepted:
    """The ACCEPTED fence and its one command; ``duplicate`` when it existed before;
    ``started`` when this acceptance inserted the command pre-claimed (ADR 0008): its
    lease and first remote attempt, to hand to the dispatcher after the commit."""

    fence: FenceRecord
    command: CommandRecord
    duplicate: bool
    started: Started | None = None


@dataclass(frozen=True)
class Refusal:
    """A refused request, as a value (its transaction may have committed a quarantine
    marker); ``reason`` None means the key holds a REJECTED tombstone."""

    reason: MismatchReason | None

    def error(self) -> HandoffMismatchError | HandoffRejectedError:
        """The error the caller is answered with."""
        return HandoffRejectedError() if self.reason is None else HandoffMismatchError()


# The acceptance path's statements, built once with bound parameters.
_FENCE = scoped_select(owner_inbox, ("effect_handoff_key",))
_FENCE_FOR_UPDATE = scoped_select(owner_inbox, ("effect_handoff_key",), for_update=True)
_COMMAND_BY_KEY = scoped_select(external_commands, ("effect_handoff_key",))
_INSERT_COMMAND = external_commands.insert()
_QUARANTINE = (
    update(owner_inbox)
    .where(
        owner_inbox.c.org_id == bindparam("k_org_id", type_=owner_inbox.c.org_id.type),
        owner_inbox.c.effect_handoff_key
        == bindparam("k_effect_handoff_key", type_=owner_inbox.c.effect_handoff_key.type),
    )
    .values(
        quarantine_count=owner_inbox.c.quarantine_count + 1,
        quarantine_reason=bindparam("v_reason", type_=owner_inbox.c.quarantine_reason.type),
        quarantined_at=bindparam("v_at", type_=owner_inbox.c.quarantined_at.type),
    )
)


def _key(attrs: HandoffAttributes) -> dict[str, str]:
    """The parameters of a statement by ``(org_id, effect_handoff_key)``."""
    return {"org_id": attrs.org_id, "effect_handoff_key": attrs.effect_handoff_key}


async def get_fence_txn(
    conn: AsyncConnection, attrs: HandoffAttributes, *, for_update: bool = False
) -> FenceRecord | None:
    """The fence row of ``attrs.effect_handoff_key`` in ``attrs.org_id`` (None if absent).

    The caller compares the remaining scope attributes; a read never proves absence of
    acceptance in another sense than "no row in this org".
    """
    stmt = _FENCE_FOR_UPDATE if for_update else _FENCE
    row = (await conn.execute(stmt, _key(attrs))).mappings().first()
    return None if row is None else fence_from_row(row)


def _fence_row(
    attrs: HandoffAttributes,
    state: FenceState,
    command_id: str | None,
    payload_schema_version: int,
    now: datetime,
) -> dict[str, object]:
    """The values of a new fence row (its key, its validation attributes, its decision)."""
    return {
        "org_id": attrs.org_id,
        "app_installation_id": attrs.app_installation_id,
        "runtime_capability_id": attrs.runtime_capability_id,
        "runtime_work_binding_digest": attrs.runtime_work_binding_digest,
        "effect_handoff_key": attrs.effect_handoff_key,
        "runtime_outbox_message_id": attrs.runtime_outbox_message_id,
        "payload_digest": attrs.payload_digest,
        "payload_schema_version": payload_schema_version,
        "state": state.value,
        "external_command_id": command_id,
        "decided_at": now,
        "quarantine_count": 0,
    }


async def _quarantine_txn(
    conn: AsyncConnection, attrs: HandoffAttributes, reason: MismatchReason, now: datetime
) -> None:
    # A marker, not a state change: the decision and the attributes stay as they are.
    params = {"k_org_id": attrs.org_id, "k_effect_handoff_key": attrs.effect_handoff_key}
    await conn.execute(_QUARANTINE, {**params, "v_reason": reason.value, "v_at": now})


async def refuse_foreign_key(engine: AsyncEngine, attrs: HandoffAttributes) -> None:
    """Refuse a key that was not minted for the trusted scope; marks the key's row in
    the caller's org, if one exists, first.

    Raises:
        HandoffMismatchError: always.
    """

    async def fn(conn: AsyncConnection) -> None:
        if await get_fence_txn(conn, attrs, for_update=True) is not None:
            await _quarantine_txn(conn, attrs, MismatchReason.SCOPE, await db_now(conn))

    await run_in_transaction(engine, fn)
    raise HandoffMismatchError()


async def _existing_fence_txn(conn: AsyncConnection, attrs: HandoffAttributes) -> FenceRecord:
    # The duplicate that made our insert fail is committed and never deleted.
    fence = await get_fence_txn(conn, attrs, for_update=True)
    if fence is None:
        raise RuntimeError("owner_inbox: duplicate key but no row (invariant broken)")
    return fence


async def _command_txn(conn: AsyncConnection, attrs: HandoffAttributes) -> CommandRecord:
    row = (await conn.execute(_COMMAND_BY_KEY, _key(attrs))).mappings().one()
    return command_from_row(row)


def _as_row(table: Table, values: Mapping[str, Any]) -> Any:
    """The row ``values`` inserted into ``table`` (every other column NULL; the callers
    give every column that has a server default)."""
    return {**{c.name: None for c in table.columns}, **values}


async def accept_handoff_txn(
    conn: AsyncConnection,
    request: HandoffRequest,
    *,
    preclaim: PreClaim | None = None,
    record: Callable[[Accepted], Write | None] | None = None,
) -> Accepted | Refusal:
    """Accept the handoff and its one command, or find the existing acceptance (caller's
    transaction; the key's scope grammar was checked by the caller).

    With ``preclaim`` (this process's command dispatcher serves the kind and has room)
    a new command is inserted leased to that dispatcher with its first remote attempt
    ``IN_FLIGHT`` (:attr:`Accepted.started`); a duplicate is never leased.

    ``record``: given the new acceptance this transaction is about to insert, the write
    that records it (the request ledger's row, ``services.request_dedupe.JoinedRecord``)
    — executed last in the acceptance's round trip, so only when the fence row is new;
    the new acceptance returned is that same object.

    Returns:
        :class:`Accepted`, or a :class:`Refusal` — a REJECTED tombstone, or a mismatch
        whose quarantine marker this transaction wrote (commit it, then refuse).
    """
    attrs = request.attributes
    now = await db_now(conn)
    command_id = new_command_id()
    fence_values = _fence_row(
        attrs, FenceState.ACCEPTED, command_id, request.payload_schema_version, now
    )
    command_values = dict(
        org_id=attrs.org_id,
        app_installation_id=attrs.app_installation_id,
        runtime_capability_id=attrs.runtime_capability_id,
        runtime_work_binding_digest=attrs.runtime_work_binding_digest,
        external_command_id=command_id,
        effect_handoff_key=attrs.effect_handoff_key,
        effect_owner_kind=request.effect_owner_kind,
        payload_schema_version=request.payload_schema_version,
        payload=request.payload_json,
        payload_digest=attrs.payload_digest,
        state=CommandState.ACCEPTED.value,
        state_version=1,
        outcome_version=0,
        attempt_count=0,
        reconcile_attempts=0,
        next_attempt_at=now,
        created_at=now,
        updated_at=now,
        runtime_outbox_message_id=attrs.runtime_outbox_message_id,
        flow_run_id=request.flow_run_id,
        step_execution_id=request.step_execution_id,
        submission_attempt_id=request.submission_attempt_id,
        deadline=request.deadline,
        failure_policy=request.failure_policy,
        provider_idempotency_key=provider_idempotency_key(
            request.effect_owner_kind, attrs.effect_handoff_key
        ),
        # The acceptance span's trace: the provider call and receipt continue it.
        trace_context=current_carrier(),
    )
    if preclaim is not None:
        command_values.update(preclaimed_command_values(preclaim, now))
    # Both rows as this transaction inserts them (their other columns NULL or at their
    # defaults): no read-back statement on the acceptance path.
    command = command_from_row(_as_row(external_commands, command_values))
    writes = [
        insert_if_absent_write(owner_inbox, fence_values),
        Write(_INSERT_COMMAND, command_values),
    ]
    started = None
    if preclaim is not None:
        attempt, started = start_preclaimed_write(command, now)
        writes.append(attempt)
    accepted = Accepted(fence_from_row(_as_row(owner_inbox, fence_values)), command, False, started)
    recording = None if record is None else record(accepted)
    if recording is not None:
        writes.append(recording)
    # The fence row first: a duplicate key there is the existing acceptance (or
    # tombstone), and the server runs nothing after it — the command, its attempt and
    # the request's ledger row are inserted only with a new fence row, in one round trip
    # (ADR 0010).
    if await execute_writes_if_absent(conn, writes):
        return accepted
    fence = await _existing_fence_txn(conn, attrs)
    reason = mismatch(fence.attributes, attrs)
    if reason is None and fence.state is FenceState.ACCEPTED:
        command = await _command_txn(conn, attrs)
        if command.effect_owner_kind == request.effect_owner_kind:
            return Accepted(fence, command, True)
        reason = MismatchReason.OWNER_KIND
    if reason is not None:
        await _quarantine_txn(conn, attrs, reason, now)
    return Refusal(reason)


async def accept_handoff(engine: AsyncEngine, request: HandoffRequest) -> Accepted:
    """:func:`accept_handoff_txn` in its own transaction, refusals raised after commit.

    Raises:
        HandoffRejectedError: the key holds a durable REJECTED tombstone.
        HandoffMismatchError: scope, payload digest or outbox identity differ from the
            fence row (a quarantine marker was committed), or the key was not minted
            for the trusted scope.
    """
    if key_scope_mismatch(request.attributes):
        await refuse_foreign_key(engine, request.attributes)
    result = await run_in_transaction(engine, lambda conn: accept_handoff_txn(conn, request))
    if isinstance(result, Refusal):
        raise result.error()
    if not result.duplicate:
        crash_point(CrashPoint.AFTER_INBOX_ACCEPT, request.effect_owner_kind)
    return result


async def reject_if_unaccepted_txn(
    conn: AsyncConnection, attrs: HandoffAttributes
) -> FenceRecord | Refusal:
    """Find the existing fence, or record a REJECTED tombstone (caller's transaction).

    Returns:
        The ACCEPTED or REJECTED fence, or a mismatch :class:`Refusal` whose quarantine
        marker this transaction wrote.
    """
    now = await db_now(conn)
    # A tombstone's payload schema version is unknown (0): no payload was ever seen.
    await insert_if_absent(conn, owner_inbox, _fence_row(attrs, FenceState.REJECTED, None, 0, now))
    fence = await _existing_fence_txn(conn, attrs)
    reason = mismatch(fence.attributes, attrs)
    if reason is not None:
        await _quarantine_txn(conn, attrs, reason, now)
        return Refusal(reason)
    return fence


async def reject_if_unaccepted(engine: AsyncEngine, attrs: HandoffAttributes) -> FenceRecord:
    """Return the existing ACCEPTED receipt, or durably record a REJECTED tombstone.

    Raises:
        HandoffMismatchError: any of the four persisted values differs from the fence
            row (a quarantine marker was committed), or the key was not minted for the
            trusted scope.
    """
    if key_scope_mismatch(attrs):
        await refuse_foreign_key(engine, attrs)
    result = await run_in_transaction(engine, lambda conn: reject_if_unaccepted_txn(conn, attrs))
    if isinstance(result, Refusal):
        raise result.error()
    return result
