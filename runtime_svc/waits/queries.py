"""Non-locking reads and bookkeeping writes of durable waits (discovery for §14.2-§14.3).

Every query is scoped: dependency and signal matching by the complete work scope,
sweeps by org, and each one is bounded by a ``limit`` over an index whose leading column
is ``org_id`` — a sweep's cost follows its batch size, never the waiting population.

The two bookkeeping writes here are not lifecycle transitions: rescheduling a probe and
clearing a signal's owed match touch one row with a conditional UPDATE (no version
bump, no other lock), so they can never sit between a root and its dependency in the
§12 order. Signal expiry (``Unmatched -> Expired``) is a compare-and-swap on the signal
alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    and_,
    bindparam,
    case,
    delete,
    exists,
    false,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.states import RunState
from runtime_svc.kernel.store_waits import (
    bound_scope_predicates,
    dependency_from_row,
    scope_params,
    scope_predicates,
    signal_from_row,
)
from runtime_svc.kernel.wait_model import (
    DependencyRecord,
    DependencyState,
    SignalRecord,
    SignalState,
    WorkScopeKey,
)
from runtime_svc.schema import flow_checkpoints, flow_dependencies, flow_runs, flow_wake_signals
from services.db import scoped_select

__all__ = [
    "VersionedKeySeen",
    "checkpoint_context_txn",
    "clear_signal_match_txn",
    "dependencies_of_run_txn",
    "dependency_of_step_txn",
    "due_deadlines_txn",
    "due_probes_txn",
    "expire_signals_txn",
    "owed_signal_matches_txn",
    "pending_for_key_txn",
    "purge_expired_signals_txn",
    "reschedule_probe_txn",
    "signal_by_id_txn",
    "signal_by_token_txn",
    "token_or_latest_txn",
    "unmatched_for_key_txn",
    "waiting_roots_txn",
]

_PENDING = DependencyState.PENDING.code
_UNMATCHED = SignalState.UNMATCHED.code


# --- signals -----------------------------------------------------------------------------


async def signal_by_id_txn(
    conn: AsyncConnection, scope: WorkScopeKey, wake_signal_id: str
) -> SignalRecord | None:
    """The signal ``wake_signal_id`` of ``scope`` (another scope's answers ``None``)."""
    w = flow_wake_signals.c
    stmt = select(flow_wake_signals).where(
        *scope_predicates(flow_wake_signals, scope), w.wake_signal_id == wake_signal_id
    )
    row = (await conn.execute(stmt)).mappings().first()
    return None if row is None else signal_from_row(row)


# The wake path's reads (acceptance, producer-side match), built once at import and
# executed with bound parameters (``docs/performance.md``, round 5).
_W = flow_wake_signals.c
_D = flow_dependencies.c
_SIGNAL_KEY = (
    *bound_scope_predicates(flow_wake_signals),
    _W.producer_kind == bindparam("kind"),
    _W.producer_key == bindparam("key"),
)
_SIGNAL_BY_TOKEN = select(flow_wake_signals).where(
    *_SIGNAL_KEY, _W.wake_token == bindparam("token")
)
#: The acceptance read of a versioned notification: the row with its token if there is
#: one (sorted first), otherwise the key's newest versioned row.
_TOKEN_OR_LATEST = (
    select(flow_wake_signals)
    .where(
        *_SIGNAL_KEY,
        or_(_W.wake_token == bindparam("token"), _W.wake_version.is_not(None)),
    )
    .order_by(
        case((_W.wake_token == bindparam("token"), 0), else_=1),
        _W.wake_version.desc(),
    )
    .limit(1)
)
#: Whether :data:`_TOKEN_OR_LATEST` would find a row (the same predicate): the column a
#: versioned submission's ledger lookup adds (:class:`VersionedKeySeen`).
_TOKEN_OR_LATEST_EXISTS = (
    exists()
    .where(
        *_SIGNAL_KEY,
        or_(_W.wake_token == bindparam("token"), _W.wake_version.is_not(None)),
    )
    .label("versioned_key_seen")
)
_UNMATCHED_FOR_KEY = (
    select(flow_wake_signals)
    .where(*_SIGNAL_KEY, _W.resolution_state == _UNMATCHED)
    .order_by(_W.wake_version.desc(), _W.received_at, _W.wake_signal_id)
    .limit(bindparam("limit", type_=Integer))
)
_PENDING_FOR_KEY = (
    select(flow_dependencies)
    .where(
        *bound_scope_predicates(flow_dependencies),
        _D.producer_kind == bindparam("kind"),
        _D.producer_key == bindparam("key"),
        _D.state == _PENDING,
    )
    .order_by(_D.created_at, _D.dependency_id)
    .limit(bindparam("limit", type_=Integer))
)


def _key_params(scope: WorkScopeKey, kind: str, key: str, **more: object) -> dict[str, object]:
    return {**scope_params(scope), "kind": kind, "key": key, **more}


async def signal_by_token_txn(
    conn: AsyncConnection, scope: WorkScopeKey, kind: str, key: str, token: str
) -> SignalRecord | None:
    """The signal with natural key ``(scope, kind, key, token)``."""
    params = _key_params(scope, kind, key, token=token)
    row = (await conn.execute(_SIGNAL_BY_TOKEN, params)).mappings().first()
    return None if row is None else signal_from_row(row)


class VersionedKeySeen:
    """Whether a versioned submission's acceptance read (:func:`token_or_latest_txn`)
    would find anything — its token's row, or any versioned row of its producer key —
    selected by the request ledger's clocked lookup, the transaction's first statement
    (``services.request_dedupe.LookupColumn``). A fresh notification, the common case,
    needs no read of its own: nothing found means nothing to compare or be stale
    against. The same snapshot read as the acceptance read (neither locks).
    """

    key = "versioned_key_seen"

    def __init__(self, scope: WorkScopeKey, kind: str, key: str, token: str) -> None:
        self._params = _key_params(scope, kind, key, token=token)
        #: The lookup's answer (``True`` until one was read: then read the rows).
        self.seen = True

    def column(self, dialect: Dialect) -> ColumnElement[Any]:
        return _TOKEN_OR_LATEST_EXISTS

    def params(self) -> Mapping[str, Any]:
        return self._params

    def accept(self, value: Any) -> None:
        self.seen = bool(value)


async def token_or_latest_txn(
    conn: AsyncConnection, scope: WorkScopeKey, kind: str, key: str, token: str
) -> SignalRecord | None:
    """The signal with natural key ``(scope, kind, key, token)`` or, when there is none,
    the accepted signal of ``(scope, kind, key)`` with the highest wake version — one
    statement: the caller tells them apart by the returned row's ``wake_token``."""
    params = _key_params(scope, kind, key, token=token)
    row = (await conn.execute(_TOKEN_OR_LATEST, params)).mappings().first()
    return None if row is None else signal_from_row(row)


async def unmatched_for_key_txn(
    conn: AsyncConnection, scope: WorkScopeKey, kind: str, key: str, limit: int
) -> list[SignalRecord]:
    """Unmatched signals of ``(scope, kind, key)``: highest wake version first, then
    acceptance order (over the unique key's ``(scope, kind, key)`` prefix)."""
    params = _key_params(scope, kind, key, limit=limit)
    return [signal_from_row(r) for r in (await conn.execute(_UNMATCHED_FOR_KEY, params)).mappings()]


async def owed_signal_matches_txn(
    conn: AsyncConnection, org_id: str, now: datetime, limit: int
) -> list[SignalRecord]:
    """Signals whose producer-side match is owed and due (a producer crashed between
    its signal commit and its match), over ``(org, next_match_at)``."""
    w = flow_wake_signals.c
    stmt = (
        select(flow_wake_signals)
        .where(w.org_id == org_id, w.next_match_at <= now)
        .order_by(w.next_match_at, w.wake_signal_id)
        .limit(limit)
    )
    return [signal_from_row(r) for r in (await conn.execute(stmt)).mappings()]


async def clear_signal_match_txn(conn: AsyncConnection, signal: SignalRecord) -> None:
    """The producer-side match ran: the signal no longer needs the repair sweep."""
    w = flow_wake_signals.c
    await conn.execute(
        update(flow_wake_signals)
        .where(
            *scope_predicates(flow_wake_signals, signal.scope),
            w.wake_signal_id == signal.wake_signal_id,
            w.next_match_at.is_not(None),
        )
        .values(next_match_at=None)
    )


async def expire_signals_txn(conn: AsyncConnection, org_id: str, now: datetime, limit: int) -> int:
    """``Unmatched -> Expired`` for signals past their retention bound (CAS on each)."""
    w = flow_wake_signals.c
    stmt = (
        select(flow_wake_signals)
        .where(w.org_id == org_id, w.resolution_state == _UNMATCHED, w.expires_at < now)
        .order_by(w.expires_at, w.wake_signal_id)
        .limit(limit)
    )
    expired = 0
    for row in (await conn.execute(stmt)).mappings().all():
        s = signal_from_row(row)
        result = await conn.execute(
            update(flow_wake_signals)
            .where(
                *scope_predicates(flow_wake_signals, s.scope),
                w.wake_signal_id == s.wake_signal_id,
                w.state_version == s.state_version,
                w.resolution_state == _UNMATCHED,
            )
            .values(
                resolution_state=SignalState.EXPIRED.code,
                state_version=s.state_version + 1,
                next_match_at=None,
            )
        )
        expired += result.rowcount
    return expired


async def purge_expired_signals_txn(
    conn: AsyncConnection, org_id: str, before: datetime, limit: int
) -> int:
    """Physically delete ``Expired`` signals whose retention ended before ``before``."""
    w = flow_wake_signals.c
    ids = (
        await conn.execute(
            select(
                w.app_installation_id,
                w.runtime_capability_id,
                w.runtime_work_binding_digest,
                w.wake_signal_id,
            )
            .where(
                w.org_id == org_id,
                w.resolution_state == SignalState.EXPIRED.code,
                w.expires_at < before,
            )
            .limit(limit)
        )
    ).all()
    deleted = 0
    for app, cap, digest, sid in ids:
        result = await conn.execute(
            delete(flow_wake_signals).where(
                w.org_id == org_id,
                w.app_installation_id == app,
                w.runtime_capability_id == cap,
                w.runtime_work_binding_digest == digest,
                w.wake_signal_id == sid,
                w.resolution_state == SignalState.EXPIRED.code,
            )
        )
        deleted += result.rowcount
    return deleted


# --- dependencies ------------------------------------------------------------------------


async def pending_for_key_txn(
    conn: AsyncConnection, scope: WorkScopeKey, kind: str, key: str, limit: int
) -> list[DependencyRecord]:
    """Pending dependencies of ``(scope, kind, key)`` in creation order (over
    ``ix_flow_dependencies_producer``)."""
    params = _key_params(scope, kind, key, limit=limit)
    return [
        dependency_from_row(r) for r in (await conn.execute(_PENDING_FOR_KEY, params)).mappings()
    ]


_CHECKPOINT_CONTEXT = scoped_select(
    flow_checkpoints, ("flow_run_id", "checkpoint_id"), columns=("context_payload",)
)


async def checkpoint_context_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, checkpoint_id: str
) -> str | None:
    """The context payload (JSON) of one checkpoint of one run — what a wait condition
    reads — without the rest of the row; ``None`` when missing, in another org, or of
    another run."""
    params = {"org_id": org_id, "flow_run_id": flow_run_id, "checkpoint_id": checkpoint_id}
    payload = (await conn.execute(_CHECKPOINT_CONTEXT, params)).scalar_one_or_none()
    return None if payload is None else str(payload)


_DEPENDENCY_OF_STEP = (
    select(flow_dependencies)
    .where(_D.org_id == bindparam("org"), _D.step_execution_id == bindparam("step"))
    .order_by(_D.created_at.desc(), _D.dependency_id.desc())
    .limit(1)
)


async def dependency_of_step_txn(
    conn: AsyncConnection, org_id: str, step_execution_id: str
) -> DependencyRecord | None:
    """The newest dependency of a step execution (over ``(org, step)``)."""
    params = {"org": org_id, "step": step_execution_id}
    row = (await conn.execute(_DEPENDENCY_OF_STEP, params)).mappings().first()
    return None if row is None else dependency_from_row(row)


async def dependencies_of_run_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, limit: int = 1000
) -> list[DependencyRecord]:
    """Every dependency of a run, by id (the support read, §19)."""
    d = flow_dependencies.c
    stmt = (
        select(flow_dependencies)
        .where(d.org_id == org_id, d.flow_run_id == flow_run_id)
        .order_by(d.dependency_id)
        .limit(limit)
    )
    return [dependency_from_row(r) for r in (await conn.execute(stmt)).mappings()]


async def _due_txn(
    conn: AsyncConnection, org_id: str, column: str, now: datetime, limit: int
) -> list[DependencyRecord]:
    d = flow_dependencies.c
    due = d[column]
    stmt = (
        select(flow_dependencies)
        .where(d.org_id == org_id, d.state == _PENDING, due <= now)
        .order_by(due, d.dependency_id)
        .limit(limit)
    )
    return [dependency_from_row(r) for r in (await conn.execute(stmt)).mappings()]


async def due_probes_txn(
    conn: AsyncConnection, org_id: str, now: datetime, limit: int
) -> list[DependencyRecord]:
    """Pending dependencies whose timer or reconciliation probe is due, oldest first,
    over ``ix_flow_dependencies_probe (org, state, next_probe_at)``."""
    return await _due_txn(conn, org_id, "next_probe_at", now, limit)


async def due_deadlines_txn(
    conn: AsyncConnection, org_id: str, now: datetime, limit: int
) -> list[DependencyRecord]:
    """Pending dependencies past their deadline, oldest first, over
    ``ix_flow_dependencies_deadline (org, state, deadline)``."""
    return await _due_txn(conn, org_id, "deadline", now, limit)


async def reschedule_probe_txn(
    conn: AsyncConnection, dep: DependencyRecord, next_probe_at: datetime | None
) -> bool:
    """Record one reconciliation probe: ``reconciliation_attempts + 1`` and the next due
    time (``None``: probing is over). No version bump: a probe is bookkeeping, and a
    concurrent resolution or expiry still wins on the dependency's version."""
    d = flow_dependencies.c
    result = await conn.execute(
        update(flow_dependencies)
        .where(
            d.org_id == dep.org_id,
            d.dependency_id == dep.dependency_id,
            d.state == _PENDING,
            d.state_version == dep.state_version,
            d.reconciliation_attempts == dep.reconciliation_attempts,
        )
        .values(
            next_probe_at=next_probe_at,
            reconciliation_attempts=dep.reconciliation_attempts + 1,
        )
    )
    return bool(result.rowcount == 1)


async def waiting_roots_txn(
    conn: AsyncConnection, org_id: str, after: str, limit: int
) -> list[tuple[str, str | None]]:
    """``(run id, current step id)`` of ``Waiting`` roots after ``after`` in id order (the
    repair sweep's bounded cursor over ``(org, runtime_state, …)``)."""
    r = flow_runs.c
    stmt = (
        select(r.flow_run_id, r.current_step_execution_id)
        .where(
            r.org_id == org_id,
            r.runtime_state == RunState.WAITING.code,
            r.flow_run_id > after,
            r.is_deleted == false(),
        )
        .order_by(r.flow_run_id)
        .limit(limit)
    )
    return [(str(a), b) for a, b in (await conn.execute(stmt)).all()]


async def terminal_dependencies_of_steps_txn(
    conn: AsyncConnection, org_id: str, step_ids: Sequence[str]
) -> list[DependencyRecord]:
    """Non-pending dependencies of the given steps (corruption candidates of a
    ``Waiting`` root: a waiting step's dependency must be ``Pending``)."""
    if not step_ids:
        return []
    d = flow_dependencies.c
    stmt = select(flow_dependencies).where(
        and_(d.org_id == org_id, d.step_execution_id.in_(list(step_ids)), d.state != _PENDING)
    )
    return [dependency_from_row(r) for r in (await conn.execute(stmt)).mappings()]
