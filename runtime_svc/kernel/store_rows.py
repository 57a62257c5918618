"""Row-level ``_txn`` helpers of :mod:`runtime_svc.kernel.store`: decoding, §12-ordered
locking, and applying a decision's :class:`~runtime_svc.kernel.model.Transition` as
compare-and-swap UPDATEs plus idempotent inserts.

Every helper runs inside the caller's transaction and takes the trusted ``org_id``
first; nothing here opens a transaction. This module and ``store.py`` are the only
writers of ``flow_runs``, ``flow_step_executions``, ``flow_step_attempts`` and
``flow_checkpoints`` (a test scans ``runtime_svc/`` for any other DML on them).

Locks are ``SELECT … FOR UPDATE`` in the lifecycle sub-order of §12 — root, steps in
stable id order, attempts — and only order rows; the fence itself is always the
conditional UPDATE checked by row count (``services.db.cas_update``). On SQLite
``FOR UPDATE`` renders as nothing and ``BEGIN IMMEDIATE`` serialises writers instead.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Dialect, bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.applied import projected_step_state
from runtime_svc.kernel.checkpoint_guard import validate_checkpoint_payload
from runtime_svc.kernel.decisions import ATTEMPTS, RUNS, STEPS, FenceLost
from runtime_svc.kernel.errors import fence_lost
from runtime_svc.kernel.model import (
    AttemptPatch,
    AttemptRecord,
    CheckpointInput,
    CheckpointMeta,
    LeaseFence,
    NewAttempt,
    NewStep,
    RunPatch,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
    patch_changes,
)
from runtime_svc.kernel.states import (
    ACTIVE_RUN_STATES,
    AttemptOutcome,
    CodedEnum,
    ExecutionOwner,
    StepState,
)
from runtime_svc.kernel.store_codec import (
    ATTEMPT_COLUMNS,
    RUN_COLUMNS,
    STEP_COLUMNS,
    attempt_from_row,
    run_from_row,
    step_from_row,
)
from runtime_svc.kernel.tables import compatibility_status
from runtime_svc.schema import (
    MAX_PLAN_CURSOR_BYTES,
    MAX_SUMMARY_BYTES,
    flow_checkpoints,
    flow_runs,
    flow_step_attempts,
    flow_step_executions,
)
from services.db import (
    FencedWrite,
    SwitchOnNull,
    now_column,
    remember_now,
)
from services.db_batch import (
    Read,
    Write,
    commit_writes,
    execute_reads,
    execute_writes,
    execute_writes_if_absent,
    fenced_writes,
    is_if_absent,
)
from services.digest import digest_bytes
from services.errors import ConflictError, FenceLostError, InvalidArgumentError, NotFoundError
from services.invariants import InvariantError
from services.metrics import metrics

__all__ = [
    "PreparedCheckpoint",
    "apply_claim_running",
    "apply_commit_continued",
    "apply_transition",
    "attempt_insert",
    "checkpoint_insert",
    "checkpoint_written",
    "claimed_run_values",
    "count_fenced_attempts",
    "execute_deferred",
    "extend_lease_row",
    "fence_error",
    "fenced_locked",
    "fenced_read",
    "held_transition_writes",
    "last_checkpoint_sequence",
    "lock_attempt",
    "lock_fenced",
    "lock_fenced_sequential",
    "lock_latest_attempt",
    "lock_root_and_current",
    "lock_run",
    "lock_step",
    "new_id",
    "new_run_id",
    "prepare_checkpoint",
    "step_insert",
]

_V2 = ExecutionOwner.FLOW_RUNTIME_V2.code


def new_id(prefix: str) -> str:
    """An unpredictable app-generated id (``step_…``, ``att_…``, ``ckpt_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def new_run_id() -> str:
    """A run id whose prefix is the creation time in milliseconds, so the stable keyset
    order of ``list_runs`` (the primary key) is roughly creation order. Ordering is a
    convenience only; nothing relies on it for correctness."""
    return f"run_{int(time.time() * 1000):012x}{secrets.token_hex(10)}"


def fence_error(lost: FenceLost) -> FenceLostError:
    """The typed error of a revalidation :class:`FenceLost` decision."""
    return fence_lost(lost.entity, lost.key, lost.expected_version, lost.found_version, lost.reason)


# --- locks (§12 lifecycle sub-order: root, steps, attempts) ------------------------------


def _lock_by_key(table: Any, key: str, columns: tuple[str, ...]) -> Any:
    """``SELECT <columns> … WHERE org_id = :org AND <key> = :key FOR UPDATE``, built once
    at import: executing a pre-built statement with bound parameters skips SQLAlchemy's
    per-call construction and cache-key generation (issue 13, ``docs/performance.md``).
    ``columns`` are exactly those the row's decoder reads (``store_codec``): every
    column descriptor of a result set costs the driver a packet parse (round 7)."""
    return (
        select(*(table.c[name] for name in columns))
        .where(table.c.org_id == bindparam("org"), table.c[key] == bindparam("key"))
        .with_for_update()
    )


_LOCK_RUN = _lock_by_key(flow_runs, "flow_run_id", RUN_COLUMNS)
_LOCK_STEP = _lock_by_key(flow_step_executions, "step_execution_id", STEP_COLUMNS)
_LOCK_ATTEMPT = _lock_by_key(flow_step_attempts, "attempt_id", ATTEMPT_COLUMNS)


def _joined_lock(*, attempt: bool) -> Any:
    """The one locking read of a fence's root, step and (``attempt``) attempt (ADR 0006):

    ``SELECT STRAIGHT_JOIN <root>, <step>[, <attempt>] FROM flow_runs
    LEFT JOIN flow_step_executions ON <step key> [LEFT JOIN flow_step_attempts ON
    <attempt key>] WHERE <root key> FOR UPDATE``

    Every table is looked up by its own primary key — the org (the root's, which the
    WHERE clause binds to the trusted org) and the fence's id — as the single-row reads
    did, never through another row's ids, so the join adds no condition the sequential
    reads did not have. The root is the outer (left-most) table: a missing root yields
    no row at all and locks nothing else; a missing step or attempt yields NULL columns
    — the sequential reads' ``None``. On MariaDB/MySQL ``STRAIGHT_JOIN`` pins the join
    order to the FROM order (root, step, attempt), which is the order InnoDB takes the
    row locks in — §12's lifecycle order; an outer join's inner table is read after its
    outer table anyway. On SQLite ``FOR UPDATE`` renders as nothing and the ``BEGIN
    IMMEDIATE`` write lock serialises writers. Columns are labelled ``r_``, ``s_``,
    ``a_`` and decoded by position with the ordinary row decoders."""
    r, s, a = flow_runs.c, flow_step_executions.c, flow_step_attempts.c
    joined = flow_runs.outerjoin(
        flow_step_executions,
        (s.org_id == r.org_id) & (s.step_execution_id == bindparam("step")),
    )
    columns = [
        *(r[name].label(f"r_{name}") for name in RUN_COLUMNS),
        *(s[name].label(f"s_{name}") for name in STEP_COLUMNS),
    ]
    if attempt:
        joined = joined.outerjoin(
            flow_step_attempts,
            (a.org_id == r.org_id) & (a.attempt_id == bindparam("attempt")),
        )
        columns.extend(a[name].label(f"a_{name}") for name in ATTEMPT_COLUMNS)
    return (
        select(*columns)
        .select_from(joined)
        .where(r.org_id == bindparam("org"), r.flow_run_id == bindparam("run"))
        .with_for_update()
        .prefix_with("STRAIGHT_JOIN", dialect="mysql")
        .prefix_with("STRAIGHT_JOIN", dialect="mariadb")
    )


#: The joined reads without the clock column: root + step (the claim), + attempt (a fence).
_JOINED = {False: _joined_lock(attempt=False), True: _joined_lock(attempt=True)}
#: The INSERTs of the kernel's writes (``services.db_batch.Write``s: one prebuilt construct
#: each, compiled once per shape).
_INSERT_STEP = insert(flow_step_executions)
_INSERT_ATTEMPT = insert(flow_step_attempts)
_INSERT_CHECKPOINT = insert(flow_checkpoints)
_STEP_AT = len(RUN_COLUMNS)
_ATTEMPT_AT = _STEP_AT + len(STEP_COLUMNS)
# The primary-key column of the step and of the attempt in the joined row: NULL exactly
# when the outer join found no such row.
_STEP_KEY_AT = _STEP_AT + STEP_COLUMNS.index("step_execution_id")
_ATTEMPT_KEY_AT = _ATTEMPT_AT + ATTEMPT_COLUMNS.index("attempt_id")
_CLOCK_AT = _ATTEMPT_AT + len(ATTEMPT_COLUMNS)
#: The joined reads with the database clock as their last column, per dialect name (its
#: clock SQL differs) and whether the attempt is joined.
_CLOCKED: dict[tuple[str, bool], tuple[Any, Callable[[Any], datetime]]] = {}


async def _joined_row(
    conn: AsyncConnection, params: Mapping[str, str], *, attempt: bool
) -> Any | None:
    """Run the clocked joined read; the clock (its last column) becomes the
    transaction's ``db_now`` (``services.db.remember_now``; the first reading of a
    transaction wins). ``None``: no such root (nothing locked, no clock kept)."""
    stmt, parse_now = _clocked(conn.dialect, attempt=attempt)
    [rows] = await execute_reads(conn, [Read(stmt, params)])
    row = rows[0] if rows else None
    if row is not None:
        remember_now(conn, parse_now(row[-1]))
    return row


def _clocked(dialect: Dialect, *, attempt: bool) -> tuple[Any, Callable[[Any], datetime]]:
    key = (dialect.name, attempt)
    built = _CLOCKED.get(key)
    if built is None:
        clock, parse = now_column(dialect)
        built = _CLOCKED[key] = (_JOINED[attempt].add_columns(clock), parse)
    return built


def _root_of(row: Any) -> RunRecord:
    return run_from_row(dict(zip(RUN_COLUMNS, row[:_STEP_AT], strict=True)))


def _step_of(row: Any) -> StepRecord:
    return step_from_row(dict(zip(STEP_COLUMNS, row[_STEP_AT:_ATTEMPT_AT], strict=True)))


async def lock_run(conn: AsyncConnection, org_id: str, flow_run_id: str) -> RunRecord | None:
    """Lock and read the root (first lifecycle lock of every transition)."""
    row = (await conn.execute(_LOCK_RUN, {"org": org_id, "key": flow_run_id})).mappings().first()
    return None if row is None else run_from_row(row)


async def lock_step(conn: AsyncConnection, org_id: str, step_id: str) -> StepRecord | None:
    """Lock and read one step (after its root)."""
    row = (await conn.execute(_LOCK_STEP, {"org": org_id, "key": step_id})).mappings().first()
    return None if row is None else step_from_row(row)


async def lock_attempt(conn: AsyncConnection, org_id: str, attempt_id: str) -> AttemptRecord | None:
    """Lock and read one attempt (after its root and step)."""
    row = (await conn.execute(_LOCK_ATTEMPT, {"org": org_id, "key": attempt_id})).mappings().first()
    return None if row is None else attempt_from_row(row)


_LOCK_LATEST_ATTEMPT = (
    select(*(flow_step_attempts.c[name] for name in ATTEMPT_COLUMNS))
    .where(
        flow_step_attempts.c.org_id == bindparam("org"),
        flow_step_attempts.c.step_execution_id == bindparam("step"),
        flow_step_attempts.c.attempt_number == bindparam("number"),
    )
    .with_for_update()
)


async def lock_latest_attempt(
    conn: AsyncConnection, org_id: str, step: StepRecord
) -> AttemptRecord | None:
    """Lock and read the step's latest attempt (number ``attempt_count``), if any."""
    if step.attempt_count < 1:
        return None
    params = {"org": org_id, "step": step.step_execution_id, "number": step.attempt_count}
    row = (await conn.execute(_LOCK_LATEST_ATTEMPT, params)).mappings().first()
    return None if row is None else attempt_from_row(row)


_COUNT_FENCED = select(func.count()).where(
    flow_step_attempts.c.org_id == bindparam("org"),
    flow_step_attempts.c.step_execution_id == bindparam("step"),
    flow_step_attempts.c.transaction_outcome == AttemptOutcome.FENCED.code,
)


async def count_fenced_attempts(conn: AsyncConnection, org_id: str, step_id: str) -> int:
    """How many of the step's attempts ended ``Fenced`` (its prior lease expiries)."""
    params = {"org": org_id, "step": step_id}
    return int((await conn.execute(_COUNT_FENCED, params)).scalar_one())


# --- composite locks ---------------------------------------------------------------------


async def lock_fenced(
    conn: AsyncConnection, org_id: str, fence: LeaseFence
) -> tuple[RunRecord, StepRecord, AttemptRecord]:
    """Lock the fence's root, step and attempt, in that order, with one statement
    (``docs/adr/0006-joined-lock-read.md``; before round 7: three ``SELECT … FOR UPDATE``
    one after another, :func:`lock_fenced_sequential`).

    The statement also carries the database clock and keeps it as the transaction's
    ``db_now`` (``services.db.remember_now``; the first reading of a transaction wins): a
    transition that locks first and then asks its clock needs no clock statement. The
    clock is the statement's, as a clock statement right before it would have read.

    Raises:
        FenceLostError: one of them does not exist in ``org_id`` (found version None) —
            checked root, then step, then attempt, as the sequential reads did.
    """
    [rows] = await execute_reads(conn, [fenced_read(conn.dialect, org_id, fence)])
    return fenced_locked(conn, rows, fence)


def fenced_read(dialect: Dialect, org_id: str, fence: LeaseFence) -> Read:
    """:func:`lock_fenced`'s statement as a read of a batched round trip
    (``services.db_batch.execute_reads``, ADR 0011's amendment); its rows go to
    :func:`fenced_locked`."""
    params = {
        "org": org_id,
        "run": fence.flow_run_id,
        "step": fence.step_execution_id,
        "attempt": fence.attempt_id,
    }
    return Read(_clocked(dialect, attempt=True)[0], params)


def fenced_locked(
    conn: AsyncConnection, rows: Sequence[Any], fence: LeaseFence
) -> tuple[RunRecord, StepRecord, AttemptRecord]:
    """The rows of :func:`fenced_read` as :func:`lock_fenced` answers them (the clock
    kept as the transaction's ``db_now``).

    Raises:
        FenceLostError: as :func:`lock_fenced`.
    """
    if len(rows) > 1:
        raise InvariantError("a fence's locking read matched several rows")
    if not rows:
        raise fence_lost(RUNS, fence.flow_run_id, fence.root_state_version, None, "missing")
    row = rows[0]
    remember_now(conn, _clocked(conn.dialect, attempt=True)[1](row[-1]))
    if row[_STEP_KEY_AT] is None:
        raise fence_lost(STEPS, fence.step_execution_id, fence.step_state_version, None, "missing")
    if row[_ATTEMPT_KEY_AT] is None:
        raise fence_lost(ATTEMPTS, fence.attempt_id, fence.attempt_state_version, None, "missing")
    return (
        _root_of(row),
        _step_of(row),
        attempt_from_row(dict(zip(ATTEMPT_COLUMNS, row[_ATTEMPT_AT:_CLOCK_AT], strict=True))),
    )


async def lock_run_and_step(
    conn: AsyncConnection, org_id: str, flow_run_id: str, step_execution_id: str
) -> tuple[RunRecord | None, StepRecord | None]:
    """:func:`lock_run` then :func:`lock_step` as one statement, root first (the joined
    read of ADR 0006 without the attempt), which also carries the database clock and
    keeps it as the transaction's ``db_now`` (``remember_now``): the claim's clock,
    root and step in one round trip. ``(None, None)`` when the root is missing (nothing
    locked), ``(root, None)`` when the step is."""
    params = {"org": org_id, "run": flow_run_id, "step": step_execution_id}
    row = await _joined_row(conn, params, attempt=False)
    if row is None:
        return None, None
    return _root_of(row), None if row[_STEP_KEY_AT] is None else _step_of(row)


async def lock_fenced_sequential(
    conn: AsyncConnection, org_id: str, fence: LeaseFence
) -> tuple[RunRecord, StepRecord, AttemptRecord]:
    """:func:`lock_fenced` as three single-row locking reads (root, step, attempt) — the
    pre-round-7 path, kept as the reference the joined read is tested against.

    Raises:
        FenceLostError: as :func:`lock_fenced`.
    """
    root = await lock_run(conn, org_id, fence.flow_run_id)
    if root is None:
        raise fence_lost(RUNS, fence.flow_run_id, fence.root_state_version, None, "missing")
    step = await lock_step(conn, org_id, fence.step_execution_id)
    if step is None:
        raise fence_lost(STEPS, fence.step_execution_id, fence.step_state_version, None, "missing")
    attempt = await lock_attempt(conn, org_id, fence.attempt_id)
    if attempt is None:
        raise fence_lost(ATTEMPTS, fence.attempt_id, fence.attempt_state_version, None, "missing")
    return root, step, attempt


async def lock_root_and_current(
    conn: AsyncConnection, org_id: str, flow_run_id: str
) -> tuple[RunRecord, StepRecord | None]:
    """Lock the root, then its current step (if any).

    Raises:
        NotFoundError: no such run in ``org_id``.
    """
    root = await lock_run(conn, org_id, flow_run_id)
    if root is None:
        raise NotFoundError("flow_run", flow_run_id)
    step_id = root.current_step_execution_id
    step = None if step_id is None else await lock_step(conn, org_id, step_id)
    return root, step


# --- applying a transition ---------------------------------------------------------------


def _coded(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        # Enum members are stored by their spec code ("Running"), never their number.
        out[name] = value.code if isinstance(value, CodedEnum) else value
    return out


def _run_write(
    org_id: str,
    patch: RunPatch,
    step_state: StepState | None,
    now: datetime,
    then: RunPatch | None = None,
) -> FencedWrite:
    """``patch`` as one conditional UPDATE; with ``then`` (a patch decided on the row
    ``patch`` leaves, same epoch), both in the same UPDATE: ``patch``'s predicates plus
    ``then``'s liveness/pause predicates, the values of both, ``then``'s target state —
    one version step (:func:`apply_commit_continued`)."""
    changes = patch_changes(patch)
    last = patch
    if then is not None:
        if then.expect_epoch != patch.expect_epoch or then.from_state is not patch.to_state:
            raise InvariantError("the second root patch does not continue the first")
        changes.update(patch_changes(then))
        last = then
    values = _coded(changes)
    status: Any = compatibility_status(last.to_state, step_state).code
    if last.to_state in ACTIVE_RUN_STATES:
        # An operator-paused run (PauseRun) keeps projecting §18.2 ``Paused`` through
        # every transition it still takes (a running step's commit, a wait resolution).
        paused = compatibility_status(last.to_state, step_state, paused=True).code
        status = SwitchOnNull("operator_paused_at", paused, status)
    values.update(runtime_state=last.to_state.code, interview_status=status, updated_at=now)
    equal: dict[str, Any] = {
        "runtime_state": patch.from_state.code,
        "execution_owner": _V2,
        "ownership_epoch": patch.expect_epoch,
    }
    if patch.require_live or (then is not None and then.require_live):
        equal.update(is_deleted=False, delete_requested_at=None)
    if patch.expect_current_step is not None:
        equal["current_step_execution_id"] = patch.expect_current_step
    if patch.require_not_paused or (then is not None and then.require_not_paused):
        equal["operator_paused_at"] = None
    return FencedWrite(
        flow_runs,
        org_id=org_id,
        key={"flow_run_id": patch.flow_run_id},
        expected_version=patch.expected_version,
        values=values,
        equal=equal,
    )


def _step_write(
    org_id: str,
    patch: StepPatch,
    now: datetime,
    then: StepPatch | None = None,
) -> FencedWrite:
    """``patch`` as one conditional UPDATE; with ``then`` (a patch decided on the row
    ``patch`` leaves), both in the same UPDATE: ``patch``'s predicates, the values of
    both, ``then``'s target state — one version step (:func:`apply_claim_running`)."""
    changes = patch_changes(patch)
    if then is not None:
        changes.update(patch_changes(then))
    if "lease_token_digest" in changes:
        changes["lease_token"] = changes.pop("lease_token_digest")
    values = _coded(changes)
    values.update(state=(patch if then is None else then).to_state.code, updated_at=now)
    equal: dict[str, Any] = {
        "state": patch.from_state.code,
        "ownership_epoch": patch.expect_epoch,
        "lease_token": patch.expect_lease_token_digest,  # None: IS NULL
    }
    if patch.expect_input_checkpoint_id is not None:
        equal["input_checkpoint_id"] = patch.expect_input_checkpoint_id
    return FencedWrite(
        flow_step_executions,
        org_id=org_id,
        key={"step_execution_id": patch.step_execution_id},
        expected_version=patch.expected_version,
        values=values,
        equal=equal,
    )


def _attempt_write(org_id: str, patch: AttemptPatch) -> FencedWrite:
    values = _coded(patch_changes(patch))
    values["transaction_outcome"] = patch.to_state.code
    equal: dict[str, Any] = {
        "transaction_outcome": patch.from_state.code,
        "lease_token_digest": patch.expect_lease_token_digest,
        "ownership_epoch": patch.expect_epoch,
    }
    if patch.expect_root_state_version_at_claim is not None:
        equal["root_state_version_at_claim"] = patch.expect_root_state_version_at_claim
    return FencedWrite(
        flow_step_attempts,
        org_id=org_id,
        key={"attempt_id": patch.attempt_id},
        expected_version=patch.expected_version,
        values=values,
        version_column="attempt_state_version",
        equal=equal,
    )


async def apply_transition(
    conn: AsyncConnection,
    org_id: str,
    transition: Transition,
    now: datetime,
    *,
    rows_locked: bool = False,
    before: Sequence[Write] = (),
    last: Write | None = None,
    after: Sequence[Write] = (),
    final: bool = False,
    before_commit: Callable[[], None] | None = None,
) -> bool:
    """Apply ``transition`` in §12 order: root, step, attempt CAS, then inserts.

    ``before``: writes of the same transaction that go first (the commit's checkpoint
    INSERT: :func:`checkpoint_insert`), in the same round trip where the backend
    batches writes (``services.db_batch``).

    ``last``: one write of the same transaction that goes after the transition's, in the
    same round trip when ``rows_locked`` — the next write in the lock order, e.g. a wait
    transition's dependency UPDATE (``store_waits.apply_wait_transition``). Its row need
    not be held: nothing runs after it in the round trip, so a lost fence there stops
    the transaction exactly where the statements one by one would (ADR 0010).

    ``after``: new rows of the same transaction keyed under the held root (a wait's
    dependency, an effect's dependency, outbox message and link: :class:`CommitTail`),
    after the transition's writes in the same round trip when ``rows_locked``; at most
    one of them an insert-if-absent (``services.db_batch.insert_if_absent_write``), and
    the return value says whether it inserted (``False``: its row was there, and the
    writes after it — ``last`` too — did not run). ``True`` without one.

    ``rows_locked``: this transaction already holds the lock of every row the
    transition patches (its fenced lock read: :func:`lock_fenced`,
    :func:`lock_run_and_step`), so the conditional UPDATEs may be one statement where
    the backend has multi-table UPDATE (:func:`services.db.fenced_updates`: the same
    predicates, all rows or none). Without it each UPDATE is its own statement, in
    root → step → attempt order, and takes its row's lock in that order.

    ``final``: these are the transaction's last writes (``rows_locked``, no ``after``):
    they carry its ``COMMIT`` where the backend allows, the fenced UPDATEs' row counts
    guarded on the server before it (``services.db_batch.commit_writes``, ADR 0014);
    ``before_commit`` is called right before the ``COMMIT`` goes out (there, or — not
    carried — after these writes).

    Raises:
        FenceLostError: any conditional UPDATE matched no row (the caller's transaction
            must roll back; everything it wrote goes with it).
    """
    if final and (not rows_locked or after):
        raise InvariantError("only a held transition without new rows after it commits")
    batch = _transition_batch(
        conn,
        org_id,
        transition,
        now,
        rows_locked=rows_locked,
        before=before,
        last=last,
        after=after,
    )
    if_absent = any(is_if_absent(w) for w in after)
    if rows_locked:
        # In order, one round trip where the backend allows (ADR 0010): each UPDATE's
        # row count and each INSERT's duplicate key decide as the statements alone would.
        if if_absent:
            return await execute_writes_if_absent(conn, batch)
        await _send(conn, batch, final=final, before_commit=before_commit)
        return True
    # Rows not held yet: a lost fence must stop the statements after it before they
    # take their rows' locks (a batch runs them, then rolls them back), so one by one.
    for write in batch:
        if is_if_absent(write):
            if not await execute_writes_if_absent(conn, [write]):
                return False
        else:
            await execute_writes(conn, [write])
    return True


async def _send(
    conn: AsyncConnection,
    batch: Sequence[Write],
    *,
    final: bool,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """``batch`` in order: the transaction's last writes carrying its ``COMMIT`` when
    ``final`` (``services.db_batch.commit_writes``, ADR 0014), else ``execute_writes``."""
    if final:
        await commit_writes(conn, batch, before_commit=before_commit)
    else:
        await execute_writes(conn, batch)


def _transition_batch(
    conn: AsyncConnection,
    org_id: str,
    transition: Transition,
    now: datetime,
    *,
    rows_locked: bool,
    before: Sequence[Write] = (),
    last: Write | None = None,
    after: Sequence[Write] = (),
) -> list[Write]:
    """:func:`apply_transition`'s writes, in its order, not executed."""
    writes: list[FencedWrite] = []
    if transition.run is not None:
        projected = projected_step_state(transition)
        writes.append(_run_write(org_id, transition.run, projected, now))
    if transition.step is not None:
        writes.append(_step_write(org_id, transition.step, now))
    if transition.attempt is not None:
        writes.append(_attempt_write(org_id, transition.attempt))
    batch = [*before, *fenced_writes(conn, writes, together=rows_locked)]
    if transition.new_attempt is not None:
        batch.append(attempt_insert(org_id, transition.new_attempt))
    if transition.new_step is not None:
        batch.append(step_insert(org_id, transition.new_step, now, None))
    batch.extend(after)
    if last is not None:
        batch.append(last)
    return batch


def held_transition_writes(
    conn: AsyncConnection,
    org_id: str,
    transition: Transition,
    now: datetime,
    *,
    last: Write | None = None,
) -> list[Write] | None:
    """The writes :func:`apply_transition` ``(rows_locked=True, last=last)`` would execute,
    in its order, for the caller to send at the head of a later round trip of the same
    transaction (the pre-claimed wake: ``store_waits.resolve_in``), or ``None`` when the
    transition inserts a row or patches an attempt (apply it with :func:`apply_transition`
    instead). The caller holds the lock of every row the transition patches."""
    if (
        transition.attempt is not None
        or transition.new_attempt is not None
        or transition.new_step is not None
    ):
        return None
    return _transition_batch(conn, org_id, transition, now, rows_locked=True, last=last)


async def execute_deferred(
    conn: AsyncConnection, first: Sequence[Write], last: Write | None
) -> None:
    """Writes a resolution deferred for a claim's round trip (:func:`held_transition_writes`
    and its signal UPDATE), executed without the claim: in order, in one round trip where
    the backend batches; nothing when nothing was deferred."""
    await execute_writes(conn, [*first, *(() if last is None else (last,))])


async def apply_claim_running(
    conn: AsyncConnection,
    org_id: str,
    claim: Transition,
    running: StepPatch,
    now: datetime,
    *,
    before: Sequence[Write] = (),
    last: Write | None = None,
    final: bool = False,
) -> None:
    """A claim's ``transition`` with its step going on to ``Running`` in the same
    conditional UPDATE (the fused claim, ``docs/adr/0003-fused-claim-running.md``).

    ``before``: writes of the caller's transaction that go first, in the same round trip
    (a wait resolution's root/step and dependency UPDATEs, :func:`held_transition_writes`,
    whose rows leave the versions this claim expects). ``last``: a write of the caller's
    transaction that goes after the claim's, in the same round trip (``apply_transition``'s
    ``last``: its row need not be held). ``final``: these are the transaction's last
    writes — they carry its ``COMMIT`` where the backend allows, the fenced UPDATE's row
    count guarded on the server first (``apply_transition``'s, ADR 0014).

    ``running`` is ``decide_start_running``'s patch, decided on the rows the claim
    leaves (``kernel.applied``). The root UPDATE and the attempt INSERT are the claim's;
    the step UPDATE carries the claim's predicates (version, ``Pending``/``Runnable``
    state, epoch, no lease token) and sets the claim's lease *and* ``Running``, moving
    the version by one. Nothing is weaker than the two UPDATEs it replaces: the second
    compared only what the first had just written under the root lock. The caller holds
    the root and step locks (its claim read, or the rows its transaction wrote), so the
    root and step UPDATEs are one statement where the backend allows
    (:func:`services.db.fenced_updates`).

    Raises:
        FenceLostError: an UPDATE matched no row (the transaction must roll back).
        InvariantError: ``claim`` is not a claim's transition, or ``running`` is not the
            next arrow of its step.
    """
    step = claim.step
    if claim.run is None or step is None or claim.new_attempt is None:
        raise InvariantError("a claim transition patches root and step and adds an attempt")
    if claim.attempt is not None or claim.new_step is not None:
        raise InvariantError("a claim transition touches no other attempt or step")
    if running.step_execution_id != step.step_execution_id or running.from_state is not (
        step.to_state
    ):
        raise InvariantError("the running patch does not continue the claim's step patch")
    writes = (
        _run_write(org_id, claim.run, projected_step_state(claim), now),
        _step_write(org_id, step, now, then=running),
    )
    # One round trip where the backend allows (ADR 0010), decided in statement order.
    batch = [
        *before,
        *fenced_writes(conn, writes, together=True),
        attempt_insert(org_id, claim.new_attempt),
        *(() if last is None else (last,)),
    ]
    await _send(conn, batch, final=final)


async def apply_commit_continued(
    conn: AsyncConnection,
    org_id: str,
    commit: Transition,
    claim: Transition,
    running: StepPatch,
    now: datetime,
    *,
    before: Sequence[Write] = (),
    final: bool = False,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """A commit's ``transition`` fused with the continuation's claim of the step it
    inserts and that step's ``Running`` (``docs/adr/0003-fused-claim-running.md``).
    ``before``, ``final`` and ``before_commit``: as :func:`apply_transition`'s.

    ``claim`` and ``running`` are ``decide_claim`` / ``decide_start_running`` decided on
    the rows ``commit`` leaves (``kernel.applied``). Written: one root UPDATE with the
    commit's predicates (and the claim's liveness/pause ones) that leaves the root
    ``Running`` on the new step (one version step); the old step and attempt UPDATEs
    of the commit; the new step INSERTed already claimed and ``Running``; the new
    attempt INSERTed. Every UPDATE is conditional as before; the claim's own
    predicates on the new step compared only the row this INSERT makes. The commit's
    lock read holds root, step and attempt, so their UPDATEs are one statement where
    the backend allows (:func:`services.db.fenced_updates`).

    Raises:
        FenceLostError: an UPDATE matched no row (the transaction must roll back).
        InvariantError: the transitions are not a commit that inserts a step and a
            claim of that step.
    """
    new_step, step = commit.new_step, claim.step
    if commit.run is None or claim.run is None or new_step is None or step is None:
        raise InvariantError("a continued commit advances the root to a step it inserts")
    if claim.new_attempt is None or claim.attempt is not None or claim.new_step is not None:
        raise InvariantError("a claim transition adds exactly one attempt")
    if commit.new_attempt is not None:
        raise InvariantError("a commit adds no attempt")
    writes = [_run_write(org_id, commit.run, running.to_state, now, then=claim.run)]
    if commit.step is not None:
        writes.append(_step_write(org_id, commit.step, now))
    if commit.attempt is not None:
        writes.append(_attempt_write(org_id, commit.attempt))
    # In order, one round trip where the backend allows (ADR 0010): the UPDATEs' row
    # counts decide first, then the INSERTs' duplicate keys, as the statements alone would.
    batch = [
        *before,
        *fenced_writes(conn, writes, together=True),
        step_insert(org_id, new_step, now, (step, running)),
        attempt_insert(org_id, claim.new_attempt),
    ]
    await _send(conn, batch, final=final, before_commit=before_commit)


def step_insert(
    org_id: str, s: NewStep, now: datetime, claimed: tuple[StepPatch, StepPatch] | None
) -> Write:
    """The INSERT of a ``Pending`` (or, for an effect completion, ``Waiting``) step, as a
    write of the caller's batch (``services.db_batch``); a duplicate invocation is a
    conflicting advance (``ConflictError``). ``claimed`` (the fused claim's step patch and
    its ``Running`` patch, decided on the row this insert makes): insert it as those
    patches leave it — claimed, leased, ``Running``, version 1
    (:func:`apply_commit_continued`)."""
    return Write(
        _INSERT_STEP, _step_values(org_id, s, now, claimed), on_duplicate=lambda: _step_exists(s)
    )


def attempt_insert(org_id: str, a: NewAttempt) -> Write:
    """The INSERT of a ``Started`` attempt, as a write of the caller's batch
    (``services.db_batch``); a duplicate ``(org, step, number)`` is a lost race
    (``FenceLostError``)."""
    return Write(
        _INSERT_ATTEMPT, _attempt_values(org_id, a), on_duplicate=lambda: _attempt_exists(a)
    )


def claimed_run_values(
    values: Mapping[str, Any], patch: RunPatch, step_state: StepState | None, now: datetime
) -> dict[str, Any]:
    """The ``flow_runs`` INSERT ``values`` of a run being created, with a claim's root
    ``patch`` (decided on the row those values make) already applied — what
    :func:`_run_write` would leave after inserting ``values``: the patch's values, its
    target state, the compatibility projection with ``step_state``, ``updated_at``, one
    version step (``docs/adr/0005``, round 7). Every predicate the UPDATE would have
    carried is checked here against the values instead; they could only compare the
    row this very INSERT makes.

    Raises:
        InvariantError: the patch does not start from the row ``values`` make.
    """
    holds = (
        values["state_version"] == patch.expected_version,
        values["runtime_state"] == patch.from_state.code,
        values["execution_owner"] == _V2,
        values["ownership_epoch"] == patch.expect_epoch,
        patch.expect_current_step is None
        or values["current_step_execution_id"] == patch.expect_current_step,
        not patch.require_live
        or (not values["is_deleted"] and values.get("delete_requested_at") is None),
        values.get("operator_paused_at") is None,  # a created run is never paused
    )
    if not all(holds):
        raise InvariantError("the claim's root patch does not start from the inserted root")
    out = dict(values)
    out.update(_coded(patch_changes(patch)))
    out.update(
        runtime_state=patch.to_state.code,
        interview_status=compatibility_status(patch.to_state, step_state).code,
        state_version=patch.expected_version + 1,
        updated_at=now,
    )
    return out


#: The heartbeat's UPDATE under the full fence, built once (no version bump); its bind
#: names are not column names (SQLAlchemy reserves those in an UPDATE).
_EXTEND_LEASE = (
    update(flow_step_executions)
    .where(
        flow_step_executions.c.org_id == bindparam("b_org"),
        flow_step_executions.c.step_execution_id == bindparam("b_step"),
        flow_step_executions.c.state_version == bindparam("b_version"),
        flow_step_executions.c.state == bindparam("b_state"),
        flow_step_executions.c.ownership_epoch == bindparam("b_epoch"),
        flow_step_executions.c.lease_token == bindparam("b_token"),
    )
    .values(lease_until=bindparam("b_until"))
)


async def extend_lease_row(
    conn: AsyncConnection, org_id: str, step: StepRecord, token_digest: str, until: datetime
) -> None:
    """Heartbeat: move ``lease_until`` under the full fence *without* a version bump, so
    a concurrent final commit keeps its fence (§12.3). Row count must be 1."""
    params = {
        "b_org": org_id,
        "b_step": step.step_execution_id,
        "b_version": step.state_version,
        "b_state": step.state.code,
        "b_epoch": step.ownership_epoch,
        "b_token": token_digest,
        "b_until": until,
    }
    if (await conn.execute(_EXTEND_LEASE, params)).rowcount != 1:
        raise fence_lost(STEPS, step.step_execution_id, step.state_version, None, "heartbeat")


# --- inserts -----------------------------------------------------------------------------


def _attempt_exists(a: NewAttempt) -> FenceLostError:
    return fence_lost(ATTEMPTS, a.attempt_id, 0, None, "attempt_exists")


def _attempt_values(org_id: str, a: NewAttempt) -> dict[str, Any]:
    return {
        "org_id": org_id,
        "attempt_id": a.attempt_id,
        "step_execution_id": a.step_execution_id,
        "attempt_number": a.attempt_number,
        "lease_token_digest": a.lease_token_digest,
        "ownership_epoch": a.ownership_epoch,
        "root_state_version_at_claim": a.root_state_version_at_claim,
        "started_at": a.started_at,
        "transaction_outcome": AttemptOutcome.STARTED.code,
        "retry_policy_digest": a.retry_policy_digest,
        "recovery_backoff_floor_ms": a.recovery_backoff_floor_ms,
        "attempt_state_version": 0,
        "plan_digest": a.plan_digest,
        "lock_plan_digest": a.lock_plan_digest,
        "trace_id": a.trace_id,
    }


def _step_exists(s: NewStep) -> ConflictError:
    return ConflictError("this step invocation already exists", entity=STEPS, key=s.plan_step_key)


def _step_values(
    org_id: str, s: NewStep, now: datetime, claimed: tuple[StepPatch, StepPatch] | None
) -> dict[str, Any]:
    values: dict[str, Any] = {
        "org_id": org_id,
        "step_execution_id": s.step_execution_id,
        "flow_run_id": s.flow_run_id,
        "plan_step_key": s.plan_step_key,
        "invocation_ordinal": s.invocation_ordinal,
        "step_kind": s.step_kind,
        "state": s.state.code,
        "input_checkpoint_id": s.input_checkpoint_id,
        "state_version": 0,
        "attempt_count": 0,
        "ownership_epoch": s.ownership_epoch,
        "run_after": s.run_after,
        "queue_class": s.queue_class,
        "created_at": now,
        "updated_at": now,
    }
    if claimed is not None:
        claim, running = claimed
        if (
            claim.step_execution_id != s.step_execution_id
            or claim.expected_version != 0
            or claim.from_state is not s.state
            or running.from_state is not claim.to_state
        ):
            raise InvariantError("the claim patches do not start from the inserted step")
        changes = patch_changes(claim)
        changes.update(patch_changes(running))
        if "lease_token_digest" in changes:
            changes["lease_token"] = changes.pop("lease_token_digest")
        values.update(_coded(changes))
        values.update(state=running.to_state.code, state_version=1)
    return values


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A validated checkpoint, serialized and digested, ready to insert."""

    context_json: str = field(repr=False)
    plan_cursor_json: str
    read_verification_json: str | None
    context_digest: str
    context_schema_version: int


def prepare_checkpoint(checkpoint: CheckpointInput, *, max_bytes: int) -> PreparedCheckpoint:
    """Validate (size bound, no credential material) and serialize a checkpoint — before
    any SQL of the transition that publishes it.

    Raises:
        InvalidArgumentError: too large, not JSON, or credential material.
    """
    try:
        context = validate_checkpoint_payload(checkpoint.context, max_bytes=max_bytes)
    except InvalidArgumentError as exc:
        metrics().checkpoint_rejected(exc.reason)
        raise
    cursor = validate_checkpoint_payload(
        checkpoint.plan_cursor, max_bytes=MAX_PLAN_CURSOR_BYTES, field="plan_cursor"
    )
    verification = (
        None
        if checkpoint.read_verification_set is None
        else validate_checkpoint_payload(
            checkpoint.read_verification_set,
            max_bytes=MAX_SUMMARY_BYTES,
            field="read_verification_set",
        ).decode()
    )
    return PreparedCheckpoint(
        context_json=context.decode(),
        plan_cursor_json=cursor.decode(),
        read_verification_json=verification,
        # ``versioned_digest("flow-context", context)`` is the digest of exactly these
        # canonical bytes (``validate_checkpoint_payload`` returns ``canonical_json``):
        # digested as they are rather than serialized a second time.
        context_digest=digest_bytes("flow-context", context),
        context_schema_version=checkpoint.context_schema_version,
    )


_MAX_SEQUENCE = select(func.max(flow_checkpoints.c.sequence)).where(
    flow_checkpoints.c.org_id == bindparam("org"),
    flow_checkpoints.c.flow_run_id == bindparam("run"),
)


async def last_checkpoint_sequence(conn: AsyncConnection, org_id: str, flow_run_id: str) -> int:
    """The run's latest checkpoint sequence (0: none). The caller holds the root lock,
    which is what makes ``+ 1`` the next free sequence (:func:`checkpoint_insert`)."""
    last = (await conn.execute(_MAX_SEQUENCE, {"org": org_id, "run": flow_run_id})).scalar_one()
    return int(last or 0)


def checkpoint_written(checkpoint: PreparedCheckpoint) -> None:
    """Count a checkpoint once its :func:`checkpoint_insert` write went through."""
    metrics().checkpoint_written(len(checkpoint.context_json.encode("utf-8")))


def checkpoint_insert(
    org_id: str,
    flow_run_id: str,
    checkpoint: PreparedCheckpoint,
    *,
    checkpoint_id: str,
    created_by_attempt_id: str | None,
    now: datetime,
    last_sequence: int,
) -> tuple[Write, CheckpointMeta]:
    """The INSERT of an immutable checkpoint at the run's next sequence, as a write of the
    caller's batch (``services.db_batch``), and the checkpoint it makes. The caller holds
    the root lock and read ``last_sequence`` under it (:func:`last_checkpoint_sequence`),
    or knows it (a run it just created: 0; a continued step: ADR 0002) — which is what
    makes ``last_sequence + 1`` safe; a duplicate sequence would mean a writer without
    that lock and raises ``ConflictError``. The caller counts it once written
    (:func:`checkpoint_written`)."""
    last = last_sequence
    meta = CheckpointMeta(
        checkpoint_id=checkpoint_id,
        flow_run_id=flow_run_id,
        sequence=int(last or 0) + 1,
        context_schema_version=checkpoint.context_schema_version,
        context_digest=checkpoint.context_digest,
        created_by_attempt_id=created_by_attempt_id,
        created_at=now,
    )
    values = {
        "org_id": org_id,
        "checkpoint_id": checkpoint_id,
        "flow_run_id": flow_run_id,
        "sequence": meta.sequence,
        "plan_cursor": checkpoint.plan_cursor_json,
        "context_schema_version": meta.context_schema_version,
        "context_payload": checkpoint.context_json,
        "context_digest": meta.context_digest,
        "read_verification_set": checkpoint.read_verification_json,
        "created_by_attempt_id": created_by_attempt_id,
        "created_at": now,
    }

    def taken() -> ConflictError:
        return ConflictError("checkpoint sequence taken", entity=RUNS, key=flow_run_id)

    return Write(_INSERT_CHECKPOINT, values, on_duplicate=taken), meta
