"""Command transactions of the owner's dispatcher, and the scoped command reads.

Each dispatcher step is one short fenced transaction; provider calls happen between
them, never inside (§15.1: the network call runs after acceptance committed)::

    claim_txn          command CAS (version, state, due) + lease and fencing token;
                       ACCEPTED/DISPATCHING → a new remote attempt IN_FLIGHT (Started);
                       an attempt still IN_FLIGHT from a dead dispatcher, or an
                       OUTCOME_UNKNOWN command → Reconciling (the in-flight attempt is
                       recorded OUTCOME_UNKNOWN: nobody saw its answer)
    record_attempt_txn attempt outcome + command CAS under the lease token
                       (+ receipt and owner-outbox message when terminal)
    record_lookup_txn  the reconciliation decision under the lease token (+ receipt, or a
                       replay attempt with the same idempotency key)

A stale dispatcher (its lease expired and the command was re-claimed) loses the final
fence and writes nothing. Reads are scoped by the complete work scope.

The dispatcher's statements (discovery, claim, attempt insert and finish, the fenced
command updates and re-read) are built once per shape with bound parameters, so a
dispatch pays neither statement construction nor cache-key generation.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Integer, Select, and_, bindparam, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from effect_owner_svc.commands.model import (
    DUE_COMMAND_STATES,
    AttemptOutcome,
    CommandState,
    Complete,
    LookupAgainAt,
    Reconcile,
    Replay,
    RetryAt,
    attempt_outcome_for,
)
from effect_owner_svc.commands.records import (
    AttemptRecord,
    CommandRecord,
    ReceiptRecord,
    attempt_from_row,
    command_from_row,
)
from effect_owner_svc.providers.base import ProviderOutcome
from effect_owner_svc.receipts.store import write_receipt_txn
from effect_owner_svc.schema import external_commands, remote_attempts
from services.auth import TrustedRuntimeWorkScope
from services.db import (
    FencedWrite,
    db_now,
    fenced_update,
    now_column,
    remember_now,
    scoped_select,
)
from services.db_batch import Write, execute_writes, fenced_write
from services.effect_contract import CompletionEvidence
from services.errors import FenceLostError
from services.outbox import PreClaim

__all__ = [
    "Reconciling",
    "Started",
    "attempts_txn",
    "claim_txn",
    "due_commands_txn",
    "get_command_txn",
    "hold_command_txn",
    "list_commands_txn",
    "orgs_with_due_commands_txn",
    "preclaimed_command_values",
    "record_attempt_txn",
    "record_lookup_txn",
    "start_preclaimed_write",
]

_C = external_commands.c
_A = remote_attempts.c


@dataclass(frozen=True)
class Started:
    """A leased command with a new remote attempt IN_FLIGHT: call the provider."""

    command: CommandRecord
    attempt: AttemptRecord


@dataclass(frozen=True)
class Reconciling:
    """A leased OUTCOME_UNKNOWN command: reconcile through the provider."""

    command: CommandRecord


# --- discovery (no locks) -------------------------------------------------------------


_LIMIT = bindparam("limit", type_=Integer())


def _due(kinds: tuple[str, ...]) -> list[ColumnElement[bool]]:
    return [
        _C.state.in_(sorted(s.value for s in DUE_COMMAND_STATES)),
        _C.next_attempt_at <= bindparam("now", type_=_C.next_attempt_at.type),
        _C.effect_owner_kind.in_(kinds),
    ]


@functools.cache
def _orgs_with_due_stmt(kinds: tuple[str, ...]) -> Select[Any]:
    return select(_C.org_id).where(*_due(kinds)).distinct().limit(_LIMIT)


@functools.cache
def _due_commands_stmt(kinds: tuple[str, ...]) -> Select[Any]:
    return (
        select(external_commands)
        .where(_C.org_id == bindparam("org_id", type_=_C.org_id.type), *_due(kinds))
        .order_by(_C.next_attempt_at, _C.external_command_id)
        .limit(_LIMIT)
    )


async def orgs_with_due_commands_txn(
    conn: AsyncConnection, kinds: Iterable[str], now: datetime, limit: int
) -> list[str]:
    """Orgs with a due command of a served owner kind (bounded)."""
    stmt = _orgs_with_due_stmt(tuple(sorted(kinds)))
    return [str(v) for v in (await conn.execute(stmt, {"now": now, "limit": limit})).scalars()]


async def due_commands_txn(
    conn: AsyncConnection, org_id: str, kinds: Iterable[str], now: datetime, limit: int
) -> list[CommandRecord]:
    """Due commands of one org, oldest ``next_attempt_at`` first."""
    stmt = _due_commands_stmt(tuple(sorted(kinds)))
    params = {"org_id": org_id, "now": now, "limit": limit}
    return [command_from_row(r) for r in (await conn.execute(stmt, params)).mappings()]


# --- fenced steps -----------------------------------------------------------------------


#: The attempts of a command, newest first (the first row is the latest).
_ATTEMPTS_NEWEST_FIRST = (
    scoped_select(remote_attempts, ("external_command_id",))
    .order_by(_A.attempt_number.desc())
    .limit(1)
)
_INSERT_ATTEMPT = remote_attempts.insert()


async def _latest_attempt(
    conn: AsyncConnection, org_id: str, command_id: str
) -> AttemptRecord | None:
    params = {"org_id": org_id, "external_command_id": command_id}
    row = (await conn.execute(_ATTEMPTS_NEWEST_FIRST, params)).mappings().first()
    return None if row is None else attempt_from_row(row)


def _attempt_write(
    command: CommandRecord, number: int, now: datetime
) -> tuple[Write, AttemptRecord]:
    """The INSERT of ``command``'s remote attempt ``number`` (``IN_FLIGHT``) and the row
    as it inserts it."""
    attempt = AttemptRecord(
        org_id=command.org_id,
        remote_attempt_id=f"att_{uuid.uuid4().hex}",
        command_id=command.command_id,
        attempt_number=number,
        provider_idempotency_key=command.provider_idempotency_key,
        outcome=AttemptOutcome.IN_FLIGHT,
        safe_error_code=None,
        response_digest=None,
        state_version=1,
        started_at=now,
        finished_at=None,
    )
    values = {
        "org_id": attempt.org_id,
        "remote_attempt_id": attempt.remote_attempt_id,
        "external_command_id": attempt.command_id,
        "attempt_number": number,
        "provider_idempotency_key": attempt.provider_idempotency_key,
        "outcome": AttemptOutcome.IN_FLIGHT.value,
        "safe_error_code": None,
        "response_digest": None,
        "state_version": 1,
        "started_at": now,
        "finished_at": None,
    }
    return Write(_INSERT_ATTEMPT, values), attempt


async def _insert_attempt(
    conn: AsyncConnection, command: CommandRecord, number: int, now: datetime
) -> AttemptRecord:
    write, attempt = _attempt_write(command, number, now)
    await execute_writes(conn, [write])
    return attempt


def _param(name: str) -> Any:
    """A bound parameter typed like the attempt column ``name`` (``p_`` prefixed: a SET
    clause reserves the column's own name)."""
    return bindparam(f"p_{name}", type_=_A[name].type)


#: An IN_FLIGHT attempt's outcome, fenced on its version (its own row-count check).
_FINISH_ATTEMPT = (
    update(remote_attempts)
    .where(
        _A.org_id == _param("org_id"),
        _A.remote_attempt_id == _param("remote_attempt_id"),
        _A.state_version == _param("state_version"),
        _A.outcome == AttemptOutcome.IN_FLIGHT.value,
    )
    .values(
        outcome=_param("outcome"),
        safe_error_code=_param("safe_error_code"),
        response_digest=_param("response_digest"),
        state_version=_A.state_version + 1,
        finished_at=_param("finished_at"),
    )
)


def _finish_attempt(
    attempt: AttemptRecord,
    outcome: AttemptOutcome,
    code: str,
    response_digest: str,
    now: datetime,
) -> Write:
    async def check(rowcount: int) -> None:
        if rowcount != 1:
            raise FenceLostError(
                "remote_attempt", attempt.remote_attempt_id, attempt.state_version, None
            )

    return Write(
        _FINISH_ATTEMPT,
        {
            "p_org_id": attempt.org_id,
            "p_remote_attempt_id": attempt.remote_attempt_id,
            "p_state_version": attempt.state_version,
            "p_outcome": outcome.value,
            "p_safe_error_code": code or None,
            "p_response_digest": response_digest or None,
            "p_finished_at": now,
        },
        check=check,
    )


async def claim_txn(
    conn: AsyncConnection,
    command: CommandRecord,
    *,
    owner: str,
    lease_until: datetime,
    now: datetime,
) -> Started | Reconciling:
    """Lease a due command and decide what to do with it (see the module docstring).

    Raises:
        FenceLostError: another dispatcher claimed or changed it first.
    """
    # A command still ACCEPTED has never had an attempt (every attempt is inserted in the
    # transaction that moves it to DISPATCHING, and nothing moves it back); the fence
    # below re-checks that state, so a just-accepted command skips the attempt read.
    fresh = command.state is CommandState.ACCEPTED
    latest = None if fresh else await _latest_attempt(conn, command.org_id, command.command_id)
    interrupted = latest is not None and latest.outcome is AttemptOutcome.IN_FLIGHT
    reconcile = command.state is CommandState.OUTCOME_UNKNOWN or interrupted
    values: dict[str, Any] = {
        "lease_owner": owner,
        "lease_token": uuid.uuid4().hex,
        "lease_until": lease_until,
        # Due again only when the lease is over: a dead dispatcher's command comes back.
        "next_attempt_at": lease_until,
        "updated_at": now,
    }
    if reconcile:
        values["state"] = CommandState.OUTCOME_UNKNOWN.value
        if interrupted:
            values["safe_error_code"] = "owner_interrupted"
    else:
        values["state"] = CommandState.DISPATCHING.value
        values["attempt_count"] = command.attempt_count + 1
    await fenced_update(
        conn,
        external_commands,
        org_id=command.org_id,
        key={"external_command_id": command.command_id},
        expected_version=command.state_version,
        values=values,
        equal={"state": command.state.value},
        at_most={"next_attempt_at": now},
    )
    leased = _after_fence(command, values)
    if reconcile:
        if interrupted and latest is not None:
            # Nobody saw this attempt's answer (the dispatcher died or stalled past its
            # lease): its outcome is unknown, never assumed.
            finish = _finish_attempt(
                latest, AttemptOutcome.OUTCOME_UNKNOWN, "owner_interrupted", "", now
            )
            await execute_writes(conn, [finish])
        return Reconciling(leased)
    attempt = await _insert_attempt(conn, leased, leased.attempt_count, now)
    return Started(leased, attempt)


def preclaimed_command_values(preclaim: PreClaim, now: datetime) -> dict[str, Any]:
    """The columns an acceptance writes over a new command's ``ACCEPTED`` values when it
    leases the command to this process's dispatcher (ADR 0008): exactly what
    :func:`claim_txn` would leave on a fresh command — ``DISPATCHING``, first attempt
    counted, lease owner, a fresh fencing token, ``lease_until = next_attempt_at = now +
    lease`` (the acceptance's database clock). ``state_version`` stays 1: the row is born
    in this state."""
    until = now + timedelta(milliseconds=preclaim.lease_ms)
    return {
        "state": CommandState.DISPATCHING.value,
        "attempt_count": 1,
        "lease_owner": preclaim.lease_owner,
        "lease_token": uuid.uuid4().hex,
        "lease_until": until,
        "next_attempt_at": until,
    }


def start_preclaimed_write(command: CommandRecord, now: datetime) -> tuple[Write, Started]:
    """The remote attempt IN_FLIGHT of a command inserted pre-claimed (a write of the
    acceptance's transaction, right after the command row's) and the :class:`Started` a
    claim would return, so the provider is called after that transaction commits and
    never before."""
    write, attempt = _attempt_write(command, 1, now)
    return write, Started(command, attempt)


def _after_fence(command: CommandRecord, values: Mapping[str, Any]) -> CommandRecord:
    """``command`` as a fenced UPDATE that matched exactly its ``state_version`` left it:
    its columns overwritten by ``values`` (column names are the record's fields), the
    version one higher. Nothing else can have changed the row between the fence's match
    and this transaction's end (the UPDATE holds its lock), so reading it back would
    return exactly this — one statement per claim and per recorded outcome less
    (``test_command_store_derived_rows.py`` compares both)."""
    fields = {k: v for k, v in values.items() if k != "state"}
    if "state" in values:
        fields["state"] = CommandState(values["state"])
    return replace(command, **fields, state_version=command.state_version + 1)


async def _fence_leased(
    conn: AsyncConnection, leased: CommandRecord, values: dict[str, Any], now: datetime
) -> CommandRecord:
    applied = {**values, "updated_at": now}
    await fenced_update(
        conn,
        external_commands,
        org_id=leased.org_id,
        key={"external_command_id": leased.command_id},
        expected_version=leased.state_version,
        values=applied,
        equal={"lease_token": leased.lease_token},
    )
    return _after_fence(leased, applied)


def _leased_write(
    conn: AsyncConnection, leased: CommandRecord, values: dict[str, Any], now: datetime
) -> tuple[Write, CommandRecord]:
    """:func:`_fence_leased` as a write of a batch (the same statement and check)."""
    applied = {**values, "updated_at": now}
    fence = FencedWrite(
        external_commands,
        leased.org_id,
        {"external_command_id": leased.command_id},
        leased.state_version,
        applied,
        {"lease_token": leased.lease_token},
    )
    return fenced_write(conn, fence), _after_fence(leased, applied)


@functools.cache
def _hold_statement(dialect_name: str, clock: ColumnElement[Any]) -> Select[Any]:
    c = external_commands.c
    return (
        select(clock, c.state_version)
        .where(c.org_id == bindparam("org_id"), c.external_command_id == bindparam("command_id"))
        .with_for_update()
    )


async def hold_command_txn(conn: AsyncConnection, command: CommandRecord) -> datetime:
    """Lock ``command``'s row (``FOR UPDATE``; the lock its fenced UPDATE would take
    first — the same place in the lock order) and read the database clock in the same
    statement, kept as the transaction's ``db_now`` (``services.db.remember_now``): the
    outcome's writes then go in one round trip (:func:`record_attempt_txn` with
    ``held=True``, ADR 0010). A command row that is gone reads the clock alone (its
    fenced UPDATE then refuses)."""
    clock, parse = now_column(conn.dialect)
    stmt = _hold_statement(conn.dialect.name, clock)
    params = {"org_id": command.org_id, "command_id": command.command_id}
    row = (await conn.execute(stmt, params)).first()
    if row is None:
        return await db_now(conn)
    return remember_now(conn, parse(row.db_now))


_RELEASE = {"lease_owner": None, "lease_token": None, "lease_until": None}


def _complete_values(leased: CommandRecord, decision: Complete) -> dict[str, Any]:
    return {
        **_RELEASE,
        "state": decision.state.value,
        "outcome_version": leased.outcome_version + 1,
        "safe_error_code": decision.safe_error_code or None,
        "result_digest": decision.result_digest or None,
        "next_attempt_at": None,
    }


def _evidence(command: CommandRecord, decision: Complete) -> CompletionEvidence:
    return CompletionEvidence(
        command_id=command.command_id,
        outcome_version=command.outcome_version,
        outcome=decision.outcome,
        effect_owner_kind=command.effect_owner_kind,
        effect_handoff_key=command.effect_handoff_key,
        safe_error_code=decision.safe_error_code,
        result_digest=decision.result_digest,
    )


async def _fence_complete(
    conn: AsyncConnection, leased: CommandRecord, decision: Complete, now: datetime
) -> tuple[CommandRecord, CompletionEvidence]:
    command = await _fence_leased(conn, leased, _complete_values(leased, decision), now)
    return command, _evidence(command, decision)


async def record_attempt_txn(
    conn: AsyncConnection,
    started: Started,
    outcome: ProviderOutcome,
    decision: Complete | RetryAt | Reconcile,
    now: datetime,
    *,
    preclaim: PreClaim | None = None,
    held: bool = False,
) -> ReceiptRecord | None:
    """Record one remote attempt's outcome and the command's next state.

    Lock order: command (fenced on the lease token) → attempt → receipt → outbox.

    ``held``: this transaction holds the command's row already
    (:func:`hold_command_txn`), so its fenced UPDATE goes in the same round trip as the
    rows after it (ADR 0010); otherwise the UPDATE goes alone first — it is the statement
    that takes the lock.

    Returns:
        The completion receipt when the command became terminal.

    Raises:
        FenceLostError: the lease was lost (a newer claim owns the command).
    """
    leased = started.command
    match decision:
        case Complete():
            values = _complete_values(leased, decision)
        case RetryAt(when, code):
            values = {
                **_RELEASE,
                "state": CommandState.DISPATCHING.value,
                "next_attempt_at": when,
                "safe_error_code": code,
            }
        case Reconcile(code):
            values = {
                **_RELEASE,
                "state": CommandState.OUTCOME_UNKNOWN.value,
                "next_attempt_at": now,
                "safe_error_code": code,
            }
    fence, command = _leased_write(conn, leased, values, now)
    first: list[Write] = [fence]
    if not held:
        await execute_writes(conn, first)
        first = []
    # The command's lock is held: every row below is its attempt, receipt and outbox
    # message, written only under that lock — one round trip (ADR 0010).
    finish = _finish_attempt(
        started.attempt,
        attempt_outcome_for(outcome),
        outcome.safe_error_code,
        outcome.result_digest,
        now,
    )
    if not isinstance(decision, Complete):
        await execute_writes(conn, [*first, finish])
        return None
    evidence = _evidence(command, decision)
    return await write_receipt_txn(
        conn, command, evidence, now, preclaim=preclaim, before=[*first, finish]
    )


async def record_lookup_txn(
    conn: AsyncConnection,
    reconciling: Reconciling,
    decision: Complete | Replay | LookupAgainAt,
    now: datetime,
    *,
    preclaim: PreClaim | None = None,
) -> ReceiptRecord | Started | None:
    """Record a reconciliation decision (§15.3).

    Returns:
        The receipt (terminal), a :class:`Started` replay attempt with the same
        idempotency key (the lease is kept), or None (look up again later).

    Raises:
        FenceLostError: the lease was lost.
    """
    leased = reconciling.command
    match decision:
        case Complete():
            command, evidence = await _fence_complete(conn, leased, decision, now)
            return await write_receipt_txn(conn, command, evidence, now, preclaim=preclaim)
        case Replay(code):
            command = await _fence_leased(
                conn,
                leased,
                {
                    "state": CommandState.DISPATCHING.value,
                    "attempt_count": leased.attempt_count + 1,
                    "safe_error_code": code,
                },
                now,
            )
            attempt = await _insert_attempt(conn, command, command.attempt_count, now)
            return Started(command, attempt)
        case LookupAgainAt(when, code):
            await _fence_leased(
                conn,
                leased,
                {
                    **_RELEASE,
                    "reconcile_attempts": leased.reconcile_attempts + 1,
                    "next_attempt_at": when,
                    "safe_error_code": code,
                },
                now,
            )
    return None


# --- scoped reads ---------------------------------------------------------------------


def _scope(scope: TrustedRuntimeWorkScope) -> list[ColumnElement[bool]]:
    return [
        _C.org_id == scope.org_id,
        _C.app_installation_id == scope.app_installation_id,
        _C.runtime_capability_id == scope.runtime_capability_id,
        _C.runtime_work_binding_digest == scope.runtime_work_binding_digest,
    ]


async def get_command_txn(
    conn: AsyncConnection,
    scope: TrustedRuntimeWorkScope,
    *,
    command_id: str | None = None,
    effect_handoff_key: str | None = None,
) -> CommandRecord | None:
    """A command of exactly ``scope`` by id or handoff key (None: absent *in scope*)."""
    preds = _scope(scope)
    if command_id is not None:
        preds.append(_C.external_command_id == command_id)
    elif effect_handoff_key is not None:
        preds.append(_C.effect_handoff_key == effect_handoff_key)
    else:
        raise ValueError("command_id or effect_handoff_key is required")
    row = (await conn.execute(select(external_commands).where(*preds))).mappings().first()
    return None if row is None else command_from_row(row)


async def list_commands_txn(
    conn: AsyncConnection,
    scope: TrustedRuntimeWorkScope,
    *,
    states: Sequence[CommandState] = (),
    flow_run_id: str = "",
    after: tuple[datetime, str] | None = None,
    limit: int = 50,
) -> list[CommandRecord]:
    """Commands of exactly ``scope`` by acceptance time then id (keyset ``after``)."""
    preds = _scope(scope)
    if states:
        preds.append(_C.state.in_(sorted(s.value for s in states)))
    if flow_run_id:
        preds.append(_C.flow_run_id == flow_run_id)
    if after is not None:
        at, cid = after
        preds.append(
            or_(_C.created_at > at, and_(_C.created_at == at, _C.external_command_id > cid))
        )
    stmt = (
        select(external_commands)
        .where(*preds)
        .order_by(_C.created_at, _C.external_command_id)
        .limit(limit)
    )
    return [command_from_row(r) for r in (await conn.execute(stmt)).mappings()]


async def attempts_txn(conn: AsyncConnection, org_id: str, command_id: str) -> list[AttemptRecord]:
    """Remote attempts of a command (already scope-checked by the caller), by number."""
    stmt = (
        select(remote_attempts)
        .where(_A.org_id == org_id, _A.external_command_id == command_id)
        .order_by(_A.attempt_number)
    )
    return [attempt_from_row(r) for r in (await conn.execute(stmt)).mappings()]
