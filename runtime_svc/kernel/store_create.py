"""Run creation for :class:`runtime_svc.kernel.store.FlowRunStateStore` (§10.1, §18.3):
root, first ``Pending`` step and immutable input checkpoint in one transaction,
idempotent on ``(org, idempotency_key)`` by insert-if-absent (STYLE 8): a duplicate key
is read back — the same request digest means the caller's own earlier request (return
that run), a different digest is a conflict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Select, and_, bindparam, select
from sqlalchemy.engine import Dialect, RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.applied import inserted_step, projected_step_state
from runtime_svc.kernel.model import (
    CheckpointInput,
    LeaseFence,
    NewStep,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
)
from runtime_svc.kernel.states import ExecutionOwner, RunState, StepState
from runtime_svc.kernel.store_codec import run_from_row
from runtime_svc.kernel.store_reads import get_run_txn
from runtime_svc.kernel.store_rows import (
    PreparedCheckpoint,
    attempt_insert,
    checkpoint_insert,
    checkpoint_written,
    claimed_run_values,
    new_id,
    new_run_id,
    prepare_checkpoint,
    step_insert,
)
from runtime_svc.kernel.tables import check_transition, compatibility_status
from runtime_svc.migration.protocol import require_v2_admission, require_v2_admission_txn
from runtime_svc.observability.hooks import run_trace_context
from runtime_svc.schema import execution_plans, flow_runs
from runtime_svc.schema_bridge import flow_deployment_control
from services.auth import TrustedRuntimeWorkScope
from services.db import db_now, now_column, remember_now
from services.db_batch import (
    Read,
    execute_reads,
    execute_writes_if_absent,
    insert_if_absent_write,
)
from services.digest import versioned_digest
from services.errors import ConflictError, NotFoundError
from services.invariants import InvariantError

__all__ = [
    "ClaimOnInsert",
    "ClaimedStart",
    "FirstStep",
    "InsertClaimed",
    "StartRunRequest",
    "StartRunResult",
    "create_run_txn",
    "inserted_run",
    "run_by_idempotency_key_txn",
]


def _flat_values(value: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` of a dataclass whose fields are all scalars (``str``,
    ``int``, ``None``): the same dict, without its recursive deep copy."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def _scope_values(scope: TrustedRuntimeWorkScope) -> dict[str, str]:
    """The work scope's four columns (``dataclasses.asdict(scope)``)."""
    return {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "runtime_work_binding_digest": scope.runtime_work_binding_digest,
    }


@dataclass(frozen=True)
class FirstStep:
    """The compiled entry step a new run starts with."""

    plan_step_key: str
    step_kind: str
    queue_class: str
    invocation_ordinal: int = 0


@dataclass(frozen=True)
class StartRunRequest:
    """A run to accept on ``plan_id`` (§18.3 ``StartRun``).

    ``idempotency_key`` dedupes within the trusted org (callers hash the complete work
    scope into it, ``runtime_svc.runs.keys``): the same key with the same request returns
    the same run; with a different request it is a conflict (an after-save trigger
    derives the key from the record mutation). The root starts ``Runnable``: no path
    leaves a run ``Accepted`` with nothing to admit it.
    """

    plan_id: str
    first_step: FirstStep
    input: CheckpointInput
    idempotency_key: str | None = None
    priority: int = 0
    #: ``<object>:<record_id>`` of the record the run is about (an after-save trigger's
    #: saved record), for per-record run limits (``runtime_svc.admission.slots``). Not
    #: part of the request digest: it is derived from the trigger the context holds.
    subject_record: str | None = None

    def digest(self, scope: TrustedRuntimeWorkScope) -> str:
        """``RequestDigest``: everything that makes two requests the same request."""
        return versioned_digest(
            "start-run-request",
            {
                "scope": _scope_values(scope),
                "plan_id": self.plan_id,
                "first_step": _flat_values(self.first_step),
                "context": self.input.context,
                "plan_cursor": self.input.plan_cursor,
                "context_schema_version": self.input.context_schema_version,
                "priority": self.priority,
                "admit": True,  # digest stability: runs accepted before admission was fixed
            },
        )


@dataclass(frozen=True)
class ClaimedStart:
    """A run created already claimed and ``Running`` for its caller
    (``docs/adr/0005-bounded-atomic-created-claimed.md``): the Running fence (the only
    copy of the raw lease token — never serialized) and the step's input as the creating
    transaction wrote it, so the caller needs no candidate read, claim transaction or
    preparation read."""

    fence: LeaseFence
    first_step: FirstStep
    #: The input checkpoint's canonical context JSON and read-verification set.
    context_json: str = dataclasses.field(repr=False)
    read_verification_json: str | None
    #: The input checkpoint's sequence (the run's latest at the fence's root version).
    sequence: int


@dataclass(frozen=True)
class InsertClaimed:
    """The fused claim of a run's first step, decided on the root and step its creation
    is about to insert (``docs/adr/0005``, round 7): the Running fence, the claim's
    transition (root and step patches, new attempt) and the step's ``Running`` patch.
    The creation inserts the root and step as these patches leave them and the attempt
    after them, instead of inserting and then UPDATEing its own rows."""

    fence: LeaseFence = dataclasses.field(repr=False)
    transition: Transition
    running: StepPatch


#: Decides the claim of a run being created on its root and step as they will be
#: inserted (``None``: insert them unclaimed).
ClaimOnInsert = Callable[[RunRecord, StepRecord], Awaitable[InsertClaimed | None]]


@dataclass(frozen=True)
class StartRunResult:
    """The accepted run, and whether this call created it (False: idempotent replay)."""

    run: RunRecord
    created: bool
    #: The created first step as inserted (``None`` on a replay).
    step: StepRecord | None = None
    #: The created input checkpoint's canonical context, verification set and sequence
    #: (``None`` on a replay) — what a caller that claims the step in the same
    #: transaction hands to its executor.
    input_checkpoint: tuple[str, str | None, int] | None = None
    #: Set by ``FlowRunStateStore.create_run_claimed_txn`` when it claimed the step.
    claimed: ClaimedStart | None = None


async def run_by_idempotency_key_txn(
    conn: AsyncConnection, org_id: str, key: str
) -> RunRecord | None:
    """The run of ``org_id`` accepted under ``key`` (soft-deleted included), or ``None``."""
    return await _by_idempotency_key(conn, org_id, key)


#: The creation path's reads, built once at import with bound parameters (issue 13:
#: executing a pre-built statement skips per-call construction and cache-key generation).
_RUN_BY_KEY = select(flow_runs.c.flow_run_id).where(
    flow_runs.c.org_id == bindparam("org"), flow_runs.c.idempotency_key == bindparam("key")
)
#: The plan columns run creation uses (the scope it must match, the version and profile
#: it copies onto the root) — not the plan payload or summaries, which it never reads.
_PLAN_COLUMNS = (
    "org_id",
    "app_installation_id",
    "runtime_capability_id",
    "runtime_work_binding_digest",
    "flow_version_id",
    "execution_profile",
)
#: Result-column label prefix of the plan's columns in :func:`_admission_read`.
_P = "plan_"
#: :func:`_admission_read`'s statement per dialect name (its clock SQL differs).
_ADMISSION_READ: dict[str, tuple[Select[Any], Callable[[Any], datetime]]] = {}


def _admission_read(dialect: Dialect) -> tuple[Select[Any], Callable[[Any], datetime]]:
    """One statement for what run creation reads before it writes: the deployment
    control record (V2 admission, §20.3), the plan in the trusted org (``LEFT OUTER
    JOIN``: no row for it leaves its columns NULL) and the database clock (the
    transaction's ``db_now``). Built once per dialect; bind ``org_id`` and ``plan_id``."""
    built = _ADMISSION_READ.get(dialect.name)
    if built is None:
        # Imported here: the control record decodes kernel enums (an import cycle at
        # module level, as in ``runtime_svc.migration.protocol``).
        from runtime_svc.migration.control import CONTROL_KEY

        clock, parse = now_column(dialect)
        p, control = execution_plans.c, flow_deployment_control
        on = and_(
            p.org_id == bindparam("org_id", type_=p.org_id.type),
            p.plan_id == bindparam("plan_id", type_=p.plan_id.type),
        )
        stmt = (
            select(clock, *control.c, *(p[name].label(_P + name) for name in _PLAN_COLUMNS))
            .select_from(control.outerjoin(execution_plans, on))
            .where(control.c.control_key == CONTROL_KEY)
        )
        built = _ADMISSION_READ[dialect.name] = (stmt, parse)
    return built


async def _admitted_plan(
    conn: AsyncConnection, scope: TrustedRuntimeWorkScope, plan_id: str
) -> dict[str, Any]:
    """The plan's columns (:data:`_PLAN_COLUMNS`) once V2 admission is open, reading
    the control record, the plan and the clock in one statement (the clock is kept as
    the transaction's ``db_now``: ``services.db.remember_now``).

    Raises:
        V2AdmissionClosedError: admission is closed (checked before the plan).
        FailedPreconditionError: the control record is missing.
        NotFoundError: no such plan in the trusted work scope.
    """
    from runtime_svc.migration.control import DeploymentControl

    stmt, parse = _admission_read(conn.dialect)
    [rows] = await execute_reads(conn, [Read(stmt, {"org_id": scope.org_id, "plan_id": plan_id})])
    if not rows:
        # No control record: the plain check raises its fail-closed error.
        await require_v2_admission_txn(conn)
        raise InvariantError("the deployment control record vanished within a transaction")
    values = rows[0]._asdict()
    remember_now(conn, parse(values["db_now"]))
    require_v2_admission(DeploymentControl.from_row(values))
    plan = {name: values[_P + name] for name in _PLAN_COLUMNS}
    # A plan of another installation/capability/binding answers like a missing one.
    if plan["org_id"] is None or any(plan[k] != v for k, v in _scope_values(scope).items()):
        raise NotFoundError("execution_plan", plan_id)
    return plan


async def _by_idempotency_key(conn: AsyncConnection, org_id: str, key: str) -> RunRecord | None:
    params = {"org": org_id, "key": key}
    run_id = (await conn.execute(_RUN_BY_KEY, params)).scalar_one_or_none()
    if run_id is None:
        return None
    return await get_run_txn(conn, org_id, run_id, include_deleted=True)


def inserted_run(values: Mapping[str, Any]) -> RunRecord:
    """The root row an INSERT of ``values`` into ``flow_runs`` stored (every column it
    does not name is NULL or unused by :class:`RunRecord`), decoded exactly as a read-back
    is — so the creating transaction needs no read-back; pinned equal to the stored row by
    ``test_kernel_derived_rows``."""
    row: dict[str, Any] = dict.fromkeys(flow_runs.columns.keys())
    row.update(values)
    return run_from_row(cast(RowMapping, row))


def _replay(existing: RunRecord, request_digest: str) -> StartRunResult:
    if existing.request_digest != request_digest:
        raise ConflictError(
            "idempotency key already used for a different request",
            entity="flow_run",
            key=existing.idempotency_key or "",
        )
    return StartRunResult(existing, created=False)


async def create_run_txn(
    conn: AsyncConnection,
    scope: TrustedRuntimeWorkScope,
    request: StartRunRequest,
    *,
    ownership_epoch: int,
    max_checkpoint_bytes: int,
    clock: Callable[[AsyncConnection], Awaitable[datetime]] = db_now,
    claim: ClaimOnInsert | None = None,
    prepared: PreparedCheckpoint | None = None,
    last: bool = False,
) -> StartRunResult:
    """Accept a run inside the caller's transaction.

    ``clock``: the durable clock (``services.db.db_now`` unless a test shifts it), read
    after the admission read, which carries the database clock (one statement for the
    control record, the plan and the time). ``prepared``: ``request.input`` as the caller
    already prepared (validated and encoded) it before the transaction, else prepared
    here.

    ``claim``: decide the fused claim of the first step on the root and step about to be
    inserted (``FlowRunStateStore.create_run_claimed_txn``); when it returns a claim,
    the root and step are inserted as its patches leave them (claimed, ``Running``,
    version 1 each), its attempt is inserted after them, and the result's ``claimed``
    carries the fence. Nothing of it is written on a replay.

    ``last``: the caller's transaction ends with this creation — the inserts carry its
    ``COMMIT`` where the backend allows (``services.db_batch.commit_writes``, ADR 0013;
    a lost idempotency-key race stops the round trip before it, and the replay's read
    runs in the still open transaction).

    Raises:
        NotFoundError: no such plan in the trusted work scope.
        ConflictError: the idempotency key was used for a different request.
        InvalidArgumentError: the input checkpoint is too large or holds credentials
            (before any SQL).
        V2AdmissionClosedError: §20.3 — no V2 admission before both bridge gates, on a
            pre-bridge binary, or while admission is disabled (a replay of an existing
            run is still answered).
    """
    org = scope.org_id
    if prepared is None:
        prepared = prepare_checkpoint(request.input, max_bytes=max_checkpoint_bytes)
    request_digest = request.digest(scope)
    if request.idempotency_key is not None:
        existing = await _by_idempotency_key(conn, org, request.idempotency_key)
        if existing is not None:
            return _replay(existing, request_digest)
    plan = await _admitted_plan(conn, scope, request.plan_id)
    now = await clock(conn)
    check_transition("run", RunState.ACCEPTED, RunState.RUNNABLE)
    state = RunState.RUNNABLE
    first = request.first_step
    run_id, step_id, checkpoint_id = new_run_id(), new_id("step"), new_id("ckpt")
    values = {
        **_scope_values(scope),
        "flow_run_id": run_id,
        "flow_version_id": plan["flow_version_id"],
        "plan_id": request.plan_id,
        "execution_profile": plan["execution_profile"],
        "execution_owner": ExecutionOwner.FLOW_RUNTIME_V2.code,
        "runtime_state": state.code,
        "current_step_execution_id": step_id,
        "current_checkpoint_id": checkpoint_id,
        "state_version": 0,
        "ownership_epoch": ownership_epoch,
        "run_after": now,
        "queue_class": first.queue_class,
        "priority": request.priority,
        "is_deleted": False,
        "idempotency_key": request.idempotency_key,
        "request_digest": request_digest,
        "subject_record_key": request.subject_record,
        "interview_status": compatibility_status(state, StepState.PENDING).code,
        "current_element": first.plan_step_key,
        "created_at": now,
        "updated_at": now,
        "trace_context": run_trace_context(run_id, request.plan_id, plan["execution_profile"]),
    }
    step = NewStep(
        step_execution_id=step_id,
        flow_run_id=run_id,
        plan_step_key=first.plan_step_key,
        invocation_ordinal=first.invocation_ordinal,
        step_kind=first.step_kind,
        input_checkpoint_id=checkpoint_id,
        ownership_epoch=ownership_epoch,
        run_after=now,
        queue_class=first.queue_class,
    )
    created_root, created_step = inserted_run(values), inserted_step(org, step, now)
    claimed = None if claim is None else await claim(created_root, created_step)
    inserted = values
    if claimed is not None:
        run_patch = claimed.transition.run
        if run_patch is None:
            raise InvariantError("a claim patches the root")
        inserted = claimed_run_values(
            values, run_patch, projected_step_state(claimed.transition), now
        )
    # The run's first checkpoint: if the root INSERT wins, the run has no checkpoint yet
    # and its last sequence is 0 — no read for it.
    checkpoint, meta = checkpoint_insert(
        org,
        run_id,
        prepared,
        checkpoint_id=checkpoint_id,
        created_by_attempt_id=None,
        now=now,
        last_sequence=0,
    )
    input_checkpoint = (prepared.context_json, prepared.read_verification_json, meta.sequence)
    writes = [insert_if_absent_write(flow_runs, inserted), checkpoint]
    if claimed is None:
        writes.append(step_insert(org, step, now, None))
    else:
        new_attempt, step_patch = claimed.transition.new_attempt, claimed.transition.step
        if new_attempt is None or step_patch is None:
            raise InvariantError("a claim patches the step and adds an attempt")
        writes += [
            step_insert(org, step, now, (step_patch, claimed.running)),
            attempt_insert(org, new_attempt),
        ]
    # Root (if absent), checkpoint, step (and attempt) in one round trip where the backend
    # allows (ADR 0010): a root that exists stops it before the rest.
    if not await execute_writes_if_absent(conn, writes, commit=last):
        # Lost the insert race on the idempotency key: read the winner back.
        key = request.idempotency_key
        existing = None if key is None else await _by_idempotency_key(conn, org, key)
        if existing is None:
            raise ConflictError("flow run identity collision", entity="flow_run")
        return _replay(existing, request_digest)
    if claimed is None:
        checkpoint_written(prepared)
        return StartRunResult(
            created_root, created=True, step=created_step, input_checkpoint=input_checkpoint
        )
    checkpoint_written(prepared)
    start = ClaimedStart(
        claimed.fence, first, prepared.context_json, prepared.read_verification_json, meta.sequence
    )
    return StartRunResult(
        created_root,
        created=True,
        step=created_step,
        input_checkpoint=input_checkpoint,
        claimed=start,
    )
