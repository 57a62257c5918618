"""The legacy side of a shadow comparison: the element-walking interpreter on a fixture.

:class:`ShadowPorts` are the interpreter's ports over :class:`FixtureRecords`: reads see
the fixture plus this run's own writes, writes change only the in-memory copy, external
effects and wait-class actions are *replayed* from the scenario (never called), and
lookups follow the same rule as the live ports (``Id`` or the indexed parent lookup).
:func:`run_legacy` drives segment after segment — releasing each wait the way the
scenario says — and returns the :class:`~.shadow_model.Observation`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from runtime_svc.compiler import FlowDef
from runtime_svc.legacy.interpreter import (
    ActionDone,
    ActionFailed,
    ActionOutcome,
    ActionPauses,
    Due,
    EventArrived,
    Failed,
    Finished,
    LegacyFault,
    Paused,
    RecordWrite,
    Resume,
    StillWaiting,
    initial_variables,
    run_segment,
)
from runtime_svc.legacy.state import LegacyState, WaitKind, json_value
from runtime_svc.migration.shadow_fixture import (
    SHADOW_NOW,
    ActionClasses,
    FixtureRecords,
    initial_variables_of,
    normalize_writes,
    observed_classes,
    rename,
)
from runtime_svc.migration.shadow_model import Observation, Scenario
from runtime_svc.records import RecordView
from runtime_svc.worker.actions import PureActionError, run_pure_action
from services.invariants import InvariantError

__all__ = ["ShadowPorts", "run_legacy"]

_MAX_SEGMENTS = 200


class ShadowPorts:
    """Fixture ports of the legacy interpreter (module docstring)."""

    def __init__(
        self,
        records: FixtureRecords,
        scenario: Scenario,
        classes: ActionClasses,
        view: RecordView | None,
        subflows: Mapping[tuple[str, int], FlowDef],
    ) -> None:
        self.records = records
        self._scenario = scenario
        self._classes = classes
        self._view = view
        self._subflows = subflows
        self.created = 0

    async def read_record(self, object_name: str, record_id: str) -> dict[str, Any] | None:
        return self.records.get(object_name, record_id)

    async def query_records(
        self, object_name: str, field_name: str, value: Any, limit: int
    ) -> list[dict[str, Any]]:
        rel = None if self._view is None else self._view.indexed_relationship(object_name)
        if rel is None or rel.field != field_name:
            raise LegacyFault("unsupported_element", f"GetRecords by {field_name}")
        return self.records.query(object_name, field_name, value, limit)

    async def write_record(self, write: RecordWrite) -> None:
        if not self.records.apply(write.kind, write.object_name, write.record_id, write.fields):
            raise LegacyFault("record_not_found", write.record_id, routable=True)

    def new_record_id(self) -> str:
        self.created += 1
        return f"legacy-new-{self.created}"

    async def call_action(
        self, element: str, action_type: str, inputs: Mapping[str, Any]
    ) -> ActionOutcome:
        if action_type in self._classes.waits:
            return ActionPauses(f"action:{action_type}")
        if action_type in self._classes.effects:
            replay = self._scenario.effects.get(element, {"ok": True, "value": None})
            if replay.get("ok", True):
                return ActionDone(copy.deepcopy(replay.get("value")), effect=True)
            return ActionFailed(str(replay.get("code") or "effect_failed"), effect=True)
        try:
            return ActionDone(run_pure_action(action_type, inputs))
        except KeyError:
            raise LegacyFault("unsupported_action", action_type) from None
        except PureActionError:
            return ActionFailed("action_failed")

    def subflow(self, api_name: str, version: int) -> FlowDef | None:
        return self._subflows.get((api_name, version))


def _release(state: LegacyState, scenario: Scenario, now: Any) -> tuple[Resume | None, Any]:
    """How the scenario releases the current wait: ``(signal, new clock)``; ``None``: the
    scenario does not say (an action wait without a replay stays waiting)."""
    wait = state.wait
    if wait is None:
        raise InvariantError("broken invariant: wait is not None")
    replay = scenario.waits.get(wait.element, {})
    expire = now if wait.deadline_at is None else wait.deadline_at + timedelta(seconds=1)
    if wait.kind is WaitKind.TIME:
        if replay.get("expire"):
            return Due(), expire
        return Due(), max(now, wait.resume_at or now)
    if "resume" in replay:
        evidence = replay["resume"]
        if wait.kind is WaitKind.ACTION:
            evidence = {
                "result": evidence.get("result") if isinstance(evidence, Mapping) else evidence
            }
        return EventArrived(dict(evidence)), now
    if wait.kind is WaitKind.ACTION:
        return None, now
    return Due(), expire


async def run_legacy(
    flow: FlowDef,
    scenario: Scenario,
    *,
    classes: ActionClasses,
    view: RecordView | None,
    subflows: Mapping[tuple[str, int], FlowDef],
    transform: bool = False,
) -> Observation:
    """Run the legacy interpreter on ``scenario`` to its end (module docstring)."""
    variables, trigger = initial_variables_of(scenario)
    state = LegacyState.start(
        flow.api_name, flow.version, flow.start, initial_variables(flow, variables), trigger
    )
    ports = ShadowPorts(FixtureRecords.of(scenario), scenario, classes, view, subflows)
    now = SHADOW_NOW
    trace: list[str] = []
    writes: list[tuple[str, str, str, Mapping[str, Any]]] = []
    effects: list[tuple[str, str, Mapping[str, Any]]] = []
    projections: list[tuple[str, str | None]] = []
    signal: Resume | None = None
    outcome, code, element = "waiting", None, None
    outputs: Mapping[str, Any] = {}
    for _ in range(_MAX_SEGMENTS):
        segment = await run_segment(flow, state, ports, now=now, resume=signal, transform=transform)
        state = segment.state
        trace += segment.trace
        effects += [(e.element, e.action_type, e.inputs) for e in segment.effects]
        status = segment.status
        if not isinstance(status, Failed):  # a failed segment's writes roll back
            writes += [(w.kind, w.object_name, w.record_id, w.fields) for w in segment.writes]
        if isinstance(status, Finished):
            projections.append(("Finished", None))
            outcome = "succeeded"
            outputs = dict(status.outputs)
            if transform:
                outputs["$Record"] = state.frames[0].variables.get("$Record")
            break
        if isinstance(status, Failed):
            projections.append(("Error", None))
            outcome = "quarantined" if status.quarantined else "failed"
            code, element = status.code, status.element
            break
        if isinstance(status, Paused):
            projections.append(("Paused", status.wait.element))
        if isinstance(status, StillWaiting):
            state.wait = status.wait
            signal, now = Due(), (status.wait.deadline_at or now) + timedelta(seconds=1)
            continue
        signal, now = _release(state, scenario, now)
        if signal is None:
            break
    normalized, names = normalize_writes(writes)
    return Observation(
        trace=tuple(trace),
        outcome=outcome,
        fault_code=code,
        fault_element=element,
        outputs=rename(json_value(outputs), names),
        writes=normalized,
        effects=tuple(
            (el, action, json.dumps(rename(json_value(dict(inputs)), names), sort_keys=True))
            for el, action, inputs in effects
        ),
        resource_classes=observed_classes(view, writes),
        projections=tuple(projections),
    )
