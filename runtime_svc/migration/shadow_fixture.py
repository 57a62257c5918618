"""The in-memory fixture both shadow runs read and "write" (§20.5 "do not duplicate
business mutation or external effect"): a copy of the scenario's records per owner, the
replayed action outcomes, the action classes the sealed catalog gave the plan, and the
normalizations that make two runs comparable (created record ids, JSON values).

Pure: no I/O.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from runtime_svc.compiler import ExecutionPlan, StepKind
from runtime_svc.migration.shadow_model import Scenario
from runtime_svc.records import RecordView

__all__ = [
    "SHADOW_NOW",
    "ActionClasses",
    "FixtureRecords",
    "declared_classes",
    "initial_variables_of",
    "normalize_writes",
    "observed_classes",
    "rename",
]

#: The fixed clock of shadow runs (times only order waits; nothing reads the wall clock).
SHADOW_NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass
class FixtureRecords:
    """One owner's copy of the scenario records: ``object -> id -> fields``."""

    rows: dict[str, dict[str, dict[str, Any]]]
    created: int = 0

    @classmethod
    def of(cls, scenario: Scenario) -> FixtureRecords:
        return cls(
            {
                o: {rid: copy.deepcopy(dict(f)) for rid, f in rs.items()}
                for o, rs in scenario.records.items()
            }
        )

    def get(self, object_name: str, record_id: str) -> dict[str, Any] | None:
        fields = self.rows.get(object_name, {}).get(record_id)
        return None if fields is None else {"Id": record_id, **copy.deepcopy(fields)}

    def query(
        self, object_name: str, field_name: str, value: Any, limit: int
    ) -> list[dict[str, Any]]:
        found = [
            {"Id": rid, **copy.deepcopy(fields)}
            for rid, fields in sorted(self.rows.get(object_name, {}).items())
            if fields.get(field_name) == value
        ]
        return found[:limit]

    def apply(self, kind: str, object_name: str, record_id: str, fields: Mapping[str, Any]) -> bool:
        """Apply one mutation; ``False`` when an update/delete finds no record."""
        table = self.rows.setdefault(object_name, {})
        values = {k: v for k, v in _plain(dict(fields)).items() if k != "Id"}
        if kind == "create":
            table[record_id] = values
            return True
        if record_id not in table:
            return False
        if kind == "delete":
            del table[record_id]
        else:
            table[record_id].update(values)
        return True


@dataclass(frozen=True)
class ActionClasses:
    """How the sealed catalog classified each action the plan pins, read off the plan:
    an action behind an ``EffectSubmit`` is an external effect, one whose node is a
    ``DependencyWait`` is wait-class; the rest run inline if a pure handler exists."""

    effects: frozenset[str] = frozenset()
    waits: frozenset[str] = frozenset()

    @classmethod
    def of(cls, plan: ExecutionPlan) -> ActionClasses:
        nodes = {n.id: n for n in plan.nodes}
        effects, waits = set(), set()
        for step in plan.steps:
            element = nodes[step.entry].element if step.entry in nodes else None
            if element is None or element.get("type") != "ActionCall":
                continue
            if step.kind is StepKind.EFFECT_SUBMIT:
                effects.add(str(element["action_type"]))
            elif step.kind is StepKind.DEPENDENCY_WAIT:
                waits.add(str(element["action_type"]))
        return cls(frozenset(effects), frozenset(waits))


def initial_variables_of(scenario: Scenario) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The interview/checkpoint variables of a scenario and its trigger reference."""
    variables = dict(scenario.inputs)
    trigger = scenario.trigger
    if trigger is None:
        return variables, None
    rid = str(trigger["record_id"])
    record = dict(scenario.records.get(str(trigger["object"]), {}).get(rid, {}))
    variables["$Record"] = {**record, "Id": rid}
    prior = trigger.get("prior")
    variables["$Record__Prior"] = None if prior is None else {**dict(prior), "Id": rid}
    ref = {"object": trigger["object"], "record_id": rid, "event": trigger.get("event", "create")}
    return variables, ref


def normalize_writes(
    writes: Iterable[tuple[str, str, str, Mapping[str, Any]]],
) -> tuple[tuple[tuple[str, str, str, str], ...], dict[str, str]]:
    """Writes with created record ids renamed ``new-1``, ``new-2``… in creation order;
    returns the renaming too (outputs holding those ids are renamed the same way)."""
    names: dict[str, str] = {}
    out = []
    for kind, obj, rid, fields in writes:
        if kind == "create" and rid not in names:
            names[rid] = f"new-{len(names) + 1}"
        out.append(
            (kind, obj, names.get(rid, rid), json.dumps(_plain(dict(fields)), sort_keys=True))
        )
    return tuple(out), names


def rename(value: Any, names: Mapping[str, str]) -> Any:
    """``value`` with every renamed id replaced (JSON round trip)."""
    text = json.dumps(_plain(value), sort_keys=True, default=str)
    for old, new in names.items():
        text = text.replace(json.dumps(old), json.dumps(new))
    return json.loads(text)


def observed_classes(
    view: RecordView | None, writes: Iterable[tuple[str, str, str, Any]]
) -> frozenset[tuple[str, str]]:
    """The resource classes a run's writes touched (record, lock-relevant parent)."""
    out: set[tuple[str, str]] = set()
    for _, obj, _, _ in writes:
        out.add(("record", obj))
        if view is not None:
            for rel in view.child_relationships(obj):
                if rel.lock_parent:
                    out.add(("parent_record", rel.parent_object))
    return frozenset(out)


def declared_classes(plan: ExecutionPlan) -> frozenset[tuple[str, str]]:
    """Every ``(resource class, object)`` any plan step declares."""
    return frozenset(
        (decl.resource_class, decl.object) for step in plan.steps for decl in step.resources
    )
