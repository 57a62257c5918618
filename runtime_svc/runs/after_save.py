"""After-save record triggers (§9, issue 5 "Starting runs"): admission before the
business transaction, run creation inside it.

The RecordService calls, per mutating request:

1. :func:`select_after_save_plans` *before* opening its transaction (admission opens no
   business transaction; a refusal fails the request before anything is written);
2. :func:`admit_after_save_runs_txn` *inside* its transaction, after the record, history
   sequence, event and audit rows (runs are lifecycle rows, appended after the business
   rows in the §13.1 order); the returned ids are ``triggered_flow_run_ids``.

Each run's idempotency key is derived from the mutation (org, object, record id, history
sequence, Flow), and its request body only from the same values, so a replayed record
request (``MutationResult.replayed``, same history sequence) maps to the run it already
started instead of a second one.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.definitions import (
    AdmissionError,
    RequestBoundView,
    TriggerSelection,
    select_plan_for_trigger,
)
from runtime_svc.definitions import repository as repo
from runtime_svc.kernel import CheckpointInput, FlowRunStateStore, StartRunRequest
from runtime_svc.records.model import MutationResult
from runtime_svc.runs.keys import after_save_key
from runtime_svc.runs.resolve import first_step_of
from services.auth import TrustedRuntimeWorkScope
from services.errors import NotFoundError

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
        The run ids, in dispatch order (the same ids again for a replayed mutation).

    Raises:
        NotFoundError: an admitted plan vanished from the work scope (rolls back).
        ConflictError: a derived key holds a different request (a broken invariant).
    """
    record = mutation.record
    run_ids: list[str] = []
    for admitted in sorted(selection.plans, key=lambda p: p.dispatch_order):
        row = await repo.get_plan_txn(conn, scope.org_id, admitted.plan_id)
        if row is None:
            raise NotFoundError("execution_plan", admitted.plan_id)
        first = first_step_of(row.plan(), row.execution_profile)
        trigger = {
            "object": record.object_name,
            "record_id": record.record_id,
            "history_sequence": mutation.history_sequence,
            "event_id": mutation.event_id,
            "event": event,
        }
        request = StartRunRequest(
            plan_id=row.plan_id,
            first_step=first,
            input=CheckpointInput(
                context={"variables": {}, "trigger": trigger},
                plan_cursor={"step": first.plan_step_key},
            ),
            idempotency_key=after_save_key(
                scope.org_id,
                record.object_name,
                record.record_id,
                mutation.history_sequence,
                admitted.flow_api_name,
            ),
        )
        result = await store.create_run_txn(conn, scope, request)
        run_ids.append(result.run.flow_run_id)
    return run_ids
