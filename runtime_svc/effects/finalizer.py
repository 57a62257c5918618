"""The Flow finalizer of the ``flow.effect.submit`` family (§15.4) and the shared
root-first convergence of a handoff's owner receipt.

The generic outbox calls :meth:`FlowEffectFinalizer.finalize` — outside any transaction,
holding no outbox lock — once reconciliation persisted the owner's ``Rejected`` or
``AcceptanceUnknown`` receipt (and again from its repair sweep while the message stays
pre-final). One transaction then:

1. discovers the completion dependency of the message's handoff key without a lock
   (and, for a fault path, the plan's compiled fault step — plans are immutable);
2. locks the Flow root, the ``EffectCompletion`` step and the dependency, in the §12
   order (root first: a concurrent ``EffectSubmit`` retry, resolution, expiry or
   cancellation of the same run queues on the root, never on a lower row);
3. applies the convergence (:mod:`runtime_svc.kernel.transitions_effects`): ``Rejected``
   → the dependency's compiled expiry policy (fault successor ``Runnable``, step/root
   failed, quarantine) or the completion of a cancellation; ``AcceptanceUnknown`` →
   dependency, step and root quarantined;
4. makes the message terminal (``HandoffRejected`` / ``DeadLettered``) with
   ``ticket.commit_txn(conn)`` — last.

So no terminal non-delivery state can ever coexist with a root still ``Waiting`` on the
handoff (§15.4, §22.5). A repeat finds its convergence applied (or another finalizer's
``FenceLostError`` rolls it back): idempotent. ``Accepted`` needs no finalizer — the
dispatcher repairs delivery and the Flow keeps waiting for the business receipt.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.store_rows import lock_run, lock_step
from runtime_svc.kernel.store_waits import (
    FaultStep,
    apply_wait_transition,
    dependency_from_row,
    fault_successor_txn,
    lock_dependency,
    scope_predicates,
)
from runtime_svc.kernel.transitions_effects import decide_handoff_rejected, decide_handoff_unknown
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyRecord, ExpiryPolicyCode, WorkScopeKey
from runtime_svc.schema import flow_dependencies
from runtime_svc.waits.resolution import Clock, Matcher
from services.db import db_now, run_in_transaction, transaction
from services.errors import NotFoundError
from services.outbox import Disposition, FinalizationTicket, OutboxMessage

__all__ = ["FlowEffectFinalizer", "converge_txn", "handoff_dependency_txn", "scope_of_message"]

log = logging.getLogger(__name__)


def scope_of_message(m: OutboxMessage) -> WorkScopeKey:
    """The complete work scope of an outbox row."""
    return WorkScopeKey(
        m.org_id, m.app_installation_id, m.runtime_capability_id, m.runtime_work_binding_digest
    )


async def handoff_dependency_txn(
    conn: AsyncConnection, scope: WorkScopeKey, handoff_key: str
) -> DependencyRecord | None:
    """The completion dependency of ``handoff_key`` in exactly ``scope`` (no lock; the
    newest when — impossibly — there were several)."""
    d = flow_dependencies.c
    row = (
        (
            await conn.execute(
                select(flow_dependencies)
                .where(
                    *scope_predicates(flow_dependencies, scope),
                    d.producer_kind == EFFECT_COMPLETION_PRODUCER,
                    d.producer_key == handoff_key,
                )
                .order_by(d.created_at.desc(), d.dependency_id)
                .limit(1)
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else dependency_from_row(row)


async def fault_step_of(
    matcher: Matcher, conn: AsyncConnection, dep: DependencyRecord
) -> FaultStep | None:
    """The compiled fault successor of ``dep``'s waiting step (None: none, or gone)."""
    if dep.expiry_policy is not ExpiryPolicyCode.FAULT_PATH:
        return None
    try:
        return (await matcher.context_txn(conn, dep)).fault_step()
    except NotFoundError:
        return None


async def converge_txn(
    conn: AsyncConnection,
    found: DependencyRecord,
    disposition: Disposition,
    now: datetime,
    fault: FaultStep | None,
) -> WaitTransition | NoChange:
    """Root-first: lock root → completion step → dependency and apply ``disposition``
    (see the module docstring). ``found`` was discovered without a lock."""
    org_id = found.org_id
    root = await lock_run(conn, org_id, found.flow_run_id)
    if root is None:
        return NoChange("run_missing")
    step = await lock_step(conn, org_id, found.step_execution_id)
    dep = await lock_dependency(conn, org_id, found.dependency_id)
    if dep is None:
        return NoChange("missing")
    decision: WaitTransition | NoChange
    if disposition is Disposition.REJECTED:
        successor = (
            await fault_successor_txn(conn, root, fault)
            if dep.expiry_policy is ExpiryPolicyCode.FAULT_PATH
            else None
        )
        decision = decide_handoff_rejected(root, step, dep, now, fault=successor)
    else:
        decision = decide_handoff_unknown(root, step, dep, now)
    if isinstance(decision, WaitTransition):
        await apply_wait_transition(conn, org_id, decision, now)
    return decision


class FlowEffectFinalizer:
    """``services.outbox.Finalizer`` of ``flow.effect.submit`` (see the module docstring).

    Args:
        engine: the runtime database.
        matcher: plan lookups (the fault successor) of the wait machinery.
        clock: the durable clock.
    """

    def __init__(self, engine: AsyncEngine, matcher: Matcher, clock: Clock = db_now) -> None:
        self._engine = engine
        self._matcher = matcher
        self._clock = clock

    async def finalize(self, ticket: FinalizationTicket) -> None:
        """Converge the Flow, then make the message terminal, in one transaction.

        Raises:
            FenceLostError: another finalizer finished the message (or a concurrent
                transition moved a lifecycle row): everything rolled back; the repair
                sweep re-reads.
        """
        message = ticket.message
        scope = scope_of_message(message)
        async with transaction(self._engine, readonly=True) as conn:
            dep = await handoff_dependency_txn(conn, scope, message.key)
            fault = None
            if dep is not None and ticket.disposition is Disposition.REJECTED:
                fault = await fault_step_of(self._matcher, conn, dep)

        async def fn(conn: AsyncConnection) -> WaitTransition | NoChange:
            now = await self._clock(conn)
            result: WaitTransition | NoChange = NoChange("no_dependency")
            if dep is not None:
                result = await converge_txn(conn, dep, ticket.disposition, now, fault)
            await ticket.commit_txn(conn)  # last: the message becomes terminal here
            return result

        result = await run_in_transaction(self._engine, fn)
        log.info(
            "effect handoff %s %s: flow %s",
            message.message_id,
            ticket.disposition.value,
            result.outcome if isinstance(result, WaitTransition) else result.reason,
        )
