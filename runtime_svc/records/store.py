"""SQL of the record engine: ``_txn`` helpers that run inside the caller's transaction.

Each helper is one bounded statement (or a statement plus its diagnostic re-read) on the
runtime schema, always scoped by the trusted ``org_id`` (§10.0). None of them opens,
commits or retries a transaction and none decides lock order: the engine calls them in
the §13.1 order of its :class:`~runtime_svc.resources.LockPlan`.

Portable rules followed here (ARCHITECTURE §2): locks are explicit ``SELECT … FOR UPDATE``
by primary key (SQLite serialises writers with ``BEGIN IMMEDIATE`` instead); the record
fence and the history-sequence reservation are conditional ``UPDATE``\\s checked by row
count; inserts that may collide are ``INSERT`` + duplicate-key detection; no
``RETURNING``, no AUTO_INCREMENT.

Every statement of the write path is built once, at import, with bound parameters
(``sa.bindparam``) and executed with a parameter dict: building a Core statement per call
(``.values(...)``, ``==`` comparisons) and generating its cache key cost more CPU than the
database round trip on the hot path; a module-level statement hits SQLAlchemy's compiled
cache directly.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Dialect, Integer, Row, and_, bindparam, false, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.records.model import ParentRef, RecordState
from runtime_svc.schema import audit_records, business_events, record_history_sequences, records
from services.db import insert_prepared, now_column, remember_now
from services.db_batch import Read, Write, if_absent
from services.digest import canonical_json
from services.errors import FenceLostError
from services.invariants import InvariantError

__all__ = [
    "AuditRow",
    "EventRow",
    "advance_history_txn",
    "advanced_together",
    "advancing_history_write",
    "audit_write",
    "event_write",
    "fields_json",
    "insert_audit_txn",
    "insert_history_txn",
    "insert_record_txn",
    "lock_history_txn",
    "lock_record_history_txn",
    "query_children_txn",
    "read_record_txn",
    "update_record_txn",
]


def _json(value: Any) -> str:
    return canonical_json(value).decode("utf-8")


def fields_json(fields: Mapping[str, Any]) -> str:
    """The stored form of a record's fields (canonical JSON): what :func:`insert_record_txn`
    and :func:`update_record_txn` write, and — encoded — what the record's
    ``record-fields`` digest hashes, so a write encodes its fields once."""
    return _json(fields)


def _state(row: Row[Any]) -> RecordState:
    refs = json.loads(row.parent_refs) if row.parent_refs else []
    return RecordState(
        org_id=row.org_id,
        object_name=row.object_name,
        record_id=row.record_id,
        version=int(row.record_version),
        fields=json.loads(row.fields),
        parent_refs=tuple(ParentRef.from_dict(r) for r in refs),
        is_deleted=bool(row.is_deleted),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


# --- pre-built statements (bound parameters ``k_*`` name the row; see module docstring) --

_R = records.c
_H = record_history_sequences.c
_RECORD_KEY = (
    _R.org_id == bindparam("k_org"),
    _R.object_name == bindparam("k_object"),
    _R.record_id == bindparam("k_record"),
)
_HISTORY_KEY = (
    _H.org_id == bindparam("k_org"),
    _H.object_name == bindparam("k_object"),
    _H.record_id == bindparam("k_record"),
)
_READ_RECORD = select(records).where(*_RECORD_KEY)
_READ_LIVE_RECORD = _READ_RECORD.where(_R.is_deleted == false())
_LOCK_RECORD = _READ_RECORD.with_for_update()
_RECORD_VERSION = select(_R.record_version).where(*_RECORD_KEY)
_INSERT_RECORD = insert(records)
_UPDATE_RECORD = (
    update(records)
    .where(*_RECORD_KEY, _R.record_version == bindparam("k_version"))
    .values(record_version=_R.record_version + 1)
)
_HISTORY_LAST = select(_H.last_sequence).where(*_HISTORY_KEY)
_LOCK_HISTORY = _HISTORY_LAST.with_for_update()
_INSERT_HISTORY = insert(record_history_sequences)
_ADVANCE_HISTORY = (
    update(record_history_sequences)
    .where(*_HISTORY_KEY, _H.last_sequence == bindparam("k_last"))
    .values(last_sequence=bindparam("k_next"), updated_at=bindparam("k_now"))
)
#: The record's and its history row's locks in one statement (``LEFT OUTER JOIN``: the
#: record row is read and locked first, then its history row, the order of §13.1 when
#: the history row is the next key of the plan); ``history_last`` is NULL without one.
#: The join condition names the record's columns (not the bound key), so the history
#: row depends on the record row and cannot be read — and locked — before it.
_LOCK_RECORD_HISTORY = (
    select(records, _H.last_sequence.label("history_last"))
    .select_from(
        records.outerjoin(
            record_history_sequences,
            and_(
                _H.org_id == _R.org_id,
                _H.object_name == _R.object_name,
                _H.record_id == _R.record_id,
            ),
        )
    )
    .where(*_RECORD_KEY)
    .with_for_update()
)
#: The record's fenced write and its history row's advance in one multi-table UPDATE
#: (:func:`advancing_history_write`): both rows' predicates, both rows' values.
_RECORD_SET_COLUMNS = (
    "fields",
    "is_deleted",
    "updated_at",
    "parent_object_name",
    "parent_record_id",
    "parent_refs",
)
_UPDATE_RECORD_ADVANCE_HISTORY = (
    update(records)
    .where(
        *_RECORD_KEY,
        _R.record_version == bindparam("k_version"),
        _H.org_id == _R.org_id,
        _H.object_name == _R.object_name,
        _H.record_id == _R.record_id,
        _H.last_sequence == bindparam("k_last"),
    )
    .values(
        {
            _R.record_version: _R.record_version + 1,
            **{
                _R[name]: bindparam(f"r_{name}", type_=_R[name].type)
                for name in _RECORD_SET_COLUMNS
            },
            _H.last_sequence: bindparam("k_next"),
            _H.updated_at: bindparam("k_now", type_=_H.updated_at.type),
        }
    )
)
_INSERT_EVENT = insert(business_events)
_INSERT_AUDIT = insert(audit_records)


def _key(org_id: str, object_name: str, record_id: str) -> dict[str, Any]:
    return {"k_org": org_id, "k_object": object_name, "k_record": record_id}


#: :func:`lock_record_history_txn`'s clocked statement per dialect name.
_LOCK_HISTORY_CLOCKED: dict[str, tuple[Any, Callable[[Any], datetime]]] = {}


async def lock_record_history_txn(
    conn: AsyncConnection, org_id: str, object_name: str, record_id: str, *, clocked: bool
) -> tuple[RecordState | None, int | None]:
    """The record read ``FOR UPDATE`` (deleted rows too, as any locking read) and the
    ``last_sequence`` of its history row, locked in the same statement right after it
    (``None``: no such row) — :func:`read_record_txn` with ``lock=True`` followed by
    :func:`lock_history_txn`, one round trip instead of two, for a lock plan whose next
    key after the record is its history row (a record without lock-relevant parents).
    ``clocked``: the statement also carries the database clock
    (``services.db.now_column``) and keeps it as the transaction's ``db_now``
    (``remember_now``; a reading the transaction already took wins), so a transaction
    whose first statement is this lock needs no separate clock round trip. ``(None,
    None)`` when the record does not exist in ``org_id`` (no clock is read then: the
    next ``db_now`` reads it)."""
    if clocked:
        read = record_history_read(conn.dialect, org_id, object_name, record_id)
        return record_history_locked(conn, list(await conn.execute(read.statement, read.params)))
    row = (
        await conn.execute(_LOCK_RECORD_HISTORY, _key(org_id, object_name, record_id))
    ).one_or_none()
    return _record_history(row)


def record_history_read(dialect: Dialect, org_id: str, object_name: str, record_id: str) -> Read:
    """:func:`lock_record_history_txn` (clocked) as a read of a batched round trip
    (``services.db_batch.execute_reads``); its rows go to :func:`record_history_locked`."""
    return Read(_clocked_lock(dialect)[0], _key(org_id, object_name, record_id))


def record_history_locked(
    conn: AsyncConnection, rows: Sequence[Any]
) -> tuple[RecordState | None, int | None]:
    """The rows of :func:`record_history_read` as :func:`lock_record_history_txn`
    answers them (its clock kept as the transaction's ``db_now``)."""
    if len(rows) > 1:
        raise InvariantError("a record's locking read matched several rows")
    if not rows:
        return None, None
    row = rows[0]
    remember_now(conn, _clocked_lock(conn.dialect)[1](row.db_now))
    return _record_history(row)


def _record_history(row: Any) -> tuple[RecordState | None, int | None]:
    if row is None:
        return None, None
    last = row.history_last
    return _state(row), None if last is None else int(last)


def _clocked_lock(dialect: Dialect) -> tuple[Any, Callable[[Any], datetime]]:
    built = _LOCK_HISTORY_CLOCKED.get(dialect.name)
    if built is None:
        clock, parse_now = now_column(dialect)
        built = (_LOCK_RECORD_HISTORY.add_columns(clock), parse_now)
        _LOCK_HISTORY_CLOCKED[dialect.name] = built
    return built


async def read_record_txn(
    conn: AsyncConnection,
    org_id: str,
    object_name: str,
    record_id: str,
    *,
    lock: bool = False,
    include_deleted: bool = False,
) -> RecordState | None:
    """The record in ``org_id`` (``None`` when absent, in another org, or deleted unless
    ``include_deleted``); ``lock`` reads it ``FOR UPDATE``.

    A locking read always returns deleted rows too: the lock is taken either way, and the
    caller decides what a deleted row means.
    """
    if lock:
        stmt = _LOCK_RECORD
    elif include_deleted:
        stmt = _READ_RECORD
    else:
        stmt = _READ_LIVE_RECORD
    row = (await conn.execute(stmt, _key(org_id, object_name, record_id))).one_or_none()
    return None if row is None else _state(row)


#: :func:`query_children_txn`'s bounded range read of the parent index, built once.
_CHILDREN = (
    select(records)
    .where(
        _R.org_id == bindparam("k_org"),
        _R.parent_object_name == bindparam("k_parent_object"),
        _R.parent_record_id == bindparam("k_parent_record"),
        _R.object_name == bindparam("k_object"),
        _R.is_deleted == false(),
    )
    .order_by(_R.record_id)
    .limit(bindparam("k_limit", type_=Integer))
)


async def query_children_txn(
    conn: AsyncConnection,
    org_id: str,
    object_name: str,
    parent_object: str,
    lookup_field: str,
    parent_record_id: str,
    limit: int,
) -> list[RecordState]:
    """Live ``object_name`` records whose ``lookup_field`` is ``parent_record_id``, at most
    ``limit``, ordered by record id: one bounded range read of the parent index
    ``(org, parent object, parent id)``. The caller guarantees that ``lookup_field``'s
    relationship is the one the indexed parent columns hold (see
    :func:`runtime_svc.records.view.RecordView.indexed_relationship`); the field value is
    re-checked per row."""
    params = {
        "k_org": org_id,
        "k_parent_object": parent_object,
        "k_parent_record": parent_record_id,
        "k_object": object_name,
        "k_limit": limit,
    }
    out = []
    for row in await conn.execute(_CHILDREN, params):
        state = _state(row)
        if state.fields.get(lookup_field) == parent_record_id:
            out.append(state)
    return out


def _parent_columns(refs: Sequence[ParentRef], lock_relevant: frozenset[str]) -> dict[str, Any]:
    # The indexed parent columns hold one parent: the first lock-relevant relationship in
    # name order, else the first relationship; every ref is in ``parent_refs``.
    chosen = next((r for r in refs if r.relationship_name in lock_relevant), None)
    chosen = chosen or (refs[0] if refs else None)
    return {
        "parent_object_name": chosen.parent_object if chosen else None,
        "parent_record_id": chosen.parent_record_id if chosen else None,
        "parent_refs": _json([r.to_dict() for r in refs]) if refs else None,
    }


def _record_values(
    state: RecordState, lock_relevant: frozenset[str], encoded_fields: str | None
) -> dict[str, Any]:
    """The columns an update of ``state`` writes (:data:`_RECORD_SET_COLUMNS`)."""
    return {
        "fields": _json(state.fields) if encoded_fields is None else encoded_fields,
        "is_deleted": state.is_deleted,
        "updated_at": state.updated_at,
        **_parent_columns(state.parent_refs, lock_relevant),
    }


async def insert_record_txn(
    conn: AsyncConnection,
    state: RecordState,
    lock_relevant: frozenset[str],
    *,
    encoded_fields: str | None = None,
) -> bool:
    """Insert a new record row; ``False`` when the identity exists (even soft-deleted).

    The ``INSERT`` is also how the new row's lock is taken (§13.1: at its key's position).
    ``encoded_fields``: :func:`fields_json` of ``state.fields``, when the caller has it.
    """
    return await insert_prepared(
        conn, _INSERT_RECORD, _record_row(state, lock_relevant, encoded_fields)
    )


def record_insert_write(
    state: RecordState,
    lock_relevant: frozenset[str],
    *,
    encoded_fields: str,
    on_duplicate: Callable[[], BaseException],
) -> Write:
    """:func:`insert_record_txn` as a write of the caller's batch (``services.db_batch``):
    an existing identity raises ``on_duplicate()`` and stops the round trip there."""
    return Write(
        _INSERT_RECORD,
        _record_row(state, lock_relevant, encoded_fields),
        on_duplicate=on_duplicate,
    )


def _record_row(
    state: RecordState, lock_relevant: frozenset[str], encoded_fields: str | None
) -> dict[str, Any]:
    return {
        "org_id": state.org_id,
        "object_name": state.object_name,
        "record_id": state.record_id,
        "record_version": state.version,
        "fields": _json(state.fields) if encoded_fields is None else encoded_fields,
        "is_deleted": state.is_deleted,
        "created_at": state.created_at,
        "updated_at": state.updated_at,
        **_parent_columns(state.parent_refs, lock_relevant),
    }


async def update_record_txn(
    conn: AsyncConnection,
    org_id: str,
    state: RecordState,
    expected_version: int,
    lock_relevant: frozenset[str],
    *,
    encoded_fields: str | None = None,
) -> int:
    """Fenced write of ``state`` over version ``expected_version``; the new version.
    ``encoded_fields``: :func:`fields_json` of ``state.fields``, when the caller has it.

    Raises:
        FenceLostError: the row is not at ``expected_version`` (or not in ``org_id``).
    """
    key = _key(org_id, state.object_name, state.record_id)
    result = await conn.execute(
        _UPDATE_RECORD,
        {
            **key,
            "k_version": expected_version,
            **_record_values(state, lock_relevant, encoded_fields),
        },
    )
    if result.rowcount == 1:
        return expected_version + 1
    # Diagnostic only: the decision was made by the row count above.
    found = (await conn.execute(_RECORD_VERSION, key)).scalar_one_or_none()
    raise FenceLostError(
        records.name,
        f"object_name={state.object_name},record_id={state.record_id}",
        expected_version,
        found,
    )


def advancing_history_write(
    org_id: str,
    state: RecordState,
    expected_version: int,
    lock_relevant: frozenset[str],
    *,
    encoded_fields: str,
    last_sequence: int,
    now: datetime,
    check: Callable[[int], Awaitable[None]],
) -> Write:
    """:func:`update_record_txn` and :func:`advance_history_txn` as **one** statement, on
    a backend with multi-table UPDATE (MariaDB, MySQL, TiDB), as a write of the caller's
    batch (``services.db_batch``): the record's fence (version) and the history row's
    (``last_sequence``) in one ``WHERE``, both rows' values in one ``SET``. The caller
    holds both rows' locks (the engine's lock phase, record then history), so no lock is
    taken in another order. ``check`` decides its row count (:func:`advanced_together`):
    both written, or — nothing written — the two statements run alone and raise what
    they always raise."""
    columns = _record_values(state, lock_relevant, encoded_fields)
    params = {
        **_key(org_id, state.object_name, state.record_id),
        "k_version": expected_version,
        "k_last": last_sequence,
        "k_next": last_sequence + 1,
        "k_now": now,
        **{f"r_{name}": value for name, value in columns.items()},
    }
    # Its check accepts two rows only: declared, so it may ride with a COMMIT (ADR 0014).
    return Write(_UPDATE_RECORD_ADVANCE_HISTORY, params, check=check, rows=2)


def advanced_together(rowcount: int) -> bool:
    """The record + history UPDATE's decision: ``True`` both rows written, ``False``
    neither (a fence did not match; see :func:`advancing_history_write`).

    Raises:
        RuntimeError: one row matched and not the other.
    """
    if rowcount == 2:
        return True
    if rowcount:
        raise RuntimeError(f"the record and history UPDATE matched {rowcount} of 2 rows")
    return False


# --- history sequence -----------------------------------------------------------------


async def lock_history_txn(
    conn: AsyncConnection, org_id: str, object_name: str, record_id: str
) -> int | None:
    """``last_sequence`` of the record's history row read ``FOR UPDATE`` (``None``: no row)."""
    key = _key(org_id, object_name, record_id)
    value = (await conn.execute(_LOCK_HISTORY, key)).scalar_one_or_none()
    return None if value is None else int(value)


async def insert_history_txn(
    conn: AsyncConnection,
    org_id: str,
    object_name: str,
    record_id: str,
    last_sequence: int,
    now: datetime,
) -> bool:
    """Create the record's history row at ``last_sequence``; ``False`` when it exists."""
    return await insert_prepared(
        conn, _INSERT_HISTORY, _history_row(org_id, object_name, record_id, last_sequence, now)
    )


def history_insert_write(
    org_id: str, object_name: str, record_id: str, last_sequence: int, now: datetime
) -> Write:
    """:func:`insert_history_txn` as the insert-if-absent of a batch
    (``services.db_batch.execute_writes_if_absent``: an existing row is the answer
    ``False``, not an error)."""
    return if_absent(
        Write(_INSERT_HISTORY, _history_row(org_id, object_name, record_id, last_sequence, now))
    )


def _history_row(
    org_id: str, object_name: str, record_id: str, last_sequence: int, now: datetime
) -> dict[str, Any]:
    return {
        "org_id": org_id,
        "object_name": object_name,
        "record_id": record_id,
        "last_sequence": last_sequence,
        "updated_at": now,
    }


async def advance_history_txn(
    conn: AsyncConnection,
    org_id: str,
    object_name: str,
    record_id: str,
    last_sequence: int,
    now: datetime,
) -> int:
    """Reserve the next history sequence of a locked history row: ``last_sequence + 1``.

    A conditional ``UPDATE`` on the value read under lock, so a lost pessimistic lock
    (TiDB) still cannot hand one sequence out twice.

    Raises:
        FenceLostError: the row no longer holds ``last_sequence``.
    """
    key = _key(org_id, object_name, record_id)
    result = await conn.execute(
        _ADVANCE_HISTORY,
        {**key, "k_last": last_sequence, "k_next": last_sequence + 1, "k_now": now},
    )
    if result.rowcount != 1:
        found = await conn.execute(_HISTORY_LAST, key)
        raise FenceLostError(
            record_history_sequences.name,
            f"{object_name}/{record_id}",
            last_sequence,
            found.scalar_one_or_none(),
        )
    return last_sequence + 1


# --- derived rows ---------------------------------------------------------------------


@dataclass(frozen=True)
class EventRow:
    """One business event (ordered per record by ``history_sequence``)."""

    org_id: str
    event_id: str
    object_name: str
    record_id: str
    history_sequence: int
    event_type: str
    payload: Mapping[str, Any]
    occurred_at: datetime
    flow_run_id: str | None = None
    step_execution_id: str | None = None
    attempt_id: str | None = None
    request_rpc: str | None = None
    request_id: str | None = None
    request_digest: str | None = None


@dataclass(frozen=True)
class AuditRow:
    """One append-only audit record (safe details only, §17.3)."""

    org_id: str
    audit_record_id: str
    actor_kind: str
    actor_id: str
    action: str
    object_name: str
    record_id: str
    details: Mapping[str, Any]
    occurred_at: datetime
    flow_run_id: str | None = None
    step_execution_id: str | None = None
    attempt_id: str | None = None


def event_write(event: EventRow, on_duplicate: Callable[[], BaseException]) -> Write:
    """Append a business event, as a write of the caller's batch (``services.db_batch``):
    a duplicate sequence or request key raises ``on_duplicate()``."""
    return Write(_INSERT_EVENT, _event_values(event), on_duplicate=on_duplicate)


def _event_values(event: EventRow) -> dict[str, Any]:
    return {
        "org_id": event.org_id,
        "event_id": event.event_id,
        "object_name": event.object_name,
        "record_id": event.record_id,
        "history_sequence": event.history_sequence,
        "event_type": event.event_type,
        "payload": _json(event.payload),
        "flow_run_id": event.flow_run_id,
        "step_execution_id": event.step_execution_id,
        "attempt_id": event.attempt_id,
        "occurred_at": event.occurred_at,
        "request_rpc": event.request_rpc,
        "request_id": event.request_id,
        "request_digest": event.request_digest,
    }


async def insert_audit_txn(conn: AsyncConnection, audit: AuditRow) -> None:
    """Append an audit record (fresh identity: a duplicate is a bug and raises)."""
    await conn.execute(_INSERT_AUDIT, _audit_values(audit))


def audit_write(audit: AuditRow) -> Write:
    """:func:`insert_audit_txn` as one write of a batch (``services.db_batch``)."""
    return Write(_INSERT_AUDIT, _audit_values(audit))


def _audit_values(audit: AuditRow) -> dict[str, Any]:
    return {
        "org_id": audit.org_id,
        "audit_record_id": audit.audit_record_id,
        "actor_kind": audit.actor_kind,
        "actor_id": audit.actor_id,
        "action": audit.action,
        "object_name": audit.object_name,
        "record_id": audit.record_id,
        "flow_run_id": audit.flow_run_id,
        "step_execution_id": audit.step_execution_id,
        "attempt_id": audit.attempt_id,
        "details": _json(audit.details),
        "occurred_at": audit.occurred_at,
    }
