"""Read ``_txn`` helpers of :mod:`runtime_svc.kernel.store`: point reads, org-scoped
listing with stable keyset pages, the §19 support view, and the two bounded scans the
scheduler runs (eligible work, expired leases).

Every query is scoped by the trusted ``org_id`` and, on a normal read path, filters the
one visibility fact ``is_deleted`` (§10.1 step 6); ``include_deleted`` exists for the
authorized recycle-bin/retention reads only. A row of another org answers exactly like a
missing one. None of these reads takes locks.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, and_, bindparam, false, literal_column, or_, select, union_all
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.model import AttemptRecord, CheckpointMeta, RunRecord, StepRecord
from runtime_svc.kernel.states import ExecutionOwner, RunState, StepState
from runtime_svc.kernel.store_codec import (
    RUN_COLUMNS,
    attempt_from_row,
    checkpoint_meta_from_row,
    run_from_row,
    step_from_row,
)
from runtime_svc.schema import (
    execution_plans,
    flow_checkpoints,
    flow_runs,
    flow_step_attempts,
    flow_step_executions,
    flow_versions,
)
from services.db import db_now, scoped_select
from services.db_batch import Read, execute_reads
from services.digest import versioned_digest
from services.errors import InvalidArgumentError, NotFoundError

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MAX_PAGE_SIZE",
    "MAX_SUPPORT_ATTEMPTS",
    "Candidate",
    "Checkpoint",
    "ExpiredLease",
    "RunCursor",
    "RunFilters",
    "RunPage",
    "SupportView",
    "cancel_requested_runs_txn",
    "candidate_for_run_txn",
    "eligible_work_txn",
    "expired_leases_txn",
    "get_checkpoint_txn",
    "get_run_txn",
    "list_runs_page_txn",
    "list_runs_txn",
    "plan_digest_txn",
    "support_view_txn",
]

#: The ``flow_runs`` columns of a decoded run (``store_codec.RUN_COLUMNS``).
_RUN_PROJECTION = tuple(flow_runs.c[name] for name in RUN_COLUMNS)

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
#: Attempt history rows in one support view (plans bound steps, policies bound attempts).
MAX_SUPPORT_ATTEMPTS = 1000

_V2 = ExecutionOwner.FLOW_RUNTIME_V2.code


@dataclass(frozen=True)
class Candidate:
    """An eligible (root, current step) pair found by the non-locking claim lookup; the
    versions seen are re-checked under lock by the claim."""

    org_id: str
    flow_run_id: str
    step_execution_id: str
    root_state_version: int
    step_state_version: int
    run_after: datetime
    queue_class: str
    #: The plan the run is bound to (a worker verifies it before the first claim).
    plan_id: str = ""
    #: Telemetry only (never compared by the claim): the run's stored trace context,
    #: execution profile and the step's kind.
    trace_context: str | None = None
    execution_profile: str = ""
    step_kind: str = ""


@dataclass(frozen=True)
class ExpiredLease:
    """A ``Claimed``/``Running`` step whose lease deadline has passed."""

    flow_run_id: str
    step_execution_id: str
    lease_until: datetime


@dataclass(frozen=True)
class RunFilters:
    """``ListRuns`` filters (§10.1 step 6, §19; all optional, combined with AND)."""

    flow_api_name: str | None = None
    flow_version_id: str | None = None
    plan_id: str | None = None
    states: tuple[RunState, ...] = ()
    created_after: datetime | None = None
    created_before: datetime | None = None

    def digest(self) -> str:
        """What a page token is bound to: the same filters or no page."""
        return versioned_digest(
            "list-runs-filters",
            {
                "flow_api_name": self.flow_api_name,
                "flow_version_id": self.flow_version_id,
                "plan_id": self.plan_id,
                "states": sorted(s.code for s in self.states),
                "created_after": None
                if self.created_after is None
                else self.created_after.isoformat(),
                "created_before": None
                if self.created_before is None
                else self.created_before.isoformat(),
            },
        )


@dataclass(frozen=True)
class RunCursor:
    """A keyset position of :func:`list_runs_txn`: the next page starts strictly after
    ``(created_at, flow_run_id)``."""

    created_at: datetime
    flow_run_id: str


@dataclass(frozen=True)
class RunPage:
    """One page of runs and the token of the next (``""`` on the last page)."""

    runs: tuple[RunRecord, ...]
    next_page_token: str


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint with its payload (worker input; never part of a support view)."""

    meta: CheckpointMeta
    context_json: str = field(repr=False)
    plan_cursor_json: str


@dataclass(frozen=True)
class SupportView:
    """§19 support read: immutable plan, canonical state, current step, current
    checkpoint metadata (no payload), every step and its attempt history, safe cause."""

    run: RunRecord
    plan_digest: str
    current_step: StepRecord | None
    current_checkpoint: CheckpointMeta | None
    steps: tuple[StepRecord, ...]
    attempts: tuple[AttemptRecord, ...]

    @property
    def terminal_cause_code(self) -> str | None:
        return self.run.terminal_cause_code


def _get_run(*, include_deleted: bool) -> Any:
    t = flow_runs.c
    # Only the columns run_from_row reads (round 7: fewer column descriptors to parse).
    stmt = select(*_RUN_PROJECTION).where(
        t.org_id == bindparam("org"), t.flow_run_id == bindparam("run")
    )
    return stmt if include_deleted else stmt.where(t.is_deleted == false())


#: The point read of a run, built once per visibility (issue 13: executing a pre-built
#: statement with bound parameters skips per-call construction and cache-key generation).
_GET_RUN = {deleted: _get_run(include_deleted=deleted) for deleted in (False, True)}


async def get_run_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, *, include_deleted: bool = False
) -> RunRecord:
    """The run ``(org_id, flow_run_id)``.

    Raises:
        NotFoundError: missing, in another org, or soft-deleted (unless included).
    """
    params = {"org": org_id, "run": flow_run_id}
    row = (await conn.execute(_GET_RUN[include_deleted], params)).mappings().first()
    if row is None:
        raise NotFoundError("flow_run", flow_run_id)
    return run_from_row(row)


def _encode_token(after: RunCursor, filters: RunFilters) -> str:
    raw = json.dumps(
        {"a": [after.created_at.isoformat(), after.flow_run_id], "f": filters.digest()}
    ).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(token: str, filters: RunFilters) -> RunCursor | None:
    if not token:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        created, run_id = payload["a"]
        cursor = RunCursor(datetime.fromisoformat(created), str(run_id))
    except (binascii.Error, ValueError, KeyError, TypeError):
        payload, cursor = None, None
    if cursor is None or not isinstance(payload, dict) or payload.get("f") != filters.digest():
        raise InvalidArgumentError(
            "page_token is malformed or was issued for other filters", field_path="page_token"
        )
    return cursor


async def list_runs_txn(
    conn: AsyncConnection,
    org_id: str,
    filters: RunFilters,
    *,
    limit: int,
    after: RunCursor | None = None,
) -> tuple[list[RunRecord], bool]:
    """The one ``ListRuns`` read: up to ``limit`` of the org's visible (not deleted) runs
    matching ``filters``, in stable ``(created_at, flow_run_id)`` keyset order after
    ``after``; and whether more follow. A read-only query: no locks, no writes.
    """
    t = flow_runs.c
    stmt = select(*_RUN_PROJECTION).where(t.org_id == org_id, t.is_deleted == false())
    if filters.flow_api_name is not None:
        v = flow_versions.c
        versions = select(v.flow_version_id).where(
            v.org_id == org_id, v.flow_id == filters.flow_api_name
        )
        stmt = stmt.where(t.flow_version_id.in_(versions))
    if filters.flow_version_id is not None:
        stmt = stmt.where(t.flow_version_id == filters.flow_version_id)
    if filters.plan_id is not None:
        stmt = stmt.where(t.plan_id == filters.plan_id)
    if filters.states:
        stmt = stmt.where(t.runtime_state.in_(sorted(s.code for s in filters.states)))
    if filters.created_after is not None:
        stmt = stmt.where(t.created_at >= filters.created_after)
    if filters.created_before is not None:
        stmt = stmt.where(t.created_at < filters.created_before)
    if after is not None:
        stmt = stmt.where(
            or_(
                t.created_at > after.created_at,
                and_(t.created_at == after.created_at, t.flow_run_id > after.flow_run_id),
            )
        )
    stmt = stmt.order_by(t.created_at, t.flow_run_id).limit(limit + 1)
    rows = (await conn.execute(stmt)).mappings().all()
    return [run_from_row(r) for r in rows[:limit]], len(rows) > limit


async def list_runs_page_txn(
    conn: AsyncConnection,
    org_id: str,
    filters: RunFilters,
    page_size: int = 0,
    page_token: str = "",
) -> RunPage:
    """:func:`list_runs_txn` with the kernel's (unsigned) page tokens bound to the filters;
    the public API signs its own (``runtime_svc.runs.tokens``).

    Raises:
        InvalidArgumentError: negative ``page_size`` or a foreign/malformed token.
    """
    if page_size < 0:
        raise InvalidArgumentError("page_size must not be negative", field_path="page_size")
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    runs, more = await list_runs_txn(
        conn, org_id, filters, limit=size, after=_decode_token(page_token, filters)
    )
    last = runs[-1] if runs else None
    token = (
        _encode_token(RunCursor(last.created_at, last.flow_run_id), filters)
        if more and last is not None
        else ""
    )
    return RunPage(tuple(runs), token)


_PLAN_DIGEST = scoped_select(execution_plans, ("plan_id",), columns=("plan_digest",))


async def plan_digest_txn(conn: AsyncConnection, org_id: str, plan_id: str) -> str:
    """The immutable ``PlanDigest`` of ``plan_id`` in ``org_id``.

    Raises:
        NotFoundError: no such plan in the org.
    """
    params = {"org_id": org_id, "plan_id": plan_id}
    digest = (await conn.execute(_PLAN_DIGEST, params)).scalar_one_or_none()
    if digest is None:
        raise NotFoundError("execution_plan", plan_id)
    return str(digest)


async def support_view_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, *, include_deleted: bool = False
) -> SupportView:
    """The §19 support read of ``(org_id, flow_run_id)`` — never by run id alone, and
    never with a checkpoint payload.

    Raises:
        NotFoundError: as :func:`get_run_txn`.
    """
    run = await get_run_txn(conn, org_id, flow_run_id, include_deleted=include_deleted)
    s, a, c = flow_step_executions.c, flow_step_attempts.c, flow_checkpoints.c
    step_rows = (
        (
            await conn.execute(
                select(flow_step_executions)
                .where(s.org_id == org_id, s.flow_run_id == flow_run_id)
                .order_by(s.created_at, s.step_execution_id)
                .limit(MAX_SUPPORT_ATTEMPTS)
            )
        )
        .mappings()
        .all()
    )
    steps = tuple(step_from_row(r) for r in step_rows)
    attempt_rows = (
        (
            await conn.execute(
                select(flow_step_attempts)
                .select_from(
                    flow_step_attempts.join(
                        flow_step_executions,
                        and_(s.org_id == a.org_id, s.step_execution_id == a.step_execution_id),
                    )
                )
                .where(a.org_id == org_id, s.flow_run_id == flow_run_id)
                .order_by(a.started_at, a.step_execution_id, a.attempt_number)
                .limit(MAX_SUPPORT_ATTEMPTS)
            )
        )
        .mappings()
        .all()
    )
    checkpoint: CheckpointMeta | None = None
    if run.current_checkpoint_id is not None:
        meta_columns = [
            c.checkpoint_id,
            c.flow_run_id,
            c.sequence,
            c.context_schema_version,
            c.context_digest,
            c.created_by_attempt_id,
            c.created_at,
        ]
        row = (
            (
                await conn.execute(
                    select(*meta_columns).where(
                        c.org_id == org_id, c.checkpoint_id == run.current_checkpoint_id
                    )
                )
            )
            .mappings()
            .first()
        )
        checkpoint = None if row is None else checkpoint_meta_from_row(row)
    current = next(
        (st for st in steps if st.step_execution_id == run.current_step_execution_id), None
    )
    return SupportView(
        run=run,
        plan_digest=await plan_digest_txn(conn, org_id, run.plan_id),
        current_step=current,
        current_checkpoint=checkpoint,
        steps=steps,
        attempts=tuple(attempt_from_row(r) for r in attempt_rows),
    )


_GET_CHECKPOINT = scoped_select(flow_checkpoints, ("flow_run_id", "checkpoint_id"))


async def get_checkpoint_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, checkpoint_id: str
) -> Checkpoint:
    """One checkpoint of one run, with its payload (the worker's input).

    Raises:
        NotFoundError: missing, in another org, or of another run.
    """
    params = {"org_id": org_id, "flow_run_id": flow_run_id, "checkpoint_id": checkpoint_id}
    row = (await conn.execute(_GET_CHECKPOINT, params)).mappings().first()
    if row is None:
        raise NotFoundError("flow_checkpoint", checkpoint_id)
    return Checkpoint(checkpoint_meta_from_row(row), row["context_payload"], row["plan_cursor"])


_CLAIMABLE_CODES: Sequence[str] = (StepState.PENDING.code, StepState.RETRY_SCHEDULED.code)


_S, _R = flow_step_executions.c, flow_runs.c
#: The columns of a claim candidate's range row (step joined to its root): every column
#: of :data:`_CANDIDATE_COLUMNS` but the root's ``trace_context``, which is text — a
#: derived table carrying it is materialized on disk by MariaDB (ADR 0015).
_RANGE_COLUMNS = (
    _S.flow_run_id,
    _S.step_execution_id,
    _S.state_version,
    _S.run_after,
    _S.queue_class,
    _S.step_kind,
    _R.state_version.label("root_state_version"),
    _R.plan_id,
    _R.execution_profile,
)
#: The columns a claim candidate is built from (step joined to its root).
_CANDIDATE_COLUMNS = (*_RANGE_COLUMNS, _R.trace_context)
#: The root conditions of a claim candidate besides its key: runnable, live, not
#: paused, owned by V2 at the worker's epoch.
_CANDIDATE_ROOT = (
    _R.runtime_state == RunState.RUNNABLE.code,
    _R.is_deleted == false(),
    _R.delete_requested_at.is_(None),
    _R.operator_paused_at.is_(None),
    _R.execution_owner == _V2,
    _R.ownership_epoch == bindparam("epoch"),
)


def _eligible_range(index: int, now: Any) -> Any:
    """One claimable state's bounded range of :func:`eligible_work_txn` (``:state_<index>``):
    the step claim index range ``(org, state, queue_class, run_after, id)`` joined to the
    root by primary key, in claim order, at most ``:limit`` rows, due at ``now``."""
    return (
        select(*_RANGE_COLUMNS)
        .select_from(
            flow_step_executions.join(
                flow_runs, and_(_R.org_id == _S.org_id, _R.flow_run_id == _S.flow_run_id)
            )
        )
        .where(
            _S.org_id == bindparam("org"),
            _S.state == bindparam(f"state_{index}"),
            _S.queue_class == bindparam("queue_class"),
            _S.run_after <= now,
            _R.current_step_execution_id == _S.step_execution_id,
            *_CANDIDATE_ROOT,
        )
        .order_by(_S.run_after, _S.step_execution_id)
        .limit(bindparam("limit", type_=Integer))
        .subquery(f"due_{index}")
    )


def _with_trace(due: Any) -> Any:
    """A range's rows with their root's ``trace_context``, read by primary key outside the
    derived table (which stays narrow enough for a memory temporary table). On
    MariaDB/MySQL ``STRAIGHT_JOIN`` keeps the range first: read from the root side, the
    optimizer could scan every run of the org to probe the (few) range rows."""
    root = flow_runs.alias("root_")
    return (
        select(*due.c, root.c.trace_context)
        .select_from(
            due.join(
                root,
                and_(root.c.org_id == bindparam("org"), root.c.flow_run_id == due.c.flow_run_id),
            )
        )
        .prefix_with("STRAIGHT_JOIN", dialect="mysql")
        .prefix_with("STRAIGHT_JOIN", dialect="mariadb")
    )


#: :func:`eligible_work_txn`'s query, built once (issue 13): every claimable state's
#: bounded range (each its own derived table, so each keeps its ORDER BY and LIMIT — the
#: ranges the one-query-per-state reads scanned) in one statement, ``UNION ALL``.
_ELIGIBLE_WORK = union_all(
    *(
        _with_trace(due)
        for due in (_eligible_range(i, bindparam("now")) for i in range(len(_CLAIMABLE_CODES)))
    )
)
#: The same query due at the MySQL-protocol server's clock as the statement runs
#: (``UTC_TIMESTAMP(6)``, what ``services.db.db_now`` reads there; one value per
#: statement): discovery without a round trip for the clock.
_ELIGIBLE_WORK_AT_SERVER_NOW = union_all(
    *(
        _with_trace(due)
        for due in (
            _eligible_range(i, literal_column("UTC_TIMESTAMP(6)"))
            for i in range(len(_CLAIMABLE_CODES))
        )
    )
)
#: The state parameters of :data:`_ELIGIBLE_WORK`.
_ELIGIBLE_STATES = {f"state_{i}": code for i, code in enumerate(_CLAIMABLE_CODES)}
#: :func:`candidate_for_run_txn`'s read: the run's current step by primary key.
_CANDIDATE_FOR_RUN = (
    select(*_CANDIDATE_COLUMNS)
    .select_from(
        flow_runs.join(
            flow_step_executions,
            and_(_S.org_id == _R.org_id, _S.step_execution_id == _R.current_step_execution_id),
        )
    )
    .where(
        _R.org_id == bindparam("org"),
        _R.flow_run_id == bindparam("run"),
        _S.state.in_(_CLAIMABLE_CODES),
        _S.run_after <= bindparam("now"),
        *_CANDIDATE_ROOT,
    )
)


def _candidate(org_id: str, row: Any) -> Candidate:
    """The candidate of one row of :data:`_CANDIDATE_COLUMNS` (read by column key)."""
    return Candidate(
        org_id=org_id,
        flow_run_id=row.flow_run_id,
        step_execution_id=row.step_execution_id,
        root_state_version=row.root_state_version,
        step_state_version=row.state_version,
        run_after=row.run_after,
        queue_class=row.queue_class,
        plan_id=row.plan_id,
        trace_context=row.trace_context,
        execution_profile=row.execution_profile,
        step_kind=row.step_kind,
    )


async def eligible_work_txn(
    conn: AsyncConnection,
    org_id: str,
    queue_class: str,
    now: datetime | None,
    limit: int,
    ownership_epoch: int,
    *,
    last: bool = False,
) -> list[Candidate]:
    """§12.1 step 1: due current steps of runnable, non-deleted V2 roots.

    ``now``: the durable clock's reading; ``None``: the database's own clock
    (``services.db.db_now``) — on a MySQL-protocol backend the query compares with it
    as it runs (``UTC_TIMESTAMP(6)``, in the query's own round trip), elsewhere it is
    read first.

    ``last``: the query ends the caller's read-only transaction — its round trip carries
    the ``COMMIT`` where the backend allows (``services.db_batch.execute_reads``).

    One bounded range per claimable step state over the step claim index
    ``(org, state, queue_class, run_after, id)``, joined to the root by primary key —
    the ranges in one statement (``UNION ALL`` of one derived table per state, each with
    its own order and limit); ``Waiting`` and leased steps are outside every range
    scanned, so the waiting population is never read. Results merge in ``(run_after,
    step id)`` order.
    """
    params: dict[str, Any] = {
        "org": org_id,
        "queue_class": queue_class,
        "epoch": ownership_epoch,
        "limit": limit,
        **_ELIGIBLE_STATES,
    }
    if now is None and conn.dialect.name == "mysql":
        read = Read(_ELIGIBLE_WORK_AT_SERVER_NOW, params)
    else:
        at = now if now is not None else await db_now(conn)
        read = Read(_ELIGIBLE_WORK, {**params, "now": at})
    [rows] = await execute_reads(conn, [read], commit=last)
    found = [_candidate(org_id, row) for row in rows]
    found.sort(key=lambda c: (c.run_after, c.step_execution_id))
    return found[:limit]


async def candidate_for_run_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, now: datetime, ownership_epoch: int
) -> Candidate | None:
    """The run's current step as a claim candidate when it is due now (the conditions of
    :func:`eligible_work_txn`, by primary key), else ``None``."""
    params = {"org": org_id, "run": flow_run_id, "now": now, "epoch": ownership_epoch}
    [rows] = await execute_reads(conn, [Read(_CANDIDATE_FOR_RUN, params)])
    return _candidate(org_id, rows[0]) if rows else None


_EXPIRED_LEASES = (
    select(_S.flow_run_id, _S.step_execution_id, _S.lease_until)
    .where(
        _S.org_id == bindparam("org"),
        _S.lease_until < bindparam("now"),
        _S.state.in_([StepState.CLAIMED.code, StepState.RUNNING.code]),
    )
    .order_by(_S.lease_until, _S.step_execution_id)
    .limit(bindparam("limit", type_=Integer))
)


async def expired_leases_txn(
    conn: AsyncConnection, org_id: str, now: datetime, limit: int
) -> list[ExpiredLease]:
    """Leased steps past their deadline, oldest first, over the ``(org, lease_until)``
    index (every non-leased state has ``lease_until`` NULL, outside the range)."""
    params = {"org": org_id, "now": now, "limit": limit}
    return [
        ExpiredLease(r["flow_run_id"], r["step_execution_id"], r["lease_until"])
        for r in (await conn.execute(_EXPIRED_LEASES, params)).mappings()
    ]


_CANCEL_REQUESTED = (
    select(_R.flow_run_id)
    .where(_R.org_id == bindparam("org"), _R.runtime_state == RunState.CANCEL_REQUESTED.code)
    .order_by(_R.flow_run_id)
    .limit(bindparam("limit", type_=Integer))
)


async def cancel_requested_runs_txn(conn: AsyncConnection, org_id: str, limit: int) -> list[str]:
    """Runs waiting for cancellation cleanup (``CancelRequested``), in stable id order,
    over the ``(org, runtime_state, …)`` claim index of ``flow_runs``."""
    params = {"org": org_id, "limit": limit}
    return [str(r) for r in (await conn.execute(_CANCEL_REQUESTED, params)).scalars()]
