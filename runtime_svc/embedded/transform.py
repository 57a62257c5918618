"""The Embedded Before-Save transform of one plan (§9.1): pure apart from the awaited
record reads it is given (current reads inside the caller's record transaction).

:func:`run_before_save` evaluates the plan's entry condition over ``$Record`` (the record
as it will be written) and ``$Record__Prior`` (the stored record, ``None`` on create),
then walks the plan's single ``EmbeddedTransform`` step with a
:class:`~runtime_svc.worker.budget.BudgetMeter` built from the step's compiled bounds.
Assignments to ``$Record.<field>`` and an ``UpdateRecord`` of ``$Record`` change the
record in place; the result is the record's final field values. Anything else that would
leave the caller's row — a write of another record, a changed ``Id``, a run that ends on a
failure path — fails closed with :class:`BeforeSaveFault`; the compiler already refused
Flows that wait, call out or write elsewhere, so these are defence in depth.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime_svc.compiler import ExecutionPlan, StepKind
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.kernel.decisions import FailRun
from runtime_svc.worker.budget import BudgetMeter
from runtime_svc.worker.executor import (
    TRIGGER,
    RecordQuery,
    RecordReader,
    StepBudgetExceeded,
    StepFault,
    entry_condition_holds,
    run_nodes,
    to_record_value,
    trigger_env,
)

__all__ = ["BeforeSaveFault", "TransformOutcome", "run_before_save"]


class BeforeSaveFault(Exception):
    """A before-save Flow failed; the record mutation fails with it.

    Attributes:
        code: stable safe code (``budget_exceeded.max_reads``, ``expression_error``, the
            code of a ``Fault`` element, ``write_outside_trigger_record``, …).
        bound: the exhausted bound for a budget failure, else ``None``.
    """

    def __init__(self, code: str, message: str, bound: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.bound = bound


@dataclass(frozen=True)
class TransformOutcome:
    """What one before-save Flow did.

    Attributes:
        ran: the entry condition held and the transform ran.
        fields: the record's final field values (without ``Id``).
        steps, reads: element executions and records read (budget evidence).
    """

    ran: bool
    fields: Mapping[str, Any]
    steps: int = 0
    reads: int = 0


async def run_before_save(
    plan: ExecutionPlan,
    record_id: str,
    fields: Mapping[str, Any],
    prior: Mapping[str, Any] | None,
    *,
    reader: RecordReader,
    query: RecordQuery | None = None,
) -> TransformOutcome:
    """Run ``plan``'s before-save transform of the record ``record_id``.

    Args:
        fields: the record's field values as they will be written (create: the request's
            values; update: stored values overlaid with the request's changes).
        prior: the stored field values (``None`` for a create).

    Raises:
        BeforeSaveFault: the Flow failed or exceeded its budget; nothing may be written.
    """
    if plan.profile is not ExecutionProfile.EMBEDDED_BEFORE_SAVE:
        raise BeforeSaveFault(
            "not_embedded_before_save", f"plan profile {plan.profile.value} is not before-save"
        )
    step = plan.step(plan.start_step)
    if step.kind is not StepKind.EMBEDDED_TRANSFORM:
        raise BeforeSaveFault("plan_step_invalid", f"start step kind {step.kind.value}")
    env: dict[str, Any] = trigger_env(record_id, fields, prior)
    try:
        if not entry_condition_holds(plan, env):
            return TransformOutcome(False, dict(fields))
        meter = BudgetMeter(step.bounds)
        intents, advance = await run_nodes(
            plan, step, env, reader=reader, query=query, meter=meter, transform=True
        )
    except StepBudgetExceeded as exc:
        raise BeforeSaveFault(exc.code, str(exc), exc.bound) from None
    except StepFault as exc:
        raise BeforeSaveFault(exc.code, str(exc)) from None
    if isinstance(advance, FailRun):
        raise BeforeSaveFault(advance.cause_code, "the before-save Flow ended on its failure path")
    if intents:
        raise BeforeSaveFault(
            "write_outside_trigger_record",
            f"a before-save Flow may change only the trigger record ({len(intents)} other "
            "record mutation(s) refused)",
        )
    record = env.get(TRIGGER)
    if not isinstance(record, dict) or record.get("Id") != record_id:
        raise BeforeSaveFault("trigger_record_replaced", "the Flow replaced $Record or its Id")
    final = {k: to_record_value(v) for k, v in record.items() if k != "Id"}
    return TransformOutcome(True, final, meter.steps, meter.reads)
