"""Embedded Before-Save dispatch inside the record engine's own transaction (§9.1).

:meth:`BeforeSaveDispatcher.transform_txn` is the record engine's ``transform`` hook
(:meth:`runtime_svc.records.RecordEngine.mutate`): it runs on the record transaction's
connection after the stored row was read and *before* the lock plan is made and the row
written, so a transform that sets a lookup field is locked like any other write. In that
one transaction it

1. selects the before-save plans of the request-bound view for the write's object and
   event (:func:`~runtime_svc.definitions.select_plan_for_trigger_txn`: one indexed
   activation read; plan and Flow-version rows are immutable and cached per process).
   A deduplicated write (every ``RecordService`` write) makes that activation read in
   its ledger lookup, the transaction's first statement
   (:meth:`BeforeSaveDispatcher.activation_read`, ``RecordEngine.mutate_once(also=…)``)
   instead of in a statement of its own: the same read of the same transaction, made
   before any write of it — a deactivation committed before the write's transaction
   began is honored exactly as before (MariaDB runs READ COMMITTED: each statement
   reads the latest committed activations; SQLite's write transaction is serialized);
2. runs each plan's transform (:func:`~runtime_svc.embedded.transform.run_before_save`)
   in the **documented order**: ascending trigger-subscription ``dispatch_order``, ties
   by Flow API name — the admission order, stable across processes and restarts. Each
   Flow sees the record as the previous one left it;
3. re-validates the final record against the view (the Flow's output is held to the same
   write rules as the caller's request) and returns the mutation the engine writes.

No Flow root, step, checkpoint or second transaction exists on this path, and nothing
here can pause. A failure raises :class:`BeforeSaveFailedError`
(``FAILED_PRECONDITION``; attributes name the Flow, the safe code and, for a budget, the
bound) and the engine rolls the whole mutation back; the caller owns the retry, which
replays the whole mutation. The failure evidence is one audit row
(``action = before_save.failed``, safe details only) that the record service appends in
its own short transaction *after* the rollback (:func:`record_failure`) — the record
engine's audit contract.

Only ``create`` and ``update`` have before-save timing; a delete passes through.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import ExecutionPlan
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions.admission import (
    AdmissionError,
    AdmittedPlan,
    ImmutableRowCache,
    RequestBoundView,
    select_plan_for_trigger_txn,
    subscribed_flows,
)
from runtime_svc.embedded.transform import BeforeSaveFault, run_before_save
from runtime_svc.records import (
    Actor,
    MutationKind,
    RecordMutation,
    RecordState,
    RecordValidationError,
    RecordView,
    prepare_transformed,
)
from runtime_svc.records import store as record_store
from runtime_svc.records.store import read_record_txn
from runtime_svc.worker.executor import record_query
from services.db import db_now, transaction
from services.errors import FailedPreconditionError, NotFoundError

__all__ = [
    "BEFORE_SAVE",
    "BEFORE_SAVE_FAILED_ACTION",
    "ActivationRead",
    "BeforeSaveDispatcher",
    "BeforeSaveEvidence",
    "BeforeSaveFailedError",
    "record_failure",
]

log = logging.getLogger(__name__)

BEFORE_SAVE = "before_save"
#: Audit action of a failed before-save Flow.
BEFORE_SAVE_FAILED_ACTION = "before_save.failed"
_MAX_PARSED_PLANS = 256


@dataclass(frozen=True)
class BeforeSaveEvidence:
    """Safe facts about a failed before-save Flow (no field values, no credentials)."""

    org_id: str
    object_name: str
    record_id: str
    event: str
    flow_api_name: str
    plan_id: str
    plan_digest: str
    code: str
    bound: str | None

    def details(self) -> dict[str, Any]:
        """The audit row's details."""
        out: dict[str, Any] = {
            "event": self.event,
            "flow_api_name": self.flow_api_name,
            "plan_id": self.plan_id,
            "plan_digest": self.plan_digest,
            "code": self.code,
        }
        if self.bound is not None:
            out["bound"] = self.bound
        return out


class BeforeSaveFailedError(FailedPreconditionError):
    """A before-save Flow failed (or exceeded its budget): the record was not written.

    ``reason`` is ``before_save.budget_exceeded`` for an exhausted bound (attribute
    ``bound`` names it: ``max_steps``, ``max_reads``, ``max_writes``, ``max_fanout``) and
    ``before_save.flow_failed`` otherwise; attributes carry ``flow_api_name`` and the
    safe ``code``. Deterministic: resending the same mutation fails the same way.
    """

    def __init__(self, evidence: BeforeSaveEvidence, message: str) -> None:
        budget = evidence.bound is not None
        attributes = {"flow_api_name": evidence.flow_api_name, "code": evidence.code}
        if evidence.bound is not None:
            attributes["bound"] = evidence.bound
        super().__init__(
            f"before-save Flow {evidence.flow_api_name} failed ({evidence.code}): {message}",
            reason="before_save.budget_exceeded" if budget else "before_save.flow_failed",
            attributes=attributes,
        )
        self.evidence = evidence


class ActivationRead:
    """The before-save activation read of one write, made by the write's ledger lookup
    (a ``services.request_dedupe.LookupColumn``): the column that reads the ACTIVE
    activations of the Flows the request-bound view subscribes, and what the current
    transaction attempt read. :meth:`BeforeSaveDispatcher.transform_txn` takes the rows
    once; a transform without a fresh lookup reads the activations itself."""

    def __init__(
        self, org_id: str, installation: str, capability: str, names: tuple[str, ...]
    ) -> None:
        self._org, self._installation, self._capability = org_id, installation, capability
        self._names = names
        self._count = len(set(names))
        self._rows: list[tuple[str, str, str | None]] | None = None
        #: The lookup column's statement shape (``LookupColumn.key``): one per number
        #: of subscribed Flows (a bound parameter each).
        self.key = f"before_save_activations/{self._count}"

    def column(self, dialect: Dialect) -> ColumnElement[Any]:
        """The activation read as one scalar column of the lookup's statement."""
        return repo.active_plan_ids_column(dialect, self._count)

    def params(self) -> dict[str, Any]:
        """The read's bound values: this write's org, binding and subscribed Flows."""
        return repo.active_plan_ids_params(
            self._org, self._installation, self._capability, self._names
        )

    def accept(self, value: Any) -> None:
        """Keep what this transaction attempt's lookup read."""
        self._rows = repo.parse_active_plan_ids(value)

    def take(self) -> list[tuple[str, str, str | None]] | None:
        """The rows the current attempt read (once), or ``None``."""
        rows, self._rows = self._rows, None
        return rows


class BeforeSaveDispatcher:
    """Runs the before-save Flows of a record mutation inside its transaction.

    Args:
        cache: immutable plan/version rows shared per process.
    """

    def __init__(self, cache: ImmutableRowCache | None = None) -> None:
        self._rows = cache or ImmutableRowCache()
        self._parsed: OrderedDict[tuple[str, str], ExecutionPlan] = OrderedDict()
        #: Transforms run (``ran``) and skipped by their entry condition (test evidence).
        self.ran = 0
        self.skipped = 0

    def _plan(self, org_id: str, admitted: AdmittedPlan) -> ExecutionPlan:
        key = (org_id, admitted.plan_id)
        plan = self._parsed.get(key)
        if plan is not None:
            self._parsed.move_to_end(key)
            return plan
        row = self._rows.plans.get(key)
        if row is None:  # selection always loads it; defensive
            raise NotFoundError("execution_plan", admitted.plan_id)
        plan = row.plan()
        self._parsed[key] = plan
        while len(self._parsed) > _MAX_PARSED_PLANS:
            self._parsed.popitem(last=False)
        return plan

    async def _ensure_row(self, conn: AsyncConnection, org_id: str, plan_id: str) -> None:
        key = (org_id, plan_id)
        if key not in self._rows.plans:
            row = await repo.get_plan_txn(conn, org_id, plan_id)
            if row is None:
                raise NotFoundError("execution_plan", plan_id)
            self._rows.remember(self._rows.plans, key, row)

    def activation_read(
        self, org_id: str, request_view: RequestBoundView | None, mutation: RecordMutation
    ) -> ActivationRead | None:
        """The activation read :meth:`transform_txn` of ``mutation`` needs, for the
        write's ledger lookup to make (``RecordEngine.mutate_once(also=…)``); ``None``
        when it needs none (a delete, no view, no subscribed Flow)."""
        if mutation.kind not in (MutationKind.CREATE, MutationKind.UPDATE):
            return None
        if request_view is None or request_view.view is None:
            return None
        names = subscribed_flows(
            request_view.view, mutation.object_name, BEFORE_SAVE, mutation.kind.value, self._rows
        )
        if not names:
            return None
        b = request_view.binding
        return ActivationRead(org_id, b.app_installation_id, b.runtime_capability_id, names)

    async def transform_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        request_view: RequestBoundView | None,
        view: RecordView,
        mutation: RecordMutation,
        current: RecordState | None,
        *,
        activations: ActivationRead | None = None,
    ) -> RecordMutation:
        """The mutation to write after every before-save Flow ran (see module docstring).
        ``activations``: :meth:`activation_read`'s object, whose read this transaction's
        ledger lookup made (``None``, or not read this attempt: read here).

        Raises:
            FailedPreconditionError: admission refused (view/binding/trigger mismatch, a
                subscribed Flow without an active plan, a non-before-save plan).
            BeforeSaveFailedError: a Flow failed, exceeded its budget or produced a record
                the view's write rules refuse.
        """
        if mutation.kind not in (MutationKind.CREATE, MutationKind.UPDATE):
            return mutation
        event = mutation.kind.value
        selection = await select_plan_for_trigger_txn(
            conn,
            org_id,
            mutation.object_name,
            BEFORE_SAVE,
            event,
            request_view,
            cache=self._rows,
            active_ids=None if activations is None else activations.take(),
        )
        if isinstance(selection, AdmissionError):
            raise selection.to_exception()
        if not selection.plans:
            return mutation
        prior: dict[str, Any] | None = None if current is None else dict(current.fields)
        start: dict[str, Any] = {**(prior or {}), **dict(mutation.fields)}
        fields = dict(start)

        async def reader(object_name: str, record_id: str) -> RecordState | None:
            return await read_record_txn(conn, org_id, object_name, record_id)

        query = record_query(conn, org_id, view)
        for admitted in selection.plans:
            await self._ensure_row(conn, org_id, admitted.plan_id)
            plan = self._plan(org_id, admitted)
            if plan.profile is not ExecutionProfile.EMBEDDED_BEFORE_SAVE:
                raise FailedPreconditionError(
                    f"Flow {admitted.flow_api_name} is subscribed before-save but its active "
                    f"plan is {plan.profile.value}",
                    reason="before_save.profile_mismatch",
                    attributes={"flow_api_name": admitted.flow_api_name},
                )
            try:
                outcome = await run_before_save(
                    plan, mutation.record_id, fields, prior, reader=reader, query=query
                )
            except BeforeSaveFault as fault:
                evidence = _evidence(org_id, mutation, event, admitted)
                raise BeforeSaveFailedError(
                    _with(evidence, fault.code, fault.bound), fault.message
                ) from None
            if outcome.ran:
                self.ran += 1
            else:
                self.skipped += 1
            fields = dict(outcome.fields)
        try:
            return prepare_transformed(view, mutation, start, fields)
        except RecordValidationError as exc:
            last = selection.plans[-1]
            raise BeforeSaveFailedError(
                _with(_evidence(org_id, mutation, event, last), "invalid_output", None),
                f"the transformed record breaks the object's write rules: {exc.safe_message}",
            ) from None


def _evidence(
    org_id: str, mutation: RecordMutation, event: str, admitted: AdmittedPlan
) -> BeforeSaveEvidence:
    return BeforeSaveEvidence(
        org_id=org_id,
        object_name=mutation.object_name,
        record_id=mutation.record_id,
        event=event,
        flow_api_name=admitted.flow_api_name,
        plan_id=admitted.plan_id,
        plan_digest=admitted.plan_digest,
        code="",
        bound=None,
    )


def _with(evidence: BeforeSaveEvidence, code: str, bound: str | None) -> BeforeSaveEvidence:
    return BeforeSaveEvidence(**{**evidence.__dict__, "code": code, "bound": bound})


async def record_failure(engine: AsyncEngine, evidence: BeforeSaveEvidence, actor: Actor) -> None:
    """Append the failure's audit row in its own short transaction (after the record
    transaction rolled back). A failure to record evidence is logged, never raised: the
    caller's answer is the Flow's failure either way."""
    try:
        async with transaction(engine) as conn:
            await record_store.insert_audit_txn(
                conn,
                record_store.AuditRow(
                    org_id=evidence.org_id,
                    audit_record_id=f"aud_{uuid.uuid4().hex}",
                    actor_kind=actor.kind,
                    actor_id=actor.id,
                    action=BEFORE_SAVE_FAILED_ACTION,
                    object_name=evidence.object_name,
                    record_id=evidence.record_id,
                    details=evidence.details(),
                    occurred_at=await db_now(conn),
                ),
            )
    except Exception:
        log.warning(
            "could not record before-save failure evidence of %s",
            evidence.flow_api_name,
            exc_info=True,
        )
