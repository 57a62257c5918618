"""After-save record triggers (§9, issue 5 "Starting runs"): admission before the
business transaction, run creation inside it.

The RecordService calls, per mutating request:

1. :func:`select_after_save_plans` *before* opening its transaction (admission opens no
   business transaction; a refusal fails the request before anything is written);
2. :func:`admit_after_save_runs_txn` *inside* its transaction, after the record, history
   sequence, event and audit rows (runs are lifecycle rows, appended after the business
   rows in the §13.1 order); the returned ids are ``triggered_flow_run_ids``.

Each run's idempotency key is derived from the mutation (complete work scope, object,
record id, history sequence, Flow), so the run of one mutation is never created twice. A
retried record request never reaches this module: the request ledger replays the record
service's original response (its ``triggered_flow_run_ids`` included) without touching
the record.

A plan's trigger **entry condition** is evaluated here, inside the record transaction,
over ``$Record`` (the record as written) and ``$Record__Prior`` (the stored record before
the mutation, ``None`` on create); a plan whose condition is false starts no run. The run's
input checkpoint carries both records as the variables ``$Record`` / ``$Record__Prior``
plus the ``trigger`` reference (object, record id, history sequence, event).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.admission.slots import record_subject_key
from runtime_svc.definitions import (
    AdmissionError,
    RequestBoundView,
    TriggerSelection,
    select_plan_for_trigger,
)
from runtime_svc.definitions import repository as repo
from runtime_svc.identity import record_initiator_txn
from runtime_svc.kernel import CheckpointInput, FlowRunStateStore, StartRunRequest
from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.legacy.admission import admit_legacy_txn
from runtime_svc.migration.cohorts import choose_owner_txn
from runtime_svc.records.model import MutationResult
from runtime_svc.runs.keys import after_save_key
from runtime_svc.runs.resolve import first_step_of
from runtime_svc.worker.executor import (
    StepFault,
    entry_condition_holds,
    to_json_value,
    trigger_env,
)
from services.auth import TrustedRuntimeWorkScope
from services.errors import FailedPreconditionError, NotFoundError

__all__ = ["AFTER_SAVE", "admit_after_save_runs_txn", "select_after_save_plans"]

AFTER_SAVE = "after_save"


async def select_after_save_plans(
    engine: AsyncEngine,
    scope: TrustedRuntimeWorkScope,
    object_name: str,
    event: str,
    view: RequestBoundView | None,
) -> TriggerSelection:
    """The active after-save plans ``event`` on ``object_name`` starts (maybe none).

    Raises:
        FailedPreconditionError: admission refused (view missing/mismatched, binding or
            trigger mismatch); nothing may be written.
    """
    selection = await select_plan_for_trigger(
        engine, scope.org_id, object_name, AFTER_SAVE, event, view
    )
    if isinstance(selection, AdmissionError):
        raise selection.to_exception()
    return selection


async def admit_after_save_runs_txn(
    conn: AsyncConnection,
    store: FlowRunStateStore,
    scope: TrustedRuntimeWorkScope,
    selection: TriggerSelection,
    mutation: MutationResult,
    *,
    event: str,
) -> list[str]:
    """Accept one run per admitted plan inside the record transaction.

    Returns:
        The run ids, in dispatch order.

    Raises:
        NotFoundError: an admitted plan vanished from the work scope (rolls back).
        ConflictError: a derived key holds a different request (a broken invariant).
    """
    record = mutation.record
    run_ids: list[str] = []
    ordered = sorted(selection.plans, key=lambda p: (p.dispatch_order, p.flow_api_name))

    def key_of(flow_api_name: str) -> str:
        return after_save_key(
            scope,
            record.object_name,
            record.record_id,
            mutation.history_sequence,
            flow_api_name,
        )

    env = trigger_env(
        record.record_id,
        record.fields,
        None if mutation.prior is None else mutation.prior.fields,
    )
    for admitted in ordered:
        row = await repo.get_plan_txn(conn, scope.org_id, admitted.plan_id)
        if row is None:
            raise NotFoundError("execution_plan", admitted.plan_id)
        plan = row.plan()
        try:
            if not entry_condition_holds(plan, env):
                continue
        except StepFault as fault:
            raise FailedPreconditionError(
                f"the entry condition of Flow {admitted.flow_api_name} cannot be evaluated "
                f"({fault.code})",
                reason="after_save.entry_condition_failed",
                attributes={"flow_api_name": admitted.flow_api_name},
            ) from None
        trigger = {
            "object": record.object_name,
            "record_id": record.record_id,
            "history_sequence": mutation.history_sequence,
            "event_id": mutation.event_id,
            "event": event,
        }
        key = key_of(admitted.flow_api_name)
        variables = {k: to_json_value(v) for k, v in env.items()}
        choice = await choose_owner_txn(
            conn, scope.org_id, row.flow_version_id, row.execution_profile
        )
        if choice.owner is ExecutionOwner.LEGACY_INTERPRETER:
            # §20.6-§20.8: the cohort selects the legacy owner for this new run; it is
            # admitted due now, in this record transaction, for the legacy scheduler.
            interview, _, _ = await admit_legacy_txn(
                conn,
                scope,
                row.flow_version_id,
                variables,
                trigger=trigger,
                idempotency_key=key,
                request_digest=key,
            )
            run_ids.append(interview.flow_run_id)
            continue
        first = first_step_of(plan, row.execution_profile)
        request = StartRunRequest(
            plan_id=row.plan_id,
            first_step=first,
            input=CheckpointInput(
                context={"variables": variables, "trigger": trigger},
                plan_cursor={"step": first.plan_step_key},
            ),
            idempotency_key=key,
            subject_record=record_subject_key(record.object_name, record.record_id),
        )
        result = await store.create_run_txn(conn, scope, request)
        # §17.1: the principal whose save started the run (the SaveRecord caller).
        await record_initiator_txn(conn, scope.org_id, result, plan)
        run_ids.append(result.run.flow_run_id)
    return run_ids
