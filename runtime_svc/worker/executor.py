"""Step interpreter of the Durable Orchestration worker (§7.5, §9.3, §12.2 steps 4-11).

Two phases, so that the only code inside the business transaction is reads, locks and
writes:

* :func:`interpret` — runs a plan step's compiled nodes over the checkpoint context
  (variables plus ``$Record``). It is pure apart from the awaited ``reader`` that serves
  ``GetRecords`` (a current read, run inside the step transaction). Record mutations are
  *not* applied here: they are collected as :class:`MutationIntent` values, in node order,
  and the result says where the run goes next (:class:`StepOutcome`).
* :func:`apply_intents_txn` — turns the intents into validated record mutations, plans
  their locks as one union, takes them once in canonical order
  (:func:`runtime_svc.records.acquire_locks_txn`) and applies them through the record
  engine's composable ``_txn`` functions. Before the first lock the actual resource set is
  checked against the plan step's declared resources (:func:`check_resource_bounds`): an
  undeclared class/object or a count above its bound is a terminal
  :class:`ResourceBoundExceeded`. Late resource discovery within the bound raises and rolls
  the whole step back (the worker records a retryable rollback: the retry starts again
  from the same input checkpoint with the expanded plan).

**Checkpoint context layout** (one layout for every producer — ``StartRun``, after-save
admission, the worker): ``{"variables": {name: value, "$Record": …, "$Record__Prior": …},
"trigger": {…}, "$loops": {…}, "$visits": {…}, "$output": {…}}``. The interpreter's
environment is the ``variables`` map plus the ``$``-prefixed cursor keys
(:func:`env_of`); :func:`context_of` writes it back (``trigger`` is carried unchanged).

**Budgets.** Given a :class:`~runtime_svc.worker.budget.BudgetMeter` (the synchronous
profiles pass one built from the step's compiled bounds), every element execution, record
read, record write and loop-body entry is charged; exhausting a bound raises
:class:`StepBudgetExceeded` (safe code ``budget_exceeded.<bound>``), never retried.

**Actions.** An ``ActionCall`` of a built-in pure action
(:mod:`runtime_svc.worker.actions`) runs inline; any other action fails closed
(``unsupported_action``).

Limitations (documented, fail closed): a ``GetRecords`` in the same step after a mutation
does not see that mutation; ``GetRecords`` supports one ``=`` filter on ``Id`` or on the
lookup field of the object's indexed parent relationship; external-effect steps, waits and
non-pure actions are later issues and end the run with ``unsupported_step_kind`` /
``unsupported_element`` / ``unsupported_action``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler import (
    EdgeKind,
    Evaluator,
    ExecutionPlan,
    ExpressionEvalError,
    PlanStep,
    StepKind,
    evaluator,
    parse_expression,
)
from runtime_svc.compiler.expressions import ExpressionError
from runtime_svc.compiler.kinds import ExecutionProfile, TerminalOutcome
from runtime_svc.compiler.plan import ResourceDecl
from runtime_svc.kernel.decisions import Advance, FailRun, FinishRun, NextStep
from runtime_svc.records import (
    Actor,
    Lineage,
    MutationResult,
    RecordMutation,
    RecordValidationError,
    RecordView,
    acquire_locks_txn,
    apply_mutation_txn,
    get_record_txn,
    new_record_id,
    plan_mutation,
    prepare_create,
    prepare_delete,
    prepare_update,
)
from runtime_svc.records.engine import ChangeSink, LockHook
from runtime_svc.records.locking import RECORD_ENTITY, lock_relevant_relationships
from runtime_svc.records.model import RecordState
from runtime_svc.records.store import (
    lock_record_history_txn,
    query_children_txn,
    record_history_locked,
    record_history_read,
)
from runtime_svc.resources import (
    LateResourceDiscoveryError,
    LockPlan,
    LockRole,
    ResourceClass,
    ResourceKey,
    business_key,
    history_key,
)
from runtime_svc.worker.actions import PureActionError, run_pure_action
from runtime_svc.worker.budget import BudgetExceeded, BudgetMeter
from services.db_batch import Companion, Write, execute_reads
from services.errors import NotFoundError
from services.invariants import InvariantError

__all__ = [
    "LOOPS_KEY",
    "MAX_LOOP_ITERATIONS",
    "RESOURCE_BOUND_EXCEEDED",
    "RUN_OUTPUT_KEY",
    "SUPPORTED_STEP_KINDS",
    "VISITS_KEY",
    "BudgetMeter",
    "MutationIntent",
    "RecordQuery",
    "RecordReader",
    "ResourceBoundExceeded",
    "StepBudgetExceeded",
    "StepFault",
    "StepOutcome",
    "advance_to",
    "apply_intents_txn",
    "check_resource_bounds",
    "context_of",
    "entry_condition_holds",
    "env_of",
    "interpret",
    "meter_for",
    "needs_transaction",
    "record_query",
    "run_nodes",
    "to_json_value",
    "to_record_value",
    "trigger_env",
]

#: Step kinds this worker executes; any other kind fails closed (``unsupported_step_kind``).
SUPPORTED_STEP_KINDS = frozenset(
    {
        StepKind.PURE_COMPUTE,
        StepKind.CURRENT_READ,
        StepKind.VERIFIED_SNAPSHOT_READ,
        StepKind.BOUNDED_MUTATION,
        StepKind.EXPLICIT_FAULT,
        StepKind.TERMINAL,
    }
)
#: Hard bound on loop iterations inside one step (the compiler proves a smaller bound).
MAX_LOOP_ITERATIONS = 10_000
#: Bound on node executions inside one step (defends against a malformed plan cycle).
_MAX_NODE_EXECUTIONS = 100_000
#: Context key under which the committed terminal step records the run's output.
RUN_OUTPUT_KEY = "$output"
#: Context key of the cursors of running loops (node id -> remaining items).
LOOPS_KEY = "$loops"
#: Context key of step invocation counters (plan step key -> invocations created).
VISITS_KEY = "$visits"

#: Safe code of a step whose actual resource set leaves its declared classes or bounds.
RESOURCE_BOUND_EXCEEDED = "resource_bound_exceeded"

#: ``GetRecords`` current read: ``(object, record id) -> record or None``.
RecordReader = Callable[[str, str], Awaitable[RecordState | None]]
#: ``GetRecords`` by a lookup field: ``(object, field, value, limit) -> records`` (at most
#: ``limit``, ordered by record id).
RecordQuery = Callable[[str, str, str, int], Awaitable[list[RecordState]]]
#: Default row limit of a lookup query when no read budget applies.
_DEFAULT_QUERY_LIMIT = 10_000
#: The trigger record variable of a record-triggered Flow.
TRIGGER = "$Record"
#: Context keys that are interpreter cursors, not Flow variables.
_INTERNAL_KEYS = ("$loops", "$visits", "$output")


class StepFault(Exception):
    """A classified, non-retryable failure of the step's own logic (bad data, a missing
    record, an expression error); ``code`` is a stable safe code."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code


class StepBudgetExceeded(StepFault):
    """The step exhausted a compiled bound (§9.1/§9.2): terminal, never retried; the
    code names the bound (``budget_exceeded.max_reads``)."""

    def __init__(self, exc: BudgetExceeded) -> None:
        super().__init__(f"budget_exceeded.{exc.bound}", str(exc))
        self.bound = exc.bound
        self.limit = exc.limit
        self.attempted = exc.attempted


def env_of(context: Mapping[str, Any]) -> dict[str, Any]:
    """The interpreter environment of a checkpoint context (a deep copy)."""
    variables = context.get("variables")
    env: dict[str, Any] = _deep_copy(dict(variables)) if isinstance(variables, Mapping) else {}
    for key in _INTERNAL_KEYS:
        if key in context:
            env[key] = _deep_copy(context[key])
    return env


#: JSON scalars, returned as they are by :func:`to_json_value` (not their subclasses).
_SCALARS = frozenset({str, int, float, bool, type(None)})
_IMMUTABLE = _SCALARS | {Decimal}


def _deep_copy(value: Any) -> Any:
    """``copy.deepcopy`` of a JSON-shaped value (a context's dicts, lists and scalars)
    without its memo and dispatch (several times cheaper on a step's context); any other
    type goes through ``copy.deepcopy``."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict:
        return {k: _deep_copy(v) for k, v in value.items()}
    if kind is list:
        return [_deep_copy(v) for v in value]
    return copy.deepcopy(value)


def context_of(env: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint context of ``env`` (``trigger`` carried over from ``base``)."""
    ctx: dict[str, Any] = {
        "variables": {k: to_json_value(v) for k, v in env.items() if k not in _INTERNAL_KEYS}
    }
    for key in _INTERNAL_KEYS:
        if key in env:
            ctx[key] = to_json_value(env[key])
    if base is not None and "trigger" in base:
        ctx["trigger"] = copy.deepcopy(base["trigger"])
    return ctx


@dataclass(frozen=True)
class MutationIntent:
    """One record mutation a node asked for, applied later inside the step transaction."""

    kind: str  # "create" | "update" | "delete"
    object_name: str
    record_id: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutcome:
    """What executing one step produced: the output context, the record mutations to
    apply in the step transaction, and how the root advances."""

    context: dict[str, Any]
    intents: tuple[MutationIntent, ...]
    advance: Advance


def needs_transaction(step: PlanStep) -> bool:
    """Whether a step reads or writes business state (PureCompute runs without one)."""
    return step.kind in (
        StepKind.CURRENT_READ,
        StepKind.VERIFIED_SNAPSHOT_READ,
        StepKind.BOUNDED_MUTATION,
    )


def to_json_value(value: Any) -> Any:
    """A checkpoint-safe JSON value: exact decimals become ``int`` or their text."""
    kind = type(value)
    if kind in _SCALARS:  # the common case, before the abstract-class checks below
        return value
    if kind is dict:
        return {str(k): to_json_value(v) for k, v in value.items()}
    if kind is list:
        return [to_json_value(v) for v in value]
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    return value


def to_record_value(value: Any) -> Any:
    """A record field value: exact decimals become ``int`` or ``float`` (record number
    fields hold JSON numbers), containers recursively."""
    kind = type(value)
    if kind in _SCALARS:  # the common case, before the abstract-class checks below
        return value
    if kind is dict:
        return {str(k): to_record_value(v) for k, v in value.items()}
    if kind is list:
        return [to_record_value(v) for v in value]
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, Mapping):
        return {str(k): to_record_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_record_value(v) for v in value]
    return value


def trigger_env(
    record_id: str,
    fields: Mapping[str, Any],
    prior: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``$Record`` / ``$Record__Prior`` of a record-triggered Flow (``Id`` included).

    The record maps are fresh (shallow) copies: the interpreter replaces field values,
    never mutates a value in place (``add`` builds a new list).
    """
    return {
        "$Record": {**fields, "Id": record_id},
        "$Record__Prior": None if prior is None else {**prior, "Id": record_id},
    }


def entry_condition_holds(plan: ExecutionPlan, env: Mapping[str, Any]) -> bool:
    """Whether the plan's trigger entry condition holds for ``env`` (no condition: true).

    Raises:
        StepFault: ``expression_error`` (the condition cannot be evaluated) or
            ``entry_condition_not_boolean``.
    """
    trigger = plan.trigger
    condition = None if trigger is None else trigger.get("entry_condition")
    if not condition:
        return True
    value = _eval(condition, env)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise StepFault("entry_condition_not_boolean", "the entry condition is not boolean")
    return value


@functools.lru_cache(maxsize=4096)
def _evaluator(text: str) -> Evaluator:
    """The evaluator of an expression text (plans are immutable, so a text always parses to
    the same tree and makes the same evaluator; parse errors are not cached)."""
    return evaluator(parse_expression(text))


def _eval(text: Any, env: Mapping[str, Any]) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return _evaluator(text)(env)
    except (ExpressionError, ExpressionEvalError) as exc:
        raise StepFault("expression_error", str(exc)) from exc


def _record_id(value: Any, what: str) -> str:
    rid = value.get("Id") if isinstance(value, Mapping) else value
    if not isinstance(rid, str) or not rid:
        raise StepFault("missing_record_id", f"{what} has no record id")
    return rid


def _advance_to(
    plan: ExecutionPlan, target: str | None, fault_code: str | None, env: dict[str, Any]
) -> Advance:
    if target is None:
        return FinishRun()
    try:
        step = plan.step(target)
    except (KeyError, LookupError):
        raise StepFault("plan_target_missing", f"no plan step {target!r}") from None
    if step.kind is StepKind.TERMINAL:
        if step.outcome is TerminalOutcome.FAILED:
            return FailRun(fault_code or "flow_failed")
        return FinishRun()
    # A step revisited (a loop spanning steps) is a new invocation of the same plan step.
    visits: dict[str, int] = env.setdefault(VISITS_KEY, {})
    ordinal = int(visits.get(step.key, 1 if step.key == plan.start_step else 0))
    visits[step.key] = ordinal + 1
    return NextStep(
        step_execution_id="",
        plan_step_key=step.key,
        step_kind=step.kind.value,
        queue_class=(step.queue_class.value if step.queue_class else "durable_mutation"),
        invocation_ordinal=ordinal,
    )


def advance_to(
    plan: ExecutionPlan, target: str | None, fault_code: str | None, env: dict[str, Any]
) -> Advance:
    """How the root advances to plan step ``target`` (``None``: the run succeeds); a
    revisited step gets its next invocation ordinal (counted in ``env``).

    Raises:
        StepFault: ``plan_target_missing``.
    """
    return _advance_to(plan, target, fault_code, env)


def _exit_target(step: PlanStep, node_id: str, label: str | None) -> str | None:
    """The plan target of leaving ``step`` from ``node_id`` (by edge label when given)."""
    edges = [
        t
        for t in step.transitions
        if t.source == node_id and t.kind in (EdgeKind.SUCCESS, EdgeKind.TERMINAL)
    ]
    if label is not None:
        for t in edges:
            if t.label == label:
                return t.target
    return edges[0].target if len(edges) == 1 else None


async def interpret(
    plan: ExecutionPlan,
    step: PlanStep,
    context: Mapping[str, Any],
    *,
    reader: RecordReader | None = None,
    query: RecordQuery | None = None,
    meter: BudgetMeter | None = None,
    trace: list[str] | None = None,
) -> StepOutcome:
    """Execute ``step``'s nodes over the checkpoint ``context`` (see the module docstring).

    ``trace`` (shadow comparison, §20.5) receives the id of every node executed.

    Raises:
        StepFault: a classified, terminal failure of the step's logic, including
            ``unsupported_step_kind``, ``unsupported_element`` and
            :class:`StepBudgetExceeded`.
    """
    env = env_of(context)
    if step.kind not in SUPPORTED_STEP_KINDS:
        raise StepFault("unsupported_step_kind", f"{step.kind.value} is not executed yet")
    if step.kind is StepKind.TERMINAL:
        advance: Advance = (
            FailRun("flow_failed") if step.outcome is TerminalOutcome.FAILED else FinishRun()
        )
        return StepOutcome(context_of(env, context), (), advance)
    if step.kind is StepKind.EXPLICIT_FAULT:
        return StepOutcome(
            context_of(env, context), (), FailRun(step.fault_code or "explicit_fault")
        )
    intents, advance = await run_nodes(
        plan, step, env, reader=reader, query=query, meter=meter, trace=trace
    )
    return StepOutcome(context_of(env, context), tuple(intents), advance)


async def run_nodes(
    plan: ExecutionPlan,
    step: PlanStep,
    env: dict[str, Any],
    *,
    reader: RecordReader | None = None,
    query: RecordQuery | None = None,
    meter: BudgetMeter | None = None,
    transform: bool = False,
    trace: list[str] | None = None,
) -> tuple[list[MutationIntent], Advance]:
    """Walk ``step``'s nodes from its entry, mutating ``env`` in place; returns the
    mutation intents (node order) and where the run goes next.

    Declared variables missing from ``env`` start as ``None`` (collections: ``[]``).
    ``transform`` (Embedded Before-Save) turns an ``UpdateRecord`` of ``$Record`` into an
    in-place change of ``env["$Record"]`` — the caller's row, not a write.

    Raises:
        StepFault: see :func:`interpret`.
    """
    for var in plan.variables:
        env.setdefault(var.name, [] if var.type.startswith("list<") else None)
    nodes = {n.id: n for n in plan.nodes}
    intents: list[MutationIntent] = []
    node_id: str | None = step.entry
    executed = 0
    try:
        while node_id is not None and node_id in step.nodes:
            executed += 1
            if executed > _MAX_NODE_EXECUTIONS:
                raise StepFault("step_bound_exceeded")
            if meter is not None:
                meter.step()
            if trace is not None:
                trace.append(node_id)
            node = nodes.get(node_id)
            element = None if node is None else node.element
            if element is None:
                raise StepFault("plan_node_missing", node_id)
            label, next_id = await _run_element(
                element, env, intents, reader, query, meter, transform
            )
            if next_id is not None and next_id in step.nodes:
                node_id = next_id
                continue
            target = _exit_target(step, node_id, label)
            if target is None:
                target = next_id
            return intents, _advance_to(plan, target, step.fault_code, env)
    except BudgetExceeded as exc:
        raise StepBudgetExceeded(exc) from None
    raise StepFault("plan_entry_missing", str(node_id))


def _assign(env: dict[str, Any], target: str, value: Any) -> None:
    """Set a variable, or one field of a record variable (``$Record.Discount``)."""
    root, dot, path = target.partition(".")
    if not dot:
        env[target] = value
        return
    holder = env.get(root)
    if holder is None:
        holder = env[root] = {}
    if not isinstance(holder, dict) or "." in path:
        raise StepFault("assignment_target_invalid", f"cannot assign {target}")
    holder[path] = value


def _current(env: Mapping[str, Any], target: str) -> Any:
    root, dot, path = target.partition(".")
    holder = env.get(root)
    if not dot:
        return holder
    return holder.get(path) if isinstance(holder, Mapping) else None


async def _run_element(
    element: Mapping[str, Any],
    env: dict[str, Any],
    intents: list[MutationIntent],
    reader: RecordReader | None,
    query: RecordQuery | None,
    meter: BudgetMeter | None,
    transform: bool,
) -> tuple[str | None, str | None]:
    """Run one element; returns ``(edge label, next element)``."""
    kind = element.get("type")
    nxt = element.get("next")
    if kind == "Assignment":
        for a in element.get("assignments", ()):
            value = _eval(a.get("value"), env)
            op = a.get("op", "set")
            target = str(a["target"])
            if op == "set":
                _assign(env, target, value)
            elif op == "add":
                current = _current(env, target)
                if isinstance(current, list):
                    _assign(env, target, [*current, value])
                else:
                    _assign(env, target, _eval("a + b", {"a": current or 0, "b": value}))
            elif op == "subtract":
                current = _current(env, target)
                _assign(env, target, _eval("a - b", {"a": current or 0, "b": value}))
            elif op == "add_item":
                # docs/flow-language.md §4: add one item to a collection (null = empty).
                current = _current(env, target)
                if current is not None and not isinstance(current, list):
                    raise StepFault("assignment_target_invalid", f"{target} is not a collection")
                _assign(env, target, [*(current or []), value])
            else:
                raise StepFault("unsupported_element", f"assignment op {op!r}")
        return "next", nxt
    if kind == "Decision":
        for rule in element.get("rules", ()):
            if _eval(rule.get("condition"), env) is True:
                return str(rule.get("name")), rule.get("next")
        return "default", nxt
    if kind == "Loop":
        return _loop_step(element, env, meter)
    if kind == "ActionCall":
        return _action(element, env)
    if kind == "CreateRecord":
        rid = new_record_id()
        values = {k: to_record_value(_eval(v, env)) for k, v in element.get("fields", {}).items()}
        if meter is not None:
            meter.write(1)
        intents.append(MutationIntent("create", str(element["object"]), rid, values))
        out = element.get("output_variable")
        if out:
            env[str(out)] = {"Id": rid, **values}
        return "next", nxt
    if kind == "UpdateRecord" and transform and str(element.get("record", "")).strip() == TRIGGER:
        # Embedded Before-Save: the trigger record's in-transaction transform, not a write.
        holder = env.get(TRIGGER)
        if not isinstance(holder, dict):
            raise StepFault("trigger_record_missing", "no $Record to transform")
        values = {k: to_record_value(_eval(v, env)) for k, v in element.get("fields", {}).items()}
        holder.update(values)
        return "next", nxt
    if kind in ("UpdateRecord", "DeleteRecord"):
        ref = element.get("record")
        if not ref:
            raise StepFault("unsupported_element", f"{kind} without a record variable")
        target = _eval(ref, env)
        if isinstance(target, list | tuple):
            # A collection variable: one mutation per distinct record (the compiler
            # declares the collection's ``max_items`` as the step's resource bound).
            if len(target) > MAX_LOOP_ITERATIONS:
                raise StepFault("loop_bound_exceeded", str(ref))
            if meter is not None:
                meter.check_collection(len(target))
            rids = list(dict.fromkeys(_record_id(item, str(ref)) for item in target))
        else:
            rids = [_record_id(target, str(ref))]
        obj = str(element["object"])
        if meter is not None:
            meter.write(len(rids))
        if kind == "UpdateRecord":
            values = {
                k: to_record_value(_eval(v, env)) for k, v in element.get("fields", {}).items()
            }
            intents.extend(MutationIntent("update", obj, rid, values) for rid in rids)
        else:
            intents.extend(MutationIntent("delete", obj, rid) for rid in rids)
        return "next", nxt
    if kind == "GetRecords":
        return await _get_records(element, env, reader, query, meter), nxt
    if kind in ("End", "end"):
        return "next", None
    if kind == "Fault":
        raise StepFault(str(element.get("code") or "explicit_fault"))
    raise StepFault("unsupported_element", f"element type {kind!r}")


def _action(element: Mapping[str, Any], env: dict[str, Any]) -> tuple[str | None, str | None]:
    """A pure ``ActionCall``: evaluated inputs -> built-in handler -> output variable.
    Bad input follows the element's ``fault`` connector when it has one."""
    action_type = str(element.get("action_type") or "")
    inputs = {str(k): _eval(v, env) for k, v in (element.get("inputs") or {}).items()}
    try:
        result = run_pure_action(action_type, inputs)
    except KeyError:
        raise StepFault(
            "unsupported_action", f"action {action_type!r} has no inline handler"
        ) from None
    except PureActionError as exc:
        if element.get("fault"):
            return "fault", str(element["fault"])
        raise StepFault("action_failed", f"{action_type}: {exc}") from exc
    out = element.get("output_variable")
    if out:
        _assign(env, str(out), to_json_value(result))
    return "next", element.get("next")


def _loop_step(
    element: Mapping[str, Any], env: dict[str, Any], meter: BudgetMeter | None
) -> tuple[str | None, str | None]:
    """A ``Loop`` node: the body (``each``) returns to this node after every item. The
    remaining items live in the context under :data:`LOOPS_KEY` — a Durable Orchestration
    loop spans steps, so its cursor is part of the checkpoint (bounded by the collection,
    evaluated once when the loop starts)."""
    node_id = str(element["api_name"])
    loops: dict[str, list[Any]] = env.setdefault(LOOPS_KEY, {})
    if node_id not in loops:
        items = _eval(element.get("collection"), env)
        if items is None:
            items = []
        if not isinstance(items, list):
            raise StepFault("loop_collection_invalid", f"{node_id} iterates a non-collection")
        if len(items) > MAX_LOOP_ITERATIONS:
            raise StepFault("loop_bound_exceeded", node_id)
        loops[node_id] = list(items)
    remaining = loops[node_id]
    if remaining and element.get("each"):
        if meter is not None:
            meter.fan_out(1)
        env[str(element["item_variable"])] = remaining.pop(0)
        return "each", str(element["each"])
    del loops[node_id]
    if not loops:
        env.pop(LOOPS_KEY, None)
    return "done", element.get("next")


async def _get_records(
    element: Mapping[str, Any],
    env: dict[str, Any],
    reader: RecordReader | None,
    query: RecordQuery | None,
    meter: BudgetMeter | None,
) -> str:
    if reader is None:
        raise StepFault("unsupported_element", "GetRecords outside a read step")
    filters = element.get("filters") or []
    if len(filters) != 1 or filters[0].get("op") != "=":
        raise StepFault("unsupported_element", "GetRecords supports one '=' filter")
    obj, field_name = str(element["object"]), str(filters[0].get("field"))
    first_only = bool(element.get("first_only", False))
    found: list[RecordState]
    if field_name == "Id":
        rid = _record_id(_eval(filters[0].get("value"), env), "GetRecords filter")
        one = await reader(obj, rid)
        found = [] if one is None else [one]
    else:
        if query is None:
            raise StepFault("unsupported_element", f"GetRecords by {field_name} here")
        value = _eval(filters[0].get("value"), env)
        if not isinstance(value, str) or not value:
            found = []
        else:
            limit = _DEFAULT_QUERY_LIMIT
            if meter is not None:
                budget = meter.limit("max_reads")
                if budget is not None:
                    # One row past the remaining budget proves an overrun without
                    # reading an unbounded result.
                    limit = max(budget - meter.reads, 0) + 1
            declared = element.get("limit")
            if isinstance(declared, int) and declared > 0:
                limit = min(limit, declared)
            found = await query(obj, field_name, value, 1 if first_only else limit)
    if meter is not None:
        meter.read(len(found))
    values = [{"Id": r.record_id, **dict(r.fields)} for r in found]
    out = element.get("output_variable")
    if out:
        env[str(out)] = (values[0] if values else None) if first_only else values
    return "next"


def record_query(conn: AsyncConnection, org_id: str, view: RecordView) -> RecordQuery:
    """The ``GetRecords``-by-lookup query of a step transaction: the lookup field must be
    the object's indexed parent relationship, else the element fails closed."""

    async def query(object_name: str, field_name: str, value: str, limit: int) -> list[RecordState]:
        rel = view.indexed_relationship(object_name)
        if rel is None or rel.field != field_name:
            raise StepFault(
                "unsupported_element",
                f"GetRecords on {object_name} by {field_name}: only Id or the indexed "
                "parent lookup can be queried",
            )
        return await query_children_txn(
            conn, org_id, object_name, rel.parent_object, field_name, value, limit
        )

    return query


def meter_for(plan: ExecutionPlan, step: PlanStep) -> BudgetMeter | None:
    """The budget meter of a synchronous-profile step (``None``: Durable Orchestration,
    whose steps are bounded by their resource declarations and the worker's caps)."""
    if plan.profile in (ExecutionProfile.BOUNDED_ATOMIC, ExecutionProfile.EMBEDDED_BEFORE_SAVE):
        return BudgetMeter(step.bounds)
    return None


async def apply_intents_txn(
    conn: AsyncConnection,
    org_id: str,
    view: RecordView,
    intents: Sequence[MutationIntent],
    *,
    actor: Actor,
    lineage: Lineage,
    on_locked: LockHook | None = None,
    before_writes: Callable[[], Awaitable[None]] | None = None,
    declared: Sequence[ResourceDecl] | None = None,
    observed: Mapping[tuple[str, str], int] | None = None,
    admitted: list[LockPlan] | None = None,
    changes: ChangeSink | None = None,
    defer: list[Write] | None = None,
    lifecycle: Companion | None = None,
) -> list[MutationResult]:
    """Validate, lock (one canonical-order acquisition) and apply ``intents`` inside the
    caller's transaction, before the caller enters the Flow lifecycle at the root.

    ``defer`` (a durable step's commit, ADR 0011): for a single intent — nothing of the
    step's own runs after it — its checked writes (record compare-and-swap with the
    history advance, event and audit rows) are appended to this list instead of
    executed, for the caller to send after the lifecycle locks and revalidation, in the
    commit's round trip (§12.2 steps 9-11). Several intents execute their writes here as
    always (a later mutation may depend on an earlier one's rows).

    ``lifecycle`` (the kernel's locking read of the step's root, step and attempt,
    ``FlowRunStateStore.lifecycle_lock``): for one update/delete of an object without
    lock-relevant relationships and no ``before_writes`` — the record and its history row
    are the step's only business locks, and nothing runs between them and the lifecycle
    locks — it is sent right after the record's locking read, in its round trip, and its
    rows are left in it for the commit (ADR 0011's amendment). For one create whose
    record and history row end its lock plan (no parent locked after them) and no
    ``before_writes``, it rides after their INSERTs in the same way (ADR 0016).
    Otherwise it is left unsent and the commit reads it as always.

    ``before_writes`` runs once all business locks are held and before the first write
    (snapshot-token verification, §12.2 step 6); raising there rolls everything back.

    ``observed`` maps ``(object, record id)`` to the version the step's own reads saw; an
    update/delete of such a record is compare-and-swapped against it.

    ``declared`` (the plan step's resource declarations) bounds the actual resource set:
    it is checked before the first business lock, and a late discovery is re-checked with
    the discovered key added (§13.3); the error then carries that expanded plan as
    ``expanded_plan`` for the retry's evidence. ``admitted`` (when given) receives the
    lock plan the intents were applied under.

    ``changes`` (the record-change wake-signal producer) writes its signals in this
    transaction, after each mutation's derived rows.

    Raises:
        StepFault: a referenced record is missing, or a mutation is invalid.
        ResourceBoundExceeded: the resource set (or its expansion by a late discovery)
            leaves the declared classes or bounds (a terminal ``StepFault``).
        LateResourceDiscoveryError: a resource outside the admitted lock plan, within
            the declared bounds (retryable).
    """
    if not intents:
        return []
    if len(intents) == 1 and intents[0].kind != "create":
        lone = intents[0]
        if not lock_relevant_relationships(view, lone.object_name):
            return await _apply_lone_txn(
                conn,
                org_id,
                view,
                lone,
                actor=actor,
                lineage=lineage,
                on_locked=on_locked,
                before_writes=before_writes,
                declared=declared,
                observed=observed,
                admitted=admitted,
                changes=changes,
                defer=defer,
                lifecycle=lifecycle if before_writes is None else None,
            )
    if len(intents) != 1:
        defer = None
    mutations: list[RecordMutation] = []
    plan: LockPlan | None = None
    for intent in intents:
        current: RecordState | None = None
        try:
            if intent.kind == "create":
                mutation = prepare_create(view, intent.object_name, intent.record_id, intent.fields)
            else:
                current = await get_record_txn(conn, org_id, intent.object_name, intent.record_id)
                # The version this step read is the one its values derive from: a write
                # committed since then is a conflict (the whole step retries from its
                # input checkpoint), never a lost update. A record the step did not read
                # is written at the version found under its lock.
                expected = (observed or {}).get((intent.object_name, intent.record_id))
                if intent.kind == "update":
                    mutation = prepare_update(
                        view, intent.object_name, intent.record_id, expected, intent.fields
                    )
                else:
                    mutation = prepare_delete(view, intent.object_name, intent.record_id, expected)
        except NotFoundError as exc:
            if before_writes is not None:
                # A verified snapshot record that vanished is a changed snapshot, not
                # bad data: let verification classify it (the step rolls back either way).
                await before_writes()
            raise StepFault("record_not_found", str(exc)) from exc
        except RecordValidationError as exc:
            raise StepFault("record_invalid", str(exc)) from exc
        mutations.append(mutation)
        one = plan_mutation(view, mutation, current)
        plan = one if plan is None else plan.union(one)
    if plan is None:
        raise InvariantError("a mutation step produced no lock plan")
    if admitted is not None:
        admitted[:] = [plan]
    if declared is not None:
        # §13.3: the step's actual resource set must stay within its declared classes
        # and bounds *before* any business lock is taken.
        check_resource_bounds(declared, plan)
    # A lone create: its record and history row are the plan's last locks and nothing
    # runs between them and the lifecycle locks — the lifecycle read rides in their
    # round trip where the plan allows (ADR 0016).
    rides = len(intents) == 1 and intents[0].kind == "create" and before_writes is None
    try:
        locks = await acquire_locks_txn(
            conn,
            org_id,
            view,
            plan,
            mutations,
            on_locked=on_locked,
            then=lifecycle if rides else None,
        )
        if before_writes is not None:
            await before_writes()
        return [
            await apply_mutation_txn(
                conn,
                org_id,
                view,
                m,
                locks,
                actor=actor,
                lineage=lineage,
                changes=changes,
                defer=defer,
            )
            for m in mutations
        ]
    except LateResourceDiscoveryError as exc:
        _expand(exc, plan, declared)
        raise


def _expand(
    exc: LateResourceDiscoveryError, plan: LockPlan, declared: Sequence[ResourceDecl] | None
) -> None:
    """Give a late discovery its expanded plan for the retry's evidence. The retry's
    expanded plan must stay within the declared maximum; a discovery beyond it is
    terminal, never retried (§13.3 step 4: raises :class:`ResourceBoundExceeded`)."""
    role = exc.role or LockRole.RECORD
    expanded = plan.union(LockPlan.of([(exc.resource_key, role)]))
    if declared is not None:
        check_resource_bounds(declared, expanded)
    exc.expanded_plan = expanded


async def _apply_lone_txn(
    conn: AsyncConnection,
    org_id: str,
    view: RecordView,
    intent: MutationIntent,
    *,
    actor: Actor,
    lineage: Lineage,
    on_locked: LockHook | None,
    before_writes: Callable[[], Awaitable[None]] | None,
    declared: Sequence[ResourceDecl] | None,
    observed: Mapping[tuple[str, str], int] | None,
    admitted: list[LockPlan] | None,
    changes: ChangeSink | None,
    defer: list[Write] | None,
    lifecycle: Companion | None = None,
) -> list[MutationResult]:
    """:func:`apply_intents_txn` for one update/delete of an object without
    lock-relevant relationships (the common durable step).

    No parent can enter its plan: it is the record, then its history row — known
    before any read (``plan_mutation`` without the stored row). So the bounds are
    checked first (§13.3, before any business lock) and the one read the step needs is
    the record's ``FOR UPDATE``, the plan's first lock in §13.1 order, handed to
    :func:`acquire_locks_txn` instead of a plain read followed by the same row's lock
    (one statement fewer; ``RecordEngine.mutate_txn`` does the same for a
    ``RecordService`` write)."""
    obj, rid = intent.object_name, intent.record_id
    expected = (observed or {}).get((obj, rid))
    try:
        if intent.kind == "update":
            mutation = prepare_update(view, obj, rid, expected, intent.fields)
        else:
            mutation = prepare_delete(view, obj, rid, expected)
    except RecordValidationError as exc:
        raise StepFault("record_invalid", str(exc)) from exc
    plan = plan_mutation(view, mutation, None)
    if admitted is not None:
        admitted[:] = [plan]
    if declared is not None:
        check_resource_bounds(declared, plan)
    # The lock also carries the database clock: the transaction's db_now, so neither the
    # lock phase nor the kernel's commit reads it again (one round trip fewer).
    # With the history row's lock, the plan's next key (one statement for both).
    if lifecycle is None:
        row, last = await lock_record_history_txn(conn, org_id, obj, rid, clocked=True)
    else:
        # The lifecycle locks follow the record's and its history row's in the §13.1
        # order with nothing between them: one round trip where the backend allows.
        business, lifecycle.rows = await execute_reads(
            conn, [record_history_read(conn.dialect, org_id, obj, rid), lifecycle.read]
        )
        row, last = record_history_locked(conn, business)
    if row is None or row.is_deleted:
        if before_writes is not None:
            await before_writes()  # a vanished snapshot record: let verification classify it
        raise StepFault("record_not_found", str(NotFoundError(RECORD_ENTITY, f"{obj}/{rid}")))
    if plan_mutation(view, mutation, row) != plan:
        raise InvariantError("an unparented record's lock plan depends on its stored row")
    try:
        locks = await acquire_locks_txn(
            conn,
            org_id,
            view,
            plan,
            [mutation],
            on_locked=on_locked,
            locked={business_key(obj, rid): row},
            locked_history={history_key(obj, rid): last},
        )
        if before_writes is not None:
            await before_writes()
        return [
            await apply_mutation_txn(
                conn,
                org_id,
                view,
                mutation,
                locks,
                actor=actor,
                lineage=lineage,
                changes=changes,
                defer=defer,
            )
        ]
    except LateResourceDiscoveryError as exc:
        _expand(exc, plan, declared)
        raise


#: Lock role -> declared resource class of the compiled plan (``ResourceDecl``).
_DECLARED_CLASS = {LockRole.RECORD: "record", LockRole.PARENT: "parent_record"}


class ResourceBoundExceeded(StepFault):
    """A step's actual resources leave its declared classes or bounds (§13.3): the step
    rolls back with nothing written and the run ends terminally (never retried)."""

    def __init__(self, message: str) -> None:
        super().__init__(RESOURCE_BOUND_EXCEEDED, message)


def check_resource_bounds(declared: Sequence[ResourceDecl], plan: LockPlan) -> None:
    """Refuse a lock plan outside the plan step's declared resources (pure).

    Business rows are counted per declared ``(resource class, object)``: a mutated record
    as ``record`` of its object, a lock-relevant parent row as ``parent_record`` of the
    parent object (a row with both roles counts under both). The limit of a pair is the sum
    of the bounds of its declarations (``None``: unbounded). History-sequence rows are one
    per mutated record, so the record bound already bounds them; they are not counted
    separately (the compiler declares them only for history-tracked objects).

    Raises:
        ResourceBoundExceeded: an undeclared class/object, or a count above its bound.
    """
    limits: dict[tuple[str, str], int | None] = {}
    for decl in declared:
        pair = (decl.resource_class, decl.object)
        if pair in limits:
            prior = limits[pair]
            limits[pair] = None if prior is None or decl.bound is None else prior + decl.bound
        else:
            limits[pair] = decl.bound
    actual: dict[tuple[str, str], set[ResourceKey]] = {}
    for key in plan.of_class(ResourceClass.BUSINESS_RECORD):
        for role in plan.roles[key]:
            cls = _DECLARED_CLASS.get(role)
            if cls is not None:
                actual.setdefault((cls, key.object_or_namespace), set()).add(key)
    for (cls, obj), keys in sorted(actual.items()):
        if (cls, obj) not in limits:
            raise ResourceBoundExceeded(f"{cls} of {obj} is not declared by the plan step")
        limit = limits[(cls, obj)]
        if limit is not None and len(keys) > limit:
            raise ResourceBoundExceeded(
                f"{len(keys)} {cls} resources of {obj} exceed the declared bound {limit}"
            )
