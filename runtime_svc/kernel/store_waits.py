"""Wait transitions of the kernel (§14.2 step 6, §14.3, §11.1): the only writer of
dependency and signal *state*, and of the root/step rows those transitions move.

Every transition discovers its candidate without locks, then enters the lifecycle
sub-order of §12 at the root: root → waiting step → (attempt) → dependency → signal
(``SELECT … FOR UPDATE`` orders the locks; the fence is each conditional UPDATE's row
count). It never locks a dependency or signal and then waits for the root. A lost
compare-and-swap means a concurrent transition won: the whole transaction rolls back and
the caller gets ``NoChange("lost_race")`` to re-read.

Insertion helpers (``insert_dependency_txn``, ``insert_signal_txn``) run inside the
caller's transaction: the worker's wait commit, the record engine's record transaction,
the signal API's acceptance transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol, TypeVar

from sqlalchemy import ColumnElement, Table, bindparam, func, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.kernel.applied import applied_run, applied_step, projected_step_state
from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.model import LeaseFence, RunRecord, StepRecord
from runtime_svc.kernel.states import RunState, StepState
from runtime_svc.kernel.store_reads import Candidate
from runtime_svc.kernel.store_rows import (
    apply_transition,
    execute_deferred,
    held_transition_writes,
    lock_run_and_step,
)
from runtime_svc.kernel.transitions_waits import (
    CAUSE_WAIT_EXPIRED,
    WaitTransition,
    cancel_dependency,
    decide_expiry,
    decide_repair,
    decide_resolution,
)
from runtime_svc.kernel.wait_model import (
    DependencyPatch,
    DependencyRecord,
    DependencyState,
    ExpiryPolicyCode,
    FaultSuccessor,
    NewDependency,
    NewSignal,
    SignalPatch,
    SignalRecord,
    SignalState,
    WorkScopeKey,
)
from runtime_svc.observability.hooks import signal_trace_context
from runtime_svc.schema import flow_dependencies, flow_step_executions, flow_wake_signals
from services.db import (
    FencedWrite,
    fenced_updates,
    insert_if_absent,
    insert_statement,
    run_in_transaction,
    scoped_select,
)
from services.db_batch import Write, execute_writes, fenced_write, insert_if_absent_write
from services.errors import ConflictError, FenceLostError

__all__ = [
    "FaultStep",
    "HeldRun",
    "WaitStore",
    "WokenClaim",
    "apply_wait_transition",
    "bound_scope_predicates",
    "cancel_step_dependencies_txn",
    "dependency_from_row",
    "dependency_insert",
    "effect_dependency_of_step_txn",
    "fault_successor_txn",
    "insert_dependency_txn",
    "insert_signal_txn",
    "lock_dependency",
    "lock_signal",
    "lock_waiting_txn",
    "new_dependency_id",
    "read_dependency_txn",
    "resumed_candidate",
    "scope_params",
    "scope_predicates",
    "signal_from_row",
    "signal_insert",
    "signal_values",
]

T = TypeVar("T")
Clock = Callable[[AsyncConnection], Awaitable[datetime]]
_DEPS = "flow_dependencies"


def _scope(r: RowMapping) -> WorkScopeKey:
    return WorkScopeKey(
        r["org_id"],
        r["app_installation_id"],
        r["runtime_capability_id"],
        r["runtime_work_binding_digest"],
    )


def dependency_from_row(r: RowMapping) -> DependencyRecord:
    """Decode one ``flow_dependencies`` row."""
    return DependencyRecord(
        scope=_scope(r),
        dependency_id=r["dependency_id"],
        flow_run_id=r["flow_run_id"],
        step_execution_id=r["step_execution_id"],
        producer_kind=r["producer_kind"],
        producer_key=r["producer_key"],
        condition_digest=r["condition_digest"],
        state=DependencyState.from_code(r["state"]),
        state_version=r["state_version"],
        wake_version=r["wake_version"],
        wake_token=r["wake_token"],
        deadline=r["deadline"],
        next_probe_at=r["next_probe_at"],
        expiry_policy=ExpiryPolicyCode.from_code(r["expiry_policy"]),
        resolved_at=r["resolved_at"],
        resolution_receipt=r["resolution_receipt"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        reconciliation_attempts=r["reconciliation_attempts"],
        wake_signal_id=r["wake_signal_id"],
    )


def signal_from_row(r: RowMapping) -> SignalRecord:
    """Decode one ``flow_wake_signals`` row."""
    return SignalRecord(
        scope=_scope(r),
        wake_signal_id=r["wake_signal_id"],
        producer_kind=r["producer_kind"],
        producer_key=r["producer_key"],
        wake_token=r["wake_token"],
        wake_version=r["wake_version"],
        evidence_digest=r["evidence_digest"],
        evidence_reference=r["evidence_reference"],
        evidence_json=r["evidence_json"],
        received_at=r["received_at"],
        expires_at=r["expires_at"],
        state=SignalState.from_code(r["resolution_state"]),
        dependency_id=r["dependency_id"],
        state_version=r["state_version"],
        next_match_at=r["next_match_at"],
        consumed_at=r["consumed_at"],
        trace_context=r.get("trace_context"),
    )


#: Bound-parameter names of the four work-scope columns (:func:`scope_params`).
_SCOPE_PARAMS = ("scope_org", "scope_inst", "scope_cap", "scope_digest")


def bound_scope_predicates(table: Table) -> list[ColumnElement[bool]]:
    """The four work-scope equalities of ``table`` over bound parameters, for statements
    built once at import and executed with :func:`scope_params` (the wake path's reads:
    no per-call statement construction or cache-key generation)."""
    c = table.c
    org, inst, cap, digest = _SCOPE_PARAMS
    return [
        c.org_id == bindparam(org),
        c.app_installation_id == bindparam(inst),
        c.runtime_capability_id == bindparam(cap),
        c.runtime_work_binding_digest == bindparam(digest),
    ]


def scope_params(scope: WorkScopeKey) -> dict[str, str]:
    """The parameters of :func:`bound_scope_predicates`."""
    return dict(
        zip(
            _SCOPE_PARAMS,
            (
                scope.org_id,
                scope.app_installation_id,
                scope.runtime_capability_id,
                scope.runtime_work_binding_digest,
            ),
            strict=True,
        )
    )


def scope_predicates(table: Table, scope: WorkScopeKey) -> list[ColumnElement[bool]]:
    """The four work-scope equalities of ``table`` (every match uses all four, §10.0)."""
    c = table.c
    return [
        c.org_id == scope.org_id,
        c.app_installation_id == scope.app_installation_id,
        c.runtime_capability_id == scope.runtime_capability_id,
        c.runtime_work_binding_digest == scope.runtime_work_binding_digest,
    ]


# --- reads and locks ------------------------------------------------------------------------


async def read_dependency_txn(
    conn: AsyncConnection, org_id: str, dependency_id: str
) -> DependencyRecord | None:
    """The dependency ``(org_id, dependency_id)``, without a lock (discovery)."""
    params = {"org_id": org_id, "dependency_id": dependency_id}
    row = (await conn.execute(_READ_DEPENDENCY, params)).mappings().first()
    return None if row is None else dependency_from_row(row)


# Built once at import and executed with bound parameters (no per-call construction).
_READ_DEPENDENCY = scoped_select(flow_dependencies, ("dependency_id",))
_LOCK_STEP_DEPENDENCIES = (
    select(flow_dependencies)
    .where(
        flow_dependencies.c.org_id == bindparam("org"),
        flow_dependencies.c.step_execution_id == bindparam("step"),
    )
    .order_by(flow_dependencies.c.dependency_id)
    .with_for_update()
)
_LOCK_DEPENDENCY = scoped_select(flow_dependencies, ("dependency_id",), for_update=True)
_LOCK_SIGNAL = (
    select(flow_wake_signals)
    .where(
        *bound_scope_predicates(flow_wake_signals),
        flow_wake_signals.c.wake_signal_id == bindparam("key"),
    )
    .with_for_update()
)


async def lock_dependency(
    conn: AsyncConnection, org_id: str, dependency_id: str
) -> DependencyRecord | None:
    """Lock and read one dependency (after its root and step)."""
    params = {"org_id": org_id, "dependency_id": dependency_id}
    row = (await conn.execute(_LOCK_DEPENDENCY, params)).mappings().first()
    return None if row is None else dependency_from_row(row)


@dataclass(frozen=True)
class HeldRun:
    """The root and waiting step of a dependency, locked (root → step) by the caller's
    transaction before it reads the producer's evidence: a resolution in that same
    transaction continues the lifecycle order at the dependency instead of reading the
    dependency again and re-locking root and step (:meth:`WaitStore.resolve_in`)."""

    root: RunRecord
    step: StepRecord | None
    #: The dependency and its candidate signals as the caller's transaction read them
    #: *without* a lock (its discovery and evidence reads). A resolution decided on them
    #: does not lock and re-read them: the dependency's and the signal's conditional
    #: UPDATEs (expected ``state_version`` and from-state) are their fence and take their
    #: row locks in the same root → step → dependency → signal order; a row that moved
    #: since the read fails its compare-and-swap (``FenceLostError``: the caller rolls
    #: back and re-runs the match on the locking path). ``None`` / empty: lock and read.
    dependency: DependencyRecord | None = None
    signals: tuple[SignalRecord, ...] = ()

    def seen_signal(self, wake_signal_id: str) -> SignalRecord | None:
        """The unlocked snapshot of ``wake_signal_id`` the caller read, if any."""
        return next((s for s in self.signals if s.wake_signal_id == wake_signal_id), None)


async def lock_waiting_txn(conn: AsyncConnection, dep: DependencyRecord) -> HeldRun | None:
    """Lock ``dep``'s root, then its waiting step (the first two locks of every wait
    transition) with one statement that also reads the database clock and keeps it as
    the transaction's ``db_now`` (:func:`lock_run_and_step`, ADR 0006): the resolution's
    clock needs no statement of its own. ``None`` when the root is gone."""
    root, step = await lock_run_and_step(conn, dep.org_id, dep.flow_run_id, dep.step_execution_id)
    if root is None:
        return None
    return HeldRun(root, step)


async def lock_signal(
    conn: AsyncConnection, scope: WorkScopeKey, wake_signal_id: str
) -> SignalRecord | None:
    """Lock and read one signal of ``scope`` (last in the lifecycle sub-order)."""
    params = {**scope_params(scope), "key": wake_signal_id}
    row = (await conn.execute(_LOCK_SIGNAL, params)).mappings().first()
    return None if row is None else signal_from_row(row)


# --- inserts (in the caller's transaction) ---------------------------------------------------


def new_dependency_id() -> str:
    return f"dep_{uuid.uuid4().hex}"


async def insert_dependency_txn(
    conn: AsyncConnection, scope: WorkScopeKey, dep: NewDependency, now: datetime
) -> None:
    """Insert a ``Pending`` dependency in the wait transaction (§14.2 step 3).

    Raises:
        ConflictError: the step already has an active dependency in this scope (at most
            one per (work scope, waiting step), §10.5).
    """
    await execute_writes(conn, [dependency_insert(scope, dep, now)])


def dependency_insert(scope: WorkScopeKey, dep: NewDependency, now: datetime) -> Write:
    """:func:`insert_dependency_txn` as a write of a batch (``services.db_batch``): its
    duplicate raises the same :class:`ConflictError`."""
    values = {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "runtime_work_binding_digest": scope.runtime_work_binding_digest,
        "dependency_id": dep.dependency_id,
        "flow_run_id": dep.flow_run_id,
        "step_execution_id": dep.step_execution_id,
        "producer_kind": dep.producer_kind,
        "producer_key": dep.producer_key,
        "condition_digest": dep.condition_digest,
        "state": DependencyState.PENDING.code,
        "active_slot": 1,
        "state_version": 0,
        "wake_version": dep.wake_version,
        "wake_token": None,
        "deadline": dep.deadline,
        "next_probe_at": dep.next_probe_at,
        "expiry_policy": dep.expiry_policy.code,
        "resolved_at": None,
        "resolution_receipt": None,
        "created_at": now,
        "updated_at": now,
        "reconciliation_attempts": 0,
        "wake_signal_id": None,
    }

    def exists() -> ConflictError:
        return ConflictError(
            "the step already has an active dependency", entity=_DEPS, key=dep.step_execution_id
        )

    return Write(insert_statement(flow_dependencies), values, on_duplicate=exists)


async def insert_signal_txn(
    conn: AsyncConnection,
    scope: WorkScopeKey,
    signal: NewSignal,
    now: datetime,
    *,
    expires_at: datetime,
    match_at: datetime | None,
) -> bool:
    """Insert an ``Unmatched`` signal; ``False`` when its (scope, kind, key, token)
    exists already (the caller reads the existing one back and compares).

    ``match_at`` marks the producer-side match as owed (§14.2 step 2): the producer clears
    it after its fresh match; a crash in between leaves it for the repair sweep.
    """
    values = signal_values(scope, signal, now, expires_at=expires_at, match_at=match_at)
    return await insert_if_absent(conn, flow_wake_signals, values)


def signal_insert(
    scope: WorkScopeKey,
    signal: NewSignal,
    now: datetime,
    *,
    expires_at: datetime,
    match_at: datetime | None,
) -> Write:
    """:func:`insert_signal_txn` as the insert-if-absent write of a batch
    (``services.db_batch.execute_writes_if_absent``: ``False`` when the signal's
    ``(scope, kind, key, token)`` exists already)."""
    values = signal_values(scope, signal, now, expires_at=expires_at, match_at=match_at)
    return insert_if_absent_write(flow_wake_signals, values)


def signal_values(
    scope: WorkScopeKey,
    signal: NewSignal,
    now: datetime,
    *,
    expires_at: datetime,
    match_at: datetime | None,
) -> dict[str, Any]:
    """The row :func:`insert_signal_txn` inserts."""
    return {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "runtime_work_binding_digest": scope.runtime_work_binding_digest,
        "wake_signal_id": signal.wake_signal_id,
        "producer_kind": signal.producer_kind,
        "producer_key": signal.producer_key,
        "wake_token": signal.wake_token,
        "wake_version": signal.wake_version,
        "evidence_digest": signal.evidence_digest,
        "evidence_reference": signal.evidence_reference,
        "evidence_json": signal.evidence_json,
        "received_at": now,
        "expires_at": expires_at,
        "resolution_state": SignalState.UNMATCHED.code,
        "dependency_id": None,
        "state_version": 0,
        "next_match_at": match_at,
        "consumed_at": None,
        # The producer's span (SubmitWakeSignal, or the step whose write signalled).
        "trace_context": signal_trace_context(),
    }


# --- applying a wait transition ---------------------------------------------------------------


def _dependency_write(org_id: str, patch: DependencyPatch) -> FencedWrite:
    values = dict(patch.values)
    values["state"] = patch.to_state.code
    return FencedWrite(
        flow_dependencies,
        org_id=org_id,
        key={"dependency_id": patch.dependency_id},
        expected_version=patch.expected_version,
        values=values,
        equal={"state": patch.from_state.code},
    )


async def _apply_dependency(conn: AsyncConnection, org_id: str, patch: DependencyPatch) -> None:
    await fenced_updates(conn, [_dependency_write(org_id, patch)])


def _signal_write(patch: SignalPatch) -> FencedWrite:
    values = dict(patch.values)
    values["resolution_state"] = patch.to_state.code
    s = patch.scope
    return FencedWrite(
        flow_wake_signals,
        org_id=s.org_id,
        key={
            "app_installation_id": s.app_installation_id,
            "runtime_capability_id": s.runtime_capability_id,
            "runtime_work_binding_digest": s.runtime_work_binding_digest,
            "wake_signal_id": patch.wake_signal_id,
        },
        expected_version=patch.expected_version,
        values=values,
        equal={"resolution_state": patch.from_state.code},
    )


async def apply_wait_transition(
    conn: AsyncConnection,
    org_id: str,
    wt: WaitTransition,
    now: datetime,
    *,
    defer_signal: bool = False,
    defer_transition: bool = False,
) -> tuple[list[Write], Write | None]:
    """Apply ``wt`` in §12 order: root, step (+ successor), dependency, signal.

    Every caller holds the root's and the step's locks (its lock phase read them ``FOR
    UPDATE``: ``lock_run_and_step``, ``lock_waiting_txn``, ``lock_run`` + ``lock_step``),
    so unless the transition also patches an attempt, root and step are written together
    and the dependency's conditional UPDATE goes last in the same round trip
    (``apply_transition(last=…)``, ADR 0010: a lost dependency fence stops the
    transaction where the statements one by one would). The signal's UPDATE, which may
    take the signal's lock, stays after that check.

    Returns ``(first, last)``, the writes left to the caller (empty / ``None`` unless
    deferred), which it must execute exactly once, in that order, in this transaction:

    * ``defer_signal``: the signal's UPDATE is not executed but returned as ``last``, for
      the caller to send as the last write of its next round trip (the pre-claimed wake's
      claim: ``WokenClaim.claim_txn(last=…)``);
    * ``defer_transition`` (with ``defer_signal``): the root/step UPDATE and the
      dependency's UPDATE are not executed either but returned as ``first``, for the
      claim's round trip to begin with (``WokenClaim.claim_txn(first=…)``; ADR 0010's
      addendum, round 17) — when the transition has that shape (no attempt patched, no
      row inserted); otherwise they are executed here as without it.

    Raises:
        FenceLostError: any compare-and-swap matched no row (roll back, re-read).
    """
    dependency = None if wt.dependency is None else _dependency_write(org_id, wt.dependency)
    first: list[Write] = []
    t = wt.transition
    if t.attempt is None:
        last = None if dependency is None else fenced_write(conn, dependency)
        held = (
            held_transition_writes(conn, org_id, t, now, last=last)
            if defer_transition and defer_signal
            else None
        )
        if held is None:
            await apply_transition(conn, org_id, t, now, rows_locked=True, last=last)
        else:
            first = held
    else:
        await apply_transition(conn, org_id, t, now)
        if dependency is not None:
            await fenced_updates(conn, [dependency])
    if wt.signal is None:
        return first, None
    signal = _signal_write(wt.signal)
    if defer_signal:
        return first, fenced_write(conn, signal)
    await fenced_updates(conn, [signal])
    return first, None


async def _lock_step_dependencies(
    conn: AsyncConnection, org_id: str, step: StepRecord
) -> list[DependencyRecord]:
    params = {"org": org_id, "step": step.step_execution_id}
    rows = (await conn.execute(_LOCK_STEP_DEPENDENCIES, params)).mappings().all()
    return [dependency_from_row(r) for r in rows]


async def cancel_step_dependencies_txn(
    conn: AsyncConnection, org_id: str, step: StepRecord, now: datetime
) -> int:
    """Inside a root cancellation that already locked root, step and attempt: lock the
    step's dependencies (stable id order) and cancel the pending one (§11.1, §14.3).

    An effect-completion dependency is left ``Pending``: its handoff takes the
    cancellation disposition of §10.1 (cancelled only after the owner's durable
    ``Rejected`` receipt; an accepted one keeps tracking the owner outcome), applied by
    ``runtime_svc.effects`` root-first.
    """
    cancelled = 0
    for dep in await _lock_step_dependencies(conn, org_id, step):
        if dep.producer_kind == EFFECT_COMPLETION_PRODUCER:
            continue
        patch = cancel_dependency(dep, now)
        if patch is not None:
            await _apply_dependency(conn, org_id, patch)
            cancelled += 1
    return cancelled


async def effect_dependency_of_step_txn(
    conn: AsyncConnection, org_id: str, step: StepRecord
) -> DependencyRecord | None:
    """Inside a root-first transaction that locked root, step (and attempt): lock the
    step's effect-completion dependency, if it has one (the pending one first)."""
    deps = [
        d
        for d in await _lock_step_dependencies(conn, org_id, step)
        if d.producer_kind == EFFECT_COMPLETION_PRODUCER
    ]
    deps.sort(key=lambda d: d.state is not DependencyState.PENDING)
    return deps[0] if deps else None


async def _next_ordinal_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, plan_step_key: str
) -> int:
    # Under the root lock: the next invocation ordinal of a plan step in this run.
    s = flow_step_executions.c
    last = (
        await conn.execute(
            select(func.max(s.invocation_ordinal)).where(
                s.org_id == org_id, s.flow_run_id == flow_run_id, s.plan_step_key == plan_step_key
            )
        )
    ).scalar_one()
    return 0 if last is None else int(last) + 1


async def fault_successor_txn(
    conn: AsyncConnection, root: RunRecord, fault: FaultStep | None
) -> FaultSuccessor | None:
    """Under the root lock: the new successor step of a fault-path transition (its next
    invocation ordinal in this run), or ``None`` without a compiled fault step."""
    if fault is None:
        return None
    ordinal = await _next_ordinal_txn(conn, root.org_id, root.flow_run_id, fault.plan_step_key)
    return FaultSuccessor(
        f"step_{uuid.uuid4().hex}",
        fault.plan_step_key,
        fault.step_kind,
        fault.queue_class,
        ordinal,
    )


@dataclass(frozen=True)
class FaultStep:
    """The compiled fault-path successor of a waiting step (from its immutable plan)."""

    plan_step_key: str
    step_kind: str
    queue_class: str


#: Finds the fault-path successor of a dependency's waiting step (a plan lookup, made
#: outside the transaction: plans are immutable).
FaultLookup = Callable[[RunRecord, DependencyRecord], Awaitable[FaultStep | None]]


def resumed_candidate(root: RunRecord, step: StepRecord, now: datetime) -> Candidate:
    """The claim candidate a committed resolution left: its waiting step ``Pending`` and
    its root ``Runnable``, each one version past the locked rows (``cas_update`` bumps a
    version by exactly one), due at ``now``. A hint only: the claim compares both
    versions under its own locks, so a candidate something else moved claims nothing."""
    return Candidate(
        org_id=root.org_id,
        flow_run_id=root.flow_run_id,
        step_execution_id=step.step_execution_id,
        root_state_version=root.state_version + 1,
        step_state_version=step.state_version + 1,
        run_after=now,
        queue_class=step.queue_class,
        plan_id=root.plan_id,
        trace_context=root.trace_context,
        execution_profile=root.execution_profile,
        step_kind=step.step_kind,
    )


class WokenClaim(Protocol):
    """The pre-claimed wake's hook (``docs/adr/0007-pre-claimed-wake.md``), asked by a
    resolution inside its transaction after its own writes, still holding the root and
    step locks."""

    async def claim_txn(
        self,
        conn: AsyncConnection,
        root: RunRecord,
        step: StepRecord,
        now: datetime,
        *,
        first: Sequence[Write] = (),
        last: Write | None = None,
    ) -> LeaseFence | None:
        """Claim the woken ``step`` of ``root`` (both as the resolution left them) for a
        local worker and make it ``Running`` in ``conn``; ``None`` writes nothing of a
        claim (no local worker with room, admission or the claim decision refused).

        ``first``: the resolution's own root/step and dependency UPDATEs (not executed
        yet: ``root`` and ``step`` are the rows they leave); ``last``: its signal UPDATE.
        Both are executed exactly once either way — around the claim's writes in one
        round trip, or alone in one (ADR 0010's addenda)."""
        ...

    def rolled_back(self) -> None:
        """The transaction attempt that asked is being retried (or did not commit):
        whatever it reserved is given back."""
        ...


def _woken_rows(
    root: RunRecord, step: StepRecord, wt: WaitTransition, now: datetime
) -> tuple[RunRecord, StepRecord] | None:
    """Root and step as a resolution ``wt`` left them (derived in memory, like the
    continuation's, ADR 0002) when it resumed ``step`` (root ``Runnable`` on it, step
    ``Pending``); ``None`` for any other shape (a fault path's new step, an end)."""
    t = wt.transition
    if (
        t.run is None
        or t.step is None
        or t.new_step is not None
        or t.run.to_state is not RunState.RUNNABLE
        or t.step.to_state is not StepState.PENDING
        or t.step.step_execution_id != step.step_execution_id
    ):
        return None
    return (
        applied_run(root, t.run, projected_step_state(t), now),
        applied_step(step, t.step, now),
    )


class WaitStore:
    """Root-first wait transitions, one short transaction each.

    Args:
        engine: the runtime database.
        clock: the durable clock (the run store's; tests shift it).
    """

    def __init__(self, engine: AsyncEngine, clock: Clock) -> None:
        self._engine = engine
        self._clock = clock

    async def _run(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        return await run_in_transaction(self._engine, fn)

    async def _locked(
        self, conn: AsyncConnection, org_id: str, dependency_id: str, held: HeldRun | None = None
    ) -> tuple[RunRecord, StepRecord | None, DependencyRecord] | None:
        """Discover the dependency without a lock, then lock root → step → dependency
        (``held``: root and step are locked already; only the dependency is — or, when
        ``held`` carries the caller's unlocked read of it, not even that: its
        conditional UPDATE fences it, see :class:`HeldRun`)."""
        if held is not None:
            seen = held.dependency
            if seen is not None and seen.dependency_id == dependency_id:
                dep: DependencyRecord | None = seen
            else:
                dep = await lock_dependency(conn, org_id, dependency_id)
            if dep is None or dep.flow_run_id != held.root.flow_run_id:
                return None
            return held.root, held.step, dep
        found = await read_dependency_txn(conn, org_id, dependency_id)
        if found is None:
            return None
        root, step = await lock_run_and_step(
            conn, org_id, found.flow_run_id, found.step_execution_id
        )
        if root is None:
            return None
        dep = await lock_dependency(conn, org_id, dependency_id)
        if dep is None:
            return None
        return root, step, dep

    async def _guarded(
        self, fn: Callable[[AsyncConnection], Awaitable[WaitTransition | NoChange]]
    ) -> WaitTransition | NoChange:
        try:
            return await self._run(fn)
        except FenceLostError:  # a concurrent transition moved a row first: re-read
            return NoChange("lost_race")

    async def resolve(
        self,
        org_id: str,
        dependency_id: str,
        *,
        receipt: dict[str, Any],
        signal_id: str | None = None,
        wake_version: int | None = None,
        expected_version: int | None = None,
        check: Callable[[DependencyRecord, SignalRecord | None], bool] | None = None,
        claim: WokenClaim | None = None,
    ) -> WaitTransition | NoChange:
        """§14.2 step 6 in one transaction: lock root, waiting step, dependency, signal;
        consume the signal once, step ``Pending``, root ``Runnable``, every version +1.

        ``check`` re-validates the satisfaction rule on the locked rows (``False``:
        ``NoChange("condition_false")``); ``expected_version`` is the dependency version
        the caller's discovery saw. ``claim``: the pre-claimed wake (see
        :meth:`resolve_in`); told :meth:`WokenClaim.rolled_back` before a retried
        attempt.
        """

        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            if claim is not None:
                claim.rolled_back()  # a previous attempt of this transaction, if any
            return await self.resolve_in(
                conn,
                org_id,
                dependency_id,
                receipt=receipt,
                signal_id=signal_id,
                wake_version=wake_version,
                expected_version=expected_version,
                check=check,
                claim=claim,
            )

        return await self._guarded(fn)

    async def resolve_in(
        self,
        conn: AsyncConnection,
        org_id: str,
        dependency_id: str,
        *,
        receipt: dict[str, Any],
        signal_id: str | None = None,
        wake_version: int | None = None,
        expected_version: int | None = None,
        check: Callable[[DependencyRecord, SignalRecord | None], bool] | None = None,
        held: HeldRun | None = None,
        claim: WokenClaim | None = None,
    ) -> WaitTransition | NoChange:
        """:meth:`resolve` inside the caller's transaction (the producer-side match reads
        its evidence and resolves in one transaction). The caller commits; the locks are
        taken in the same root → step → dependency → signal order — ``held`` when the
        caller's transaction already took root and step (:func:`lock_waiting_txn`); when
        ``held`` also carries the caller's unlocked reads of the dependency and signal,
        those are not read again and their conditional UPDATEs take their locks.

        ``claim`` (the pre-claimed wake, ``docs/adr/0007-pre-claimed-wake.md``): after
        the resolution's own writes, still holding root and step, the resumed step is
        offered to ``claim`` with root and step as the resolution left them; a claim it
        writes (root ``Running``, step ``Running``, new attempt — rows this transaction
        holds or inserts) comes back as :attr:`WaitTransition.preclaimed`.

        Raises:
            FenceLostError: a conditional UPDATE found its row moved; the caller's
                transaction must roll back (:meth:`resolve` answers ``lost_race``).
        """
        now = await self._clock(conn)
        locked = await self._locked(conn, org_id, dependency_id, held)
        if locked is None:
            return NoChange("missing")
        root, step, dep = locked
        if expected_version is not None and dep.state_version != expected_version:
            return NoChange("superseded")
        signal = None
        if signal_id is not None:
            signal = None if held is None else held.seen_signal(signal_id)
            if signal is None:
                signal = await lock_signal(conn, dep.scope, signal_id)
            if signal is None:
                return NoChange("signal_missing")
        if check is not None and not check(dep, signal):
            return NoChange("condition_false")
        decision = decide_resolution(
            root, step, dep, signal, now, receipt=receipt, wake_version=wake_version
        )
        if isinstance(decision, WaitTransition):
            # With a claim to offer, the resolution's writes and the claim's share one
            # round trip: root/step and dependency UPDATEs first, then the claim's on the
            # rows they leave (held: root and step), the signal's UPDATE last (ADR 0010's
            # addenda) — two round trips less per pre-claimed wake than one each.
            woken = (
                None if claim is None or step is None else _woken_rows(root, step, decision, now)
            )
            first, signal_write = await apply_wait_transition(
                conn,
                org_id,
                decision,
                now,
                defer_signal=claim is not None,
                defer_transition=woken is not None,
            )
            if step is not None:
                fence = None
                if claim is not None and woken is not None:
                    fence = await claim.claim_txn(conn, *woken, now, first=first, last=signal_write)
                    first, signal_write = [], None  # executed by the claim, with it or alone
                decision = replace(
                    decision, resumed=resumed_candidate(root, step, now), preclaimed=fence
                )
            await execute_deferred(conn, first, signal_write)
        return decision

    async def _fault(
        self,
        conn: AsyncConnection,
        root: RunRecord,
        dep: DependencyRecord,
        lookup: FaultLookup | None,
    ) -> FaultSuccessor | None:
        if lookup is None or dep.expiry_policy is not ExpiryPolicyCode.FAULT_PATH:
            return None
        return await fault_successor_txn(conn, root, await lookup(root, dep))

    async def expire(
        self,
        org_id: str,
        dependency_id: str,
        *,
        cause: str = CAUSE_WAIT_EXPIRED,
        fault_lookup: FaultLookup | None = None,
        quarantine: bool = False,
    ) -> WaitTransition | NoChange:
        """§14.3 in one root-first transaction: the compiled expiry policy (fault path,
        terminal failure, quarantine), or quarantine for a missing producer."""

        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            now = await self._clock(conn)
            locked = await self._locked(conn, org_id, dependency_id)
            if locked is None:
                return NoChange("missing")
            root, step, dep = locked
            fault = await self._fault(conn, root, dep, fault_lookup)
            decision = decide_expiry(
                root, step, dep, now, cause=cause, fault=fault, quarantine=quarantine
            )
            if isinstance(decision, WaitTransition):
                await apply_wait_transition(conn, org_id, decision, now)
            return decision

        return await self._guarded(fn)

    async def repair(
        self, org_id: str, dependency_id: str, *, fault_lookup: FaultLookup | None = None
    ) -> WaitTransition | NoChange:
        """§14.3 repair: replay the root-first finalizer for a terminal dependency whose
        root is still ``Waiting`` on it (idempotent: a healthy pair is ``NoChange``)."""

        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            now = await self._clock(conn)
            locked = await self._locked(conn, org_id, dependency_id)
            if locked is None:
                return NoChange("missing")
            root, step, dep = locked
            fault = await self._fault(conn, root, dep, fault_lookup)
            decision = decide_repair(root, step, dep, now, fault=fault)
            if isinstance(decision, WaitTransition):
                await apply_wait_transition(conn, org_id, decision, now)
            return decision

        return await self._guarded(fn)
