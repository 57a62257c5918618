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

Limitations (documented, fail closed): a ``GetRecords`` in the same step after a mutation
does not see that mutation; ``GetRecords`` supports ``Id =`` filters only; external-effect
steps, waits and non-pure actions are later issues and end the run with
``unsupported_step_kind`` / ``unsupported_element``.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler import (
    EdgeKind,
    ExecutionPlan,
    ExpressionEvalError,
    PlanStep,
    StepKind,
    evaluate,
    parse_expression,
)
from runtime_svc.compiler.expressions import ExpressionError
from runtime_svc.compiler.kinds import TerminalOutcome
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
from runtime_svc.records.engine import LockHook
from runtime_svc.records.model import RecordState
from runtime_svc.resources import (
    LateResourceDiscoveryError,
    LockPlan,
    LockRole,
    ResourceClass,
    ResourceKey,
)
from services.errors import NotFoundError

__all__ = [
    "LOOPS_KEY",
    "MAX_LOOP_ITERATIONS",
    "RESOURCE_BOUND_EXCEEDED",
    "RUN_OUTPUT_KEY",
    "SUPPORTED_STEP_KINDS",
    "VISITS_KEY",
    "MutationIntent",
    "RecordReader",
    "ResourceBoundExceeded",
    "StepFault",
    "StepOutcome",
    "apply_intents_txn",
    "check_resource_bounds",
    "interpret",
    "needs_transaction",
    "to_json_value",
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


class StepFault(Exception):
    """A classified, non-retryable failure of the step's own logic (bad data, a missing
    record, an expression error); ``code`` is a stable safe code."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code


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
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    return value


def _eval(text: Any, env: Mapping[str, Any]) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return evaluate(parse_expression(text), env)
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
) -> StepOutcome:
    """Execute ``step``'s nodes over ``context`` (see the module docstring).

    Raises:
        StepFault: a classified, terminal failure of the step's logic, including
            ``unsupported_step_kind`` and ``unsupported_element``.
    """
    env: dict[str, Any] = copy.deepcopy(dict(context))
    if step.kind not in SUPPORTED_STEP_KINDS:
        raise StepFault("unsupported_step_kind", f"{step.kind.value} is not executed yet")
    if step.kind is StepKind.TERMINAL:
        advance: Advance = (
            FailRun("flow_failed") if step.outcome is TerminalOutcome.FAILED else FinishRun()
        )
        return StepOutcome(env, (), advance)
    if step.kind is StepKind.EXPLICIT_FAULT:
        return StepOutcome(env, (), FailRun(step.fault_code or "explicit_fault"))

    nodes = {n.id: n for n in plan.nodes}
    intents: list[MutationIntent] = []
    node_id: str | None = step.entry
    executed = 0
    while node_id is not None and node_id in step.nodes:
        executed += 1
        if executed > _MAX_NODE_EXECUTIONS:
            raise StepFault("step_bound_exceeded")
        node = nodes.get(node_id)
        element = None if node is None else node.element
        if element is None:
            raise StepFault("plan_node_missing", node_id)
        label, next_id = await _run_element(element, env, intents, reader)
        if next_id is not None and next_id in step.nodes:
            node_id = next_id
            continue
        target = _exit_target(step, node_id, label)
        if target is None:
            target = next_id
        advance = _advance_to(plan, target, step.fault_code, env)
        return StepOutcome(to_json_value(env), tuple(intents), advance)
    raise StepFault("plan_entry_missing", str(node_id))


async def _run_element(
    element: Mapping[str, Any],
    env: dict[str, Any],
    intents: list[MutationIntent],
    reader: RecordReader | None,
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
                env[target] = value
            elif op == "add":
                current = env.get(target)
                if isinstance(current, list):
                    env[target] = [*current, value]
                else:
                    env[target] = _eval("a + b", {"a": current or 0, "b": value})
            elif op == "subtract":
                env[target] = _eval("a - b", {"a": env.get(target) or 0, "b": value})
            else:
                raise StepFault("unsupported_element", f"assignment op {op!r}")
        return "next", nxt
    if kind == "Decision":
        for rule in element.get("rules", ()):
            if _eval(rule.get("condition"), env) is True:
                return str(rule.get("name")), rule.get("next")
        return "default", nxt
    if kind == "Loop":
        return _loop_step(element, env)
    if kind == "CreateRecord":
        rid = new_record_id()
        values = {k: to_json_value(_eval(v, env)) for k, v in element.get("fields", {}).items()}
        intents.append(MutationIntent("create", str(element["object"]), rid, values))
        out = element.get("output_variable")
        if out:
            env[str(out)] = {"Id": rid, **values}
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
            rids = list(dict.fromkeys(_record_id(item, str(ref)) for item in target))
        else:
            rids = [_record_id(target, str(ref))]
        obj = str(element["object"])
        if kind == "UpdateRecord":
            values = {k: to_json_value(_eval(v, env)) for k, v in element.get("fields", {}).items()}
            intents.extend(MutationIntent("update", obj, rid, values) for rid in rids)
        else:
            intents.extend(MutationIntent("delete", obj, rid) for rid in rids)
        return "next", nxt
    if kind == "GetRecords":
        return await _get_records(element, env, reader), nxt
    if kind in ("End", "end"):
        return "next", None
    if kind == "Fault":
        raise StepFault(str(element.get("code") or "explicit_fault"))
    raise StepFault("unsupported_element", f"element type {kind!r}")


def _loop_step(element: Mapping[str, Any], env: dict[str, Any]) -> tuple[str | None, str | None]:
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
        env[str(element["item_variable"])] = remaining.pop(0)
        return "each", str(element["each"])
    del loops[node_id]
    if not loops:
        env.pop(LOOPS_KEY, None)
    return "done", element.get("next")


async def _get_records(
    element: Mapping[str, Any], env: dict[str, Any], reader: RecordReader | None
) -> str:
    if reader is None:
        raise StepFault("unsupported_element", "GetRecords outside a read step")
    filters = element.get("filters") or []
    if len(filters) != 1 or filters[0].get("field") != "Id" or filters[0].get("op") != "=":
        raise StepFault("unsupported_element", "GetRecords supports one 'Id =' filter")
    rid = _record_id(_eval(filters[0].get("value"), env), "GetRecords filter")
    found = await reader(str(element["object"]), rid)
    value = None if found is None else {"Id": found.record_id, **dict(found.fields)}
    out = element.get("output_variable")
    if out:
        env[str(out)] = value if element.get("first_only", True) else ([value] if value else [])
    return "next"


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
) -> list[MutationResult]:
    """Validate, lock (one canonical-order acquisition) and apply ``intents`` inside the
    caller's transaction, before the caller enters the Flow lifecycle at the root.

    ``before_writes`` runs once all business locks are held and before the first write
    (snapshot-token verification, §12.2 step 6); raising there rolls everything back.

    ``declared`` (the plan step's resource declarations) bounds the actual resource set:
    it is checked before the first business lock, and a late discovery is re-checked with
    the discovered key added (§13.3).

    Raises:
        StepFault: a referenced record is missing, or a mutation is invalid.
        ResourceBoundExceeded: the resource set (or its expansion by a late discovery)
            leaves the declared classes or bounds (a terminal ``StepFault``).
        LateResourceDiscoveryError: a resource outside the admitted lock plan, within
            the declared bounds (retryable).
    """
    if not intents:
        return []
    mutations: list[RecordMutation] = []
    plan: LockPlan | None = None
    for intent in intents:
        current: RecordState | None = None
        try:
            if intent.kind == "create":
                mutation = prepare_create(view, intent.object_name, intent.record_id, intent.fields)
            else:
                current = await get_record_txn(conn, org_id, intent.object_name, intent.record_id)
                if intent.kind == "update":
                    mutation = prepare_update(
                        view, intent.object_name, intent.record_id, current.version, intent.fields
                    )
                else:
                    mutation = prepare_delete(
                        view, intent.object_name, intent.record_id, current.version
                    )
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
    assert plan is not None
    if declared is not None:
        # §13.3: the step's actual resource set must stay within its declared classes
        # and bounds *before* any business lock is taken.
        check_resource_bounds(declared, plan)
    try:
        locks = await acquire_locks_txn(conn, org_id, view, plan, mutations, on_locked=on_locked)
        if before_writes is not None:
            await before_writes()
        return [
            await apply_mutation_txn(conn, org_id, view, m, locks, actor=actor, lineage=lineage)
            for m in mutations
        ]
    except LateResourceDiscoveryError as exc:
        if declared is not None:
            # The retry's expanded plan must stay within the declared maximum; a
            # discovery beyond it is terminal, never retried (§13.3).
            role = exc.role or LockRole.RECORD
            check_resource_bounds(declared, plan.union(LockPlan.of([(exc.resource_key, role)])))
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
