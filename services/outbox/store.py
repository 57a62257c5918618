"""Transactional outbox store over any table built with ``outbox_delivery_columns()``.

One implementation serves the runtime's canonical ``runtime_outbox`` (§10.7) and the
effect owner's ``owner_outbox`` (§15.2): an :class:`OutboxTable` names the columns that
differ (message id, dedupe key, scope columns of the keys, optional deadline).

Writes are ``_txn`` helpers that run inside the caller's transaction:

* :func:`enqueue_txn` — the one enqueue API. It runs *last* in the caller's transaction
  (§15.1 step 4): an ``INSERT`` on the unique dedupe key, a duplicate read back and
  compared (same immutable message → the caller's own earlier commit; different →
  :class:`~services.errors.ConflictError`). It takes no lock before the insert and never
  calls back into a root mutator.
* :func:`claim_txn`, :func:`apply_txn`, :func:`expire_lease_txn`, :func:`finalize_txn`,
  :func:`request_reconciliation_txn` —
  each one fenced ``UPDATE`` (``services.db.fenced_update``) on ``state_version``, plus
  the lease token where a lease is held, so a stale dispatcher can never overwrite a newer
  decision (fencing token).

The delivery path's and the polls' statements are built once per table and family set
(``functools.cache``) with bound parameters, so a pass pays neither statement
construction nor cache-key generation.

Reads are org-scoped (``org_id`` leads every predicate; §10.0): discovery
(:func:`orgs_with_due`, :func:`due_messages`, :func:`expired_deliveries`,
:func:`pre_final_messages`) takes no locks — a claim is won by the fenced update — and
the operator read path (:func:`get_message`, :func:`list_messages`,
:func:`count_by_state`) never crosses an org.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Integer, Select, Table, and_, bindparam, func, or_, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from services.db import WORK_SCOPE, db_now, fenced_update, scoped_select
from services.db_batch import Write, execute_writes_if_absent, insert_if_absent_write
from services.errors import ConflictError
from services.outbox.model import (
    DUE_STATES,
    PRE_FINAL_STATES,
    DeliveryState,
    Transition,
    terminal_state_for,
)
from services.telemetry import current_carrier, encode_carrier

__all__ = [
    "EnqueueResult",
    "NewOutboxMessage",
    "OutboxMessage",
    "OutboxTable",
    "PendingEnqueue",
    "PreClaim",
    "apply_txn",
    "claim_txn",
    "count_by_state",
    "due_messages",
    "enqueue_after",
    "enqueue_txn",
    "enqueue_write",
    "expire_lease_txn",
    "expired_deliveries",
    "finalize_txn",
    "get_message",
    "list_messages",
    "orgs_with_due",
    "orgs_with_repair_work",
    "pre_final_messages",
    "request_reconciliation_txn",
]

_DELIVERY_COLUMNS = frozenset(
    {
        "delivery_state",
        "delivery_attempts",
        "next_attempt_at",
        "lease_owner",
        "lease_token",
        "lease_until",
        "last_error_code",
        "delivered_at",
        "state_version",
        "created_at",
        "updated_at",
        # Diagnostics, not message identity: never compared on a duplicate enqueue.
        "trace_context",
    }
)


@dataclass(frozen=True)
class OutboxTable:
    """How one outbox table spells the generic message.

    Attributes:
        table: the table (``*work_scope_columns()``, ``*outbox_delivery_columns()``,
            ``message_family``, ``payload``, ``payload_digest``, ``created_at``,
            ``updated_at`` plus the columns named here).
        id_column: the message identity column.
        key_column: the dedupe key column (unique with the family and the scope columns).
        pk_scope_columns: scope columns that precede ``id_column`` in the primary key.
        dedupe_scope_columns: scope columns of the unique dedupe key.
        deadline_column: optional convergence deadline (§15.4).
    """

    table: Table
    id_column: str
    key_column: str
    pk_scope_columns: tuple[str, ...] = ("org_id",)
    dedupe_scope_columns: tuple[str, ...] = ("org_id",)
    deadline_column: str | None = None

    @functools.cached_property
    def immutable_columns(self) -> tuple[str, ...]:
        """Columns written once at enqueue (compared on a duplicate enqueue); computed
        once per table (every decoded row reads them)."""
        fixed = {*WORK_SCOPE, self.id_column, self.key_column, "message_family"}
        return tuple(
            c.name
            for c in self.table.columns
            if c.name not in _DELIVERY_COLUMNS and c.name not in fixed
        )

    def pk_key(self, message: OutboxMessage) -> dict[str, Any]:
        """The primary key without ``org_id`` (``fenced_update``'s ``key``)."""
        key = {c: getattr(message, c) for c in self.pk_scope_columns if c != "org_id"}
        key[self.id_column] = message.message_id
        return key


@dataclass(frozen=True)
class OutboxMessage:
    """One outbox row. ``extra`` holds the table's family-specific immutable columns."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    message_id: str
    family: str
    key: str
    payload: str
    payload_digest: str
    delivery_state: DeliveryState
    delivery_attempts: int
    next_attempt_at: datetime
    lease_owner: str | None
    lease_token: str | None
    lease_until: datetime | None
    last_error_code: str | None
    delivered_at: datetime | None
    state_version: int
    created_at: datetime
    updated_at: datetime
    deadline: datetime | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: The enqueuing span's W3C trace context (``services.telemetry`` JSON), or None.
    trace_context: str | None = None


@dataclass(frozen=True)
class NewOutboxMessage:
    """What a caller enqueues. ``payload`` is canonical JSON text (no credentials).

    ``trace_context`` (a W3C carrier, ``services.telemetry``) defaults to the current
    span's, so a message enqueued inside a step attempt or a command dispatch continues
    that trace; it is diagnostics and never part of the message identity.
    """

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    message_id: str
    family: str
    key: str
    payload: str
    payload_digest: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    trace_context: Mapping[str, str] | None = None


@dataclass(frozen=True)
class PreClaim:
    """The delivery lease an enqueue writes with a new row (a *pre-claimed* enqueue,
    ADR 0004): the row is born ``Delivering``, leased to ``lease_owner`` with a fresh
    fencing token until ``now + lease_ms``, exactly as :func:`claim_txn` would leave it.
    Only the dispatcher of the producer's own process asks for it, and it is handed the
    leased message after the commit; if that process dies first, the lease expires and
    the repair sweep returns the row to ``Retrying`` like any other lost delivery."""

    lease_owner: str
    lease_ms: int


@dataclass(frozen=True)
class EnqueueResult:
    """``created`` is False when the same message was already enqueued; ``leased`` is the
    new row when it was enqueued pre-claimed (:class:`PreClaim`)."""

    message_id: str
    created: bool
    leased: OutboxMessage | None = None


def _message(spec: OutboxTable, row: RowMapping) -> OutboxMessage:
    extra = {
        c: row[c]
        for c in spec.immutable_columns
        if c not in ("payload", "payload_digest") and c != spec.deadline_column
    }
    return OutboxMessage(
        org_id=row["org_id"],
        app_installation_id=row["app_installation_id"],
        runtime_capability_id=row["runtime_capability_id"],
        runtime_work_binding_digest=row["runtime_work_binding_digest"],
        message_id=row[spec.id_column],
        family=row["message_family"],
        key=row[spec.key_column],
        payload=row["payload"],
        payload_digest=row["payload_digest"],
        delivery_state=DeliveryState(row["delivery_state"]),
        delivery_attempts=int(row["delivery_attempts"]),
        next_attempt_at=row["next_attempt_at"],
        lease_owner=row["lease_owner"],
        lease_token=row["lease_token"],
        lease_until=row["lease_until"],
        last_error_code=row["last_error_code"],
        delivered_at=row["delivered_at"],
        state_version=int(row["state_version"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        deadline=row[spec.deadline_column] if spec.deadline_column else None,
        extra=extra,
        trace_context=row.get("trace_context"),
    )


# --- enqueue ------------------------------------------------------------------------


async def enqueue_txn(
    conn: AsyncConnection,
    spec: OutboxTable,
    message: NewOutboxMessage,
    *,
    now: datetime | None = None,
    preclaim: PreClaim | None = None,
    before: Sequence[Write] = (),
) -> EnqueueResult:
    """Enqueue ``message`` in the caller's transaction; call it after every other lock.

    Insert on the unique key plus catching the duplicate (ARCHITECTURE §2): no read
    before, no lock before. A duplicate is read back by the dedupe key.

    Args:
        conn: the caller's connection inside its transaction.
        spec: the outbox table.
        message: the immutable message.
        now: the database time of the caller's transaction (read once when omitted).
        preclaim: write the new row already leased (see :class:`PreClaim`); a duplicate
            is left as it is.
        before: the caller's writes that go first, in the same round trip where the
            backend batches writes (:func:`enqueue_after`).

    Returns:
        Whether this call created the row (and the leased row, when pre-claimed).

    Raises:
        ConflictError: the dedupe key (or the message id) already holds a different
            message; or whatever a write of ``before`` raises.
    """
    when = now if now is not None else await db_now(conn)
    pending = enqueue_write(spec, message, now=when, preclaim=preclaim)
    return await enqueue_after(conn, before, pending)


@dataclass(frozen=True)
class PendingEnqueue:
    """:func:`enqueue_txn` as the last write of a batch (:func:`enqueue_after`)."""

    spec: OutboxTable
    message: NewOutboxMessage
    #: The row's values (leased to this process's dispatcher when pre-claimed).
    values: Mapping[str, Any]

    @property
    def write(self) -> Write:
        """The INSERT (``services.db_batch.insert_if_absent_write``)."""
        return insert_if_absent_write(self.spec.table, self.values)


def enqueue_write(
    spec: OutboxTable,
    message: NewOutboxMessage,
    *,
    now: datetime,
    preclaim: PreClaim | None = None,
) -> PendingEnqueue:
    """The INSERT :func:`enqueue_txn` would execute (``now``: the transaction's database
    time), for :func:`enqueue_after`."""
    t = spec.table
    unknown = set(message.extra) - set(spec.immutable_columns)
    if unknown:
        raise ValueError(f"{t.name} has no columns {sorted(unknown)}")
    values: dict[str, Any] = {
        "org_id": message.org_id,
        "app_installation_id": message.app_installation_id,
        "runtime_capability_id": message.runtime_capability_id,
        "runtime_work_binding_digest": message.runtime_work_binding_digest,
        spec.id_column: message.message_id,
        "message_family": message.family,
        spec.key_column: message.key,
        "payload": message.payload,
        "payload_digest": message.payload_digest,
        **message.extra,
        "delivery_state": DeliveryState.PENDING.value,
        "delivery_attempts": 0,
        "next_attempt_at": now,
        "lease_owner": None,
        "lease_token": None,
        "lease_until": None,
        "last_error_code": None,
        "delivered_at": None,
        "state_version": 1,
        "created_at": now,
        "updated_at": now,
        "trace_context": (
            current_carrier()
            if message.trace_context is None
            else encode_carrier(message.trace_context)
        ),
    }
    if preclaim is not None:
        until = now + timedelta(milliseconds=preclaim.lease_ms)
        values.update(
            delivery_state=DeliveryState.DELIVERING.value,
            next_attempt_at=until,
            lease_owner=preclaim.lease_owner,
            lease_token=uuid.uuid4().hex,
            lease_until=until,
        )
    return PendingEnqueue(spec, message, values)


async def enqueue_after(
    conn: AsyncConnection, before: Sequence[Write], pending: PendingEnqueue
) -> EnqueueResult:
    """Execute ``before`` (writes of the caller's transaction that only check: its
    other rows, already under their locks) and then ``pending``'s INSERT, in one round
    trip where the backend batches writes (``services.db_batch``); answer as
    :func:`enqueue_txn`.

    Raises:
        ConflictError: as :func:`enqueue_txn`; or whatever a write of ``before`` raises.
    """
    created = await execute_writes_if_absent(conn, [*before, pending.write])
    return await enqueue_settle(conn, pending, created)


async def enqueue_settle(
    conn: AsyncConnection, pending: PendingEnqueue, created: bool
) -> EnqueueResult:
    """Answer as :func:`enqueue_txn` once ``pending``'s INSERT ran in a batch of the
    caller's (``created``: it inserted; ``False``: a row was there, read and compared
    here).

    Raises:
        ConflictError: as :func:`enqueue_txn`.
    """
    spec, message, values = pending.spec, pending.message, pending.values
    t = spec.table
    if created:
        if values["lease_token"] is None:  # not pre-claimed
            return EnqueueResult(message.message_id, True)
        # The row as inserted (every other column NULL): no read-back statement.
        born: Any = {**{c.name: None for c in t.columns}, **values}
        return EnqueueResult(message.message_id, True, _message(spec, born))
    dedupe = (*(c for c in spec.dedupe_scope_columns if c != "org_id"), "message_family")
    by_key = scoped_select(t, (*dedupe, spec.key_column))
    params = {c: values[c] for c in ("org_id", *dedupe, spec.key_column)}
    row = (await conn.execute(by_key, params)).mappings().first()
    if row is None:
        raise ConflictError(
            "outbox message id already names another message", entity=t.name, key=message.message_id
        )
    same = row[spec.id_column] == message.message_id and all(
        row[c] == values[c] for c in ("payload_digest", *WORK_SCOPE, *message.extra)
    )
    if not same:
        raise ConflictError(
            "outbox key already holds a different message", entity=t.name, key=message.key
        )
    return EnqueueResult(message.message_id, False)


# --- discovery (no locks) -------------------------------------------------------------


def _families(spec: OutboxTable, families: Iterable[str]) -> ColumnElement[bool]:
    return spec.table.c.message_family.in_(sorted(families))


def _now(spec: OutboxTable) -> Any:
    """The ``:now`` parameter of a cached statement (typed: UtcDateTime binds)."""
    return bindparam("now", type_=spec.table.c.next_attempt_at.type)


def _org(spec: OutboxTable) -> ColumnElement[bool]:
    """``org_id = :org_id``, the leading predicate of a cached one-org statement."""
    return spec.table.c.org_id == bindparam("org_id", type_=spec.table.c.org_id.type)


_LIMIT = bindparam("limit", type_=Integer())


def _due(spec: OutboxTable, families: tuple[str, ...]) -> list[ColumnElement[bool]]:
    t = spec.table
    return [
        t.c.delivery_state.in_(sorted(s.value for s in DUE_STATES)),
        t.c.next_attempt_at <= _now(spec),
        _families(spec, families),
    ]


@functools.cache
def _orgs_with_due_stmt(spec: OutboxTable, families: tuple[str, ...]) -> Select[Any]:
    return select(spec.table.c.org_id).where(*_due(spec, families)).distinct().limit(_LIMIT)


@functools.cache
def _due_messages_stmt(spec: OutboxTable, families: tuple[str, ...]) -> Select[Any]:
    t = spec.table
    return (
        select(t)
        .where(_org(spec), *_due(spec, families))
        .order_by(t.c.next_attempt_at, t.c[spec.id_column])
        .limit(_LIMIT)
    )


def _repair(spec: OutboxTable) -> ColumnElement[bool]:
    """A ``Delivering`` row whose lease expired before ``:now``."""
    t = spec.table
    return and_(t.c.delivery_state == DeliveryState.DELIVERING.value, t.c.lease_until < _now(spec))


def _pre_final(spec: OutboxTable) -> ColumnElement[bool]:
    return spec.table.c.delivery_state.in_(sorted(s.value for s in PRE_FINAL_STATES))


@functools.cache
def _orgs_with_repair_work_stmt(spec: OutboxTable, families: tuple[str, ...]) -> Select[Any]:
    return (
        select(spec.table.c.org_id)
        .where(_families(spec, families), or_(_repair(spec), _pre_final(spec)))
        .distinct()
        .limit(_LIMIT)
    )


@functools.cache
def _expired_deliveries_stmt(spec: OutboxTable, families: tuple[str, ...]) -> Select[Any]:
    t = spec.table
    return (
        select(t)
        .where(_org(spec), _repair(spec), _families(spec, families))
        .order_by(t.c.lease_until, t.c[spec.id_column])
        .limit(_LIMIT)
    )


@functools.cache
def _pre_final_messages_stmt(spec: OutboxTable, families: tuple[str, ...]) -> Select[Any]:
    t = spec.table
    return (
        select(t)
        .where(_org(spec), _pre_final(spec), _families(spec, families))
        .order_by(t.c.updated_at, t.c[spec.id_column])
        .limit(_LIMIT)
    )


def _shape(families: Iterable[str]) -> tuple[str, ...]:
    """A family set as a statement cache key."""
    return tuple(sorted(families))


async def orgs_with_due(
    conn: AsyncConnection, spec: OutboxTable, families: Iterable[str], now: datetime, limit: int
) -> list[str]:
    """Orgs with at least one due message of ``families`` (bounded)."""
    stmt = _orgs_with_due_stmt(spec, _shape(families))
    return [str(r) for r in (await conn.execute(stmt, {"now": now, "limit": limit})).scalars()]


async def due_messages(
    conn: AsyncConnection,
    spec: OutboxTable,
    org_id: str,
    families: Iterable[str],
    now: datetime,
    limit: int,
) -> list[OutboxMessage]:
    """Due messages of one org, oldest ``next_attempt_at`` first."""
    stmt = _due_messages_stmt(spec, _shape(families))
    params = {"org_id": org_id, "now": now, "limit": limit}
    return [_message(spec, r) for r in (await conn.execute(stmt, params)).mappings()]


async def orgs_with_repair_work(
    conn: AsyncConnection, spec: OutboxTable, families: Iterable[str], now: datetime, limit: int
) -> list[str]:
    """Orgs with an expired delivery lease or a pre-finalization message (bounded)."""
    stmt = _orgs_with_repair_work_stmt(spec, _shape(families))
    return [str(r) for r in (await conn.execute(stmt, {"now": now, "limit": limit})).scalars()]


async def expired_deliveries(
    conn: AsyncConnection,
    spec: OutboxTable,
    org_id: str,
    families: Iterable[str],
    now: datetime,
    limit: int,
) -> list[OutboxMessage]:
    """``Delivering`` rows whose lease expired (their dispatcher died or stalled)."""
    stmt = _expired_deliveries_stmt(spec, _shape(families))
    params = {"org_id": org_id, "now": now, "limit": limit}
    return [_message(spec, r) for r in (await conn.execute(stmt, params)).mappings()]


async def pre_final_messages(
    conn: AsyncConnection, spec: OutboxTable, org_id: str, families: Iterable[str], limit: int
) -> list[OutboxMessage]:
    """Pre-finalization candidates of one org (owner receipt persisted, not finalized)."""
    stmt = _pre_final_messages_stmt(spec, _shape(families))
    params = {"org_id": org_id, "limit": limit}
    return [_message(spec, r) for r in (await conn.execute(stmt, params)).mappings()]


# --- fenced transitions ---------------------------------------------------------------


async def _reread(
    conn: AsyncConnection, spec: OutboxTable, message: OutboxMessage
) -> OutboxMessage:
    key = spec.pk_key(message)
    stmt = scoped_select(spec.table, tuple(key))
    row = (await conn.execute(stmt, {"org_id": message.org_id, **key})).mappings().one()
    return _message(spec, row)


async def claim_txn(
    conn: AsyncConnection,
    spec: OutboxTable,
    message: OutboxMessage,
    *,
    owner: str,
    lease_until: datetime,
    now: datetime,
) -> OutboxMessage:
    """Lease a due message: ``Pending``/``Retrying`` → ``Delivering``; a reconciling
    message keeps its state and gets the lease. ``next_attempt_at`` moves to the lease
    end, so a claimer that dies makes the row due again (reconciliation) or an expired
    delivery for the repair sweep.

    Raises:
        FenceLostError: another dispatcher claimed (or changed) the row first.
    """
    state = message.delivery_state
    target = (
        DeliveryState.RECONCILING
        if state is DeliveryState.RECONCILING
        else DeliveryState.DELIVERING
    )
    values = {
        "delivery_state": target.value,
        "lease_owner": owner,
        "lease_token": uuid.uuid4().hex,
        "lease_until": lease_until,
        "next_attempt_at": lease_until,
        "updated_at": now,
    }
    await fenced_update(
        conn,
        spec.table,
        org_id=message.org_id,
        key=spec.pk_key(message),
        expected_version=message.state_version,
        values=values,
        equal={"delivery_state": state.value},
        at_most={"next_attempt_at": now},
    )
    return _moved(message, {**values, "delivery_state": target})


def _moved(message: OutboxMessage, values: Mapping[str, Any]) -> OutboxMessage:
    """``message`` after a successful :func:`~services.db.fenced_update` of ``values``.

    Every change of an outbox row is such a compare-and-swap on ``state_version``, so the
    row the fence matched is exactly ``message`` and the row now is ``message`` with
    ``values`` and the next version: no re-read statement on the delivery path.
    """
    # The mutable columns carry their field's name; ``delivery_state`` is given as the enum.
    return replace(message, **values, state_version=message.state_version + 1)


def _transition_values(transition: Transition, now: datetime) -> dict[str, Any]:
    values: dict[str, Any] = {
        "delivery_state": transition.state.value,
        "delivery_attempts": transition.attempts,
        "next_attempt_at": transition.next_attempt_at,
        "last_error_code": transition.error_code,
        "lease_owner": None,
        "lease_token": None,
        "lease_until": None,
        "updated_at": now,
    }
    if transition.delivered:
        values["delivered_at"] = now
    return values


async def apply_txn(
    conn: AsyncConnection,
    spec: OutboxTable,
    leased: OutboxMessage,
    transition: Transition,
    *,
    now: datetime,
) -> OutboxMessage:
    """Apply a delivery/reconciliation result under the lease that produced it.

    Raises:
        FenceLostError: the lease was lost (expired and repaired, or re-claimed).
    """
    if leased.lease_token is None:
        raise ValueError("apply_txn needs a leased message")
    values = _transition_values(transition, now)
    await fenced_update(
        conn,
        spec.table,
        org_id=leased.org_id,
        key=spec.pk_key(leased),
        expected_version=leased.state_version,
        values=values,
        equal={"lease_token": leased.lease_token},
    )
    return _moved(leased, {**values, "delivery_state": transition.state})


async def expire_lease_txn(
    conn: AsyncConnection,
    spec: OutboxTable,
    message: OutboxMessage,
    transition: Transition,
    *,
    now: datetime,
) -> OutboxMessage:
    """Repair an expired ``Delivering`` lease (the sweep); fenced on the version and on
    the lease still being expired.

    Raises:
        FenceLostError: the row moved on (its dispatcher finished after all).
    """
    await fenced_update(
        conn,
        spec.table,
        org_id=message.org_id,
        key=spec.pk_key(message),
        expected_version=message.state_version,
        values=_transition_values(transition, now),
        equal={"delivery_state": DeliveryState.DELIVERING.value},
        less_than={"lease_until": now},
    )
    return await _reread(conn, spec, message)


async def request_reconciliation_txn(
    conn: AsyncConnection, spec: OutboxTable, message: OutboxMessage, *, now: datetime
) -> OutboxMessage:
    """Ask the consumer's durable fence *now*: ``Pending``/``Retrying`` →
    ``AcceptanceReconciling`` due at ``now`` (no delivery lease is held in those states).

    A producer that must learn whether an undelivered message can still be accepted — a
    cancelled Flow run whose handoff may be cancelled only after the owner's durable
    ``Rejected`` receipt (§10.1) — calls it last in its own root-first transaction; the
    dispatcher then reconciles instead of delivering, and the family finalizer converges
    the producer on the receipt.

    Raises:
        FenceLostError: the row moved on (claimed, delivered, …); re-read later.
        ValueError: the message is not ``Pending``/``Retrying``.
    """
    state = message.delivery_state
    if state not in (DeliveryState.PENDING, DeliveryState.RETRYING):
        raise ValueError(f"{state} cannot be asked to reconcile")
    await fenced_update(
        conn,
        spec.table,
        org_id=message.org_id,
        key=spec.pk_key(message),
        expected_version=message.state_version,
        values={
            "delivery_state": DeliveryState.RECONCILING.value,
            "next_attempt_at": now,
            "updated_at": now,
        },
        equal={"delivery_state": state.value},
    )
    return await _reread(conn, spec, message)


async def finalize_txn(
    conn: AsyncConnection, spec: OutboxTable, message: OutboxMessage, *, now: datetime
) -> OutboxMessage:
    """Move a pre-finalization message to its terminal non-delivery state.

    Called by a family finalizer inside *its* transaction, after its root-first locks
    (through :class:`~services.outbox.families.FinalizationTicket`).

    Raises:
        FenceLostError: the message changed since the finalizer read it.
        ValueError: the message is not in a pre-finalization state.
    """
    terminal = terminal_state_for(message.delivery_state)
    await fenced_update(
        conn,
        spec.table,
        org_id=message.org_id,
        key=spec.pk_key(message),
        expected_version=message.state_version,
        values={"delivery_state": terminal.value, "updated_at": now},
        equal={"delivery_state": message.delivery_state.value},
    )
    return await _reread(conn, spec, message)


# --- operator read path (org-scoped) --------------------------------------------------


async def get_message(
    conn: AsyncConnection, spec: OutboxTable, org_id: str, message_id: str
) -> OutboxMessage | None:
    """One message of ``org_id`` (None when absent in this org)."""
    t = spec.table
    row = (
        (
            await conn.execute(
                select(t)
                .where(t.c.org_id == org_id, t.c[spec.id_column] == message_id)
                .order_by(*(t.c[c] for c in spec.pk_scope_columns))
                .limit(1)
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else _message(spec, row)


async def list_messages(
    conn: AsyncConnection,
    spec: OutboxTable,
    org_id: str,
    *,
    states: Sequence[DeliveryState] = (),
    family: str | None = None,
    after_id: str | None = None,
    limit: int = 50,
) -> list[OutboxMessage]:
    """Messages of ``org_id`` by message id (keyset paging with ``after_id``)."""
    t = spec.table
    preds: list[ColumnElement[bool]] = [t.c.org_id == org_id]
    if states:
        preds.append(t.c.delivery_state.in_(sorted(s.value for s in states)))
    if family:
        preds.append(t.c.message_family == family)
    if after_id:
        preds.append(t.c[spec.id_column] > after_id)
    stmt = select(t).where(*preds).order_by(t.c[spec.id_column]).limit(max(1, min(limit, 500)))
    return [_message(spec, r) for r in (await conn.execute(stmt)).mappings()]


async def count_by_state(conn: AsyncConnection, spec: OutboxTable, org_id: str) -> dict[str, int]:
    """``{delivery_state: count}`` of ``org_id``."""
    t = spec.table
    stmt = (
        select(t.c.delivery_state, func.count())
        .where(t.c.org_id == org_id)
        .group_by(t.c.delivery_state)
    )
    return {str(state): int(n) for state, n in (await conn.execute(stmt)).all()}
