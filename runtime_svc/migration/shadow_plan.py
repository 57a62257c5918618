"""The V2 side of a shadow comparison: the compiled plan, step by step, on a fixture.

Each step is executed by the V2 step interpreter itself
(:func:`runtime_svc.worker.executor.interpret`, with the budget meter of the synchronous
profiles) — the code the workers run — over an in-memory checkpoint context and the
fixture records; the mutation intents a step returns are applied to the fixture copy, never
to the database. What the worker delegates to other subsystems is driven here from the
scenario's replays, along the plan's own transitions: a ``DependencyWait`` resumes or
expires (fault successor, terminal failure or quarantine per the compiled policy), an
``EffectSubmit`` records the effect it would hand off (never sends it) and its
``EffectCompletion`` applies the replayed owner outcome through the success or fault edge.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

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
from runtime_svc.compiler.kinds import ExpiryPolicy, TerminalOutcome
from runtime_svc.kernel.decisions import FailRun, FinishRun, NextStep
from runtime_svc.migration.shadow_fixture import (
    SHADOW_NOW,
    FixtureRecords,
    initial_variables_of,
    normalize_writes,
    observed_classes,
    rename,
)
from runtime_svc.migration.shadow_model import Observation, Scenario
from runtime_svc.records import RecordView
from runtime_svc.records.model import RecordState
from runtime_svc.worker.executor import (
    StepFault,
    context_of,
    env_of,
    interpret,
    meter_for,
    run_nodes,
    to_json_value,
)

__all__ = ["run_plan"]

_MAX_STEPS = 10_000


def _state(object_name: str, row: Mapping[str, Any]) -> RecordState:
    fields = {k: v for k, v in row.items() if k != "Id"}
    return RecordState(
        org_id="shadow",
        object_name=object_name,
        record_id=str(row["Id"]),
        version=1,
        fields=fields,
        parent_refs=(),
        is_deleted=False,
        created_at=SHADOW_NOW,
        updated_at=SHADOW_NOW,
    )


class _Run:
    """One plan walk over one scenario."""

    def __init__(self, plan: ExecutionPlan, scenario: Scenario, view: RecordView | None) -> None:
        self.plan = plan
        self.scenario = scenario
        self.view = view
        self.records = FixtureRecords.of(scenario)
        self.nodes = {n.id: n for n in plan.nodes}
        self.trace: list[str] = []
        self.writes: list[tuple[str, str, str, Mapping[str, Any]]] = []
        self.effects: list[tuple[str, str, Mapping[str, Any]]] = []
        self.projections: list[tuple[str, str | None]] = []

    async def reader(self, object_name: str, record_id: str) -> RecordState | None:
        row = self.records.get(object_name, record_id)
        return None if row is None else _state(object_name, row)

    async def query(
        self, object_name: str, field_name: str, value: str, limit: int
    ) -> list[RecordState]:
        rel = None if self.view is None else self.view.indexed_relationship(object_name)
        if rel is None or rel.field != field_name:
            raise StepFault("unsupported_element", f"GetRecords by {field_name}")
        return [
            _state(object_name, r)
            for r in self.records.query(object_name, field_name, value, limit)
        ]

    def element(self, node_id: str) -> Mapping[str, Any]:
        node = self.nodes.get(node_id)
        if node is None or node.element is None:
            raise StepFault("plan_node_missing", node_id)
        return node.element

    def target(
        self, step: PlanStep, *, kinds: tuple[EdgeKind, ...], label: str | None = None
    ) -> str | None:
        for t in step.transitions:
            if t.source == step.entry and t.kind in kinds and (label is None or t.label == label):
                return t.target
        return None

    def advance(
        self, target: str | None, fault_code: str | None = None
    ) -> FinishRun | FailRun | str:
        if target is None:
            return FinishRun()
        step = self.plan.step(target)
        if step.kind is StepKind.TERMINAL:
            if step.outcome is TerminalOutcome.FAILED:
                return FailRun(fault_code or "flow_failed")
            return FinishRun()
        return target

    def apply(self, intents: Any) -> None:
        for intent in intents:
            self.records.apply(intent.kind, intent.object_name, intent.record_id, intent.fields)
            self.writes.append((intent.kind, intent.object_name, intent.record_id, intent.fields))

    def eval(self, text: Any, env: Mapping[str, Any]) -> Any:
        if not isinstance(text, str):
            return text
        try:
            return evaluate(parse_expression(text), env)
        except (ExpressionError, ExpressionEvalError) as exc:
            raise StepFault("expression_error", str(exc)) from exc

    # --- steps the worker delegates -----------------------------------------------------

    def wait(self, step: PlanStep, context: dict[str, Any]) -> FinishRun | FailRun | str:
        self.trace.append(step.entry)
        self.projections.append(("Paused", step.key))
        replay = self.scenario.waits.get(step.entry, {})
        element = self.element(step.entry)
        dependency = step.dependency
        is_time = dependency is not None and dependency.producer_kind == "runtime.timer"
        action_wait = element.get("type") == "ActionCall"
        if "resume" in replay and not action_wait and not self.holds(step, context, replay):
            replay = {"expire": True}  # the evidence does not satisfy the condition
        if "resume" in replay or (is_time and not replay.get("expire")):
            if action_wait and element.get("output_variable"):
                evidence = replay.get("resume")
                result = evidence.get("result") if isinstance(evidence, Mapping) else evidence
                context["variables"][str(element["output_variable"])] = to_json_value(result)
            return self.advance(
                self.target(step, kinds=(EdgeKind.WAIT, EdgeKind.SUCCESS, EdgeKind.TERMINAL))
            )
        if action_wait and "resume" not in replay and not replay.get("expire"):
            raise _StillWaiting
        policy = None if dependency is None else dependency.expiry_policy
        if policy is ExpiryPolicy.FAULT_PATH:
            return self.advance(self.target(step, kinds=(EdgeKind.FAULT,), label="expired"))
        if policy is ExpiryPolicy.QUARANTINE:
            raise _Quarantined("wait_expired", step.entry)
        return FailRun("wait_expired")

    def holds(self, step: PlanStep, context: dict[str, Any], replay: Mapping[str, Any]) -> bool:
        """The compiled dependency condition over ``$Event`` (no condition: true)."""
        condition = None if step.dependency is None else step.dependency.condition
        if not condition:
            return True
        evidence = replay.get("resume")
        env = {**env_of(context), "$Event": dict(evidence) if isinstance(evidence, Mapping) else {}}
        return self.eval(condition, env) is True

    def submit(self, step: PlanStep, context: dict[str, Any]) -> FinishRun | FailRun | str:
        self.trace.append(step.entry)
        element = self.element(step.entry)
        env = env_of(context)
        inputs = {str(k): self.eval(v, env) for k, v in (element.get("inputs") or {}).items()}
        self.effects.append((step.entry, str(element["action_type"]), inputs))
        return self.advance(self.target(step, kinds=(EdgeKind.WAIT,)))

    def completion(self, step: PlanStep, context: dict[str, Any]) -> FinishRun | FailRun | str:
        self.projections.append(("Paused", step.key))
        element = self.element(step.entry)
        replay = self.scenario.effects.get(step.entry, {"ok": True, "value": None})
        if replay.get("ok", True):
            out = element.get("output_variable")
            if out:
                context["variables"][str(out)] = to_json_value(replay.get("value"))
            return self.advance(self.target(step, kinds=(EdgeKind.SUCCESS, EdgeKind.TERMINAL)))
        code = str(replay.get("code") or "effect_failed")
        fault = self.target(step, kinds=(EdgeKind.FAULT,), label="fault")
        if fault is None:
            return FailRun(code)
        return self.advance(fault, code)


class _StillWaiting(Exception):
    """The scenario leaves an action wait unresolved."""


class _Quarantined(Exception):
    def __init__(self, code: str, element: str) -> None:
        super().__init__(code)
        self.code = code
        self.element = element


async def run_plan(
    plan: ExecutionPlan, scenario: Scenario, *, view: RecordView | None
) -> Observation:
    """Walk the compiled plan on ``scenario`` (module docstring)."""
    run = _Run(plan, scenario, view)
    variables, trigger = initial_variables_of(scenario)
    context: dict[str, Any] = {"variables": {k: to_json_value(v) for k, v in variables.items()}}
    if trigger is not None:
        context["trigger"] = trigger
    key: str = plan.start_step
    outcome, code, element = "waiting", None, None
    try:
        for _ in range(_MAX_STEPS):
            step = plan.step(key)
            nxt: FinishRun | FailRun | str
            if step.kind is StepKind.DEPENDENCY_WAIT:
                nxt = run.wait(step, context)
            elif step.kind is StepKind.EFFECT_SUBMIT:
                nxt = run.submit(step, context)
            elif step.kind is StepKind.EFFECT_COMPLETION:
                nxt = run.completion(step, context)
            elif step.kind is StepKind.EXPLICIT_FAULT:
                run.trace.append(step.entry)
                nxt = FailRun(step.fault_code or "explicit_fault")
            elif step.kind is StepKind.EMBEDDED_TRANSFORM:
                env = env_of(context)
                intents, advance = await run_nodes(
                    plan,
                    step,
                    env,
                    reader=run.reader,
                    query=run.query,
                    meter=meter_for(plan, step),
                    transform=True,
                    trace=run.trace,
                )
                run.apply(intents)
                context = context_of(env, context)
                nxt = _next(advance)
            else:
                result = await interpret(
                    plan,
                    step,
                    context,
                    reader=run.reader,
                    query=run.query,
                    meter=meter_for(plan, step),
                    trace=run.trace,
                )
                run.apply(result.intents)
                context = result.context
                nxt = _next(result.advance)
            if isinstance(nxt, FinishRun):
                outcome = "succeeded"
                break
            if isinstance(nxt, FailRun):
                outcome, code = "failed", nxt.cause_code
                element = run.trace[-1] if run.trace else None
                break
            key = nxt
    except StepFault as fault:
        outcome, code = "failed", fault.code
        element = run.trace[-1] if run.trace else None
    except _Quarantined as q:
        outcome, code, element = "quarantined", q.code, q.element
    except _StillWaiting:
        outcome = "waiting"
    if outcome != "waiting":
        run.projections.append(("Finished", None) if outcome == "succeeded" else ("Error", None))
    normalized, names = normalize_writes(run.writes)
    env = env_of(context)
    declared = [v.name for v in plan.variables if v.output]
    outputs: dict[str, Any] = {}
    if outcome == "succeeded":
        outputs = {n: env.get(n) for n in declared}
        if plan.trigger and plan.trigger.get("timing") == "before_save":
            outputs["$Record"] = env.get("$Record")
    trace = [n for n in run.trace if not n.rsplit("/", 1)[-1].startswith("$")]
    return Observation(
        trace=tuple(trace),
        outcome=outcome,
        fault_code=code,
        fault_element=element,
        outputs=rename(to_json_value(outputs), names),
        writes=normalized,
        effects=tuple(
            (el, action, json.dumps(rename(to_json_value(dict(i)), names), sort_keys=True))
            for el, action, i in run.effects
        ),
        resource_classes=observed_classes(view, run.writes),
        projections=tuple(run.projections),
    )


def _next(advance: Any) -> FinishRun | FailRun | str:
    if isinstance(advance, NextStep):
        return advance.plan_step_key
    if isinstance(advance, FinishRun | FailRun):
        return advance
    raise StepFault("unsupported_step_kind", f"advance {type(advance).__name__}")
