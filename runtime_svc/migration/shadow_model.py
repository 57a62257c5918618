"""Shadow comparison values (§20.5): fixtures, observations of each owner, divergences.

A :class:`Scenario` is a *safe read-only or replayable fixture*: input variables, the
trigger record, the business records reads may see, and the replayed outcomes of every
external effect, wait and wait-class action. Both owners run on it in memory; neither
writes a business record, calls an effect or touches the database.

:func:`compare` lists every :class:`Divergence` between the two :class:`Observation`\\ s:

* ``element_trace`` — the legacy element trace vs the compiled plan's node trace;
* ``outcome`` / ``fault_routing`` — how the run ended and through which fault path;
* ``outputs``, ``writes``, ``effects`` — what it produced (created record ids normalized);
* ``resource_class`` — an observed resource class the plan does not declare;
* ``projection`` — the §18.2 legacy projection sequence vs the canonical one.

Known, *explained* differences are classified, never hidden: the V2 runtime failing closed
(``unsupported_*``) where the legacy owner succeeds is explained and **blocking** (the
cohort cannot move to V2); the durable effect boundary V2 adds (a ``Paused`` observation
at the effect completion that the legacy inline call never has) is explained and benign.
Anything else is unexplained.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.digest import versioned_digest

__all__ = [
    "Comparison",
    "Divergence",
    "Observation",
    "Outcome",
    "Scenario",
    "compare",
]


@dataclass(frozen=True)
class Scenario:
    """One replayable fixture (see the module docstring).

    ``effects``/``actions`` map an element path to ``{"ok": true, "value": …}`` or
    ``{"ok": false, "code": …}``; ``waits`` map a wait element path to
    ``{"resume": {evidence…}}`` or ``{"expire": true}`` (time waits resume by default,
    event waits expire by default).
    """

    name: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    trigger: Mapping[str, Any] | None = None
    records: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    effects: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    waits: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": dict(self.inputs),
            "trigger": None if self.trigger is None else dict(self.trigger),
            "records": {o: dict(r) for o, r in self.records.items()},
            "effects": dict(self.effects),
            "waits": dict(self.waits),
        }

    def digest(self) -> str:
        return versioned_digest("shadow-scenario", self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Scenario:
        return cls(
            name=str(d["name"]),
            inputs=dict(d.get("inputs") or {}),
            trigger=d.get("trigger"),
            records={str(o): dict(r) for o, r in (d.get("records") or {}).items()},
            effects=dict(d.get("effects") or {}),
            waits=dict(d.get("waits") or {}),
        )


@dataclass(frozen=True)
class Observation:
    """What one owner did with one scenario."""

    trace: tuple[str, ...]
    outcome: str  # succeeded | failed | quarantined
    fault_code: str | None
    fault_element: str | None
    outputs: Mapping[str, Any]
    writes: tuple[tuple[str, str, str, str], ...]  # (kind, object, record id, fields JSON)
    effects: tuple[tuple[str, str, str], ...]  # (element, action, inputs JSON)
    resource_classes: frozenset[tuple[str, str]]
    projections: tuple[tuple[str, str | None], ...]  # (legacy status, current element)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace": list(self.trace),
            "outcome": self.outcome,
            "fault_code": self.fault_code,
            "fault_element": self.fault_element,
            "outputs": _jsonable(self.outputs),
            "writes": [list(w) for w in self.writes],
            "effects": [list(e) for e in self.effects],
            "resource_classes": sorted(list(c) for c in self.resource_classes),
            "projections": [list(p) for p in self.projections],
        }


class Outcome(StrEnum):
    """The verdict of one comparison."""

    MATCH = "match"
    EXPLAINED = "explained"
    DIVERGED = "diverged"


@dataclass(frozen=True)
class Divergence:
    """One difference; ``reason`` names the explanation of an explained one."""

    kind: str
    legacy: Any
    plan: Any
    explained: bool = False
    blocking: bool = True
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "legacy": _jsonable(self.legacy),
            "plan": _jsonable(self.plan),
            "explained": self.explained,
            "blocking": self.blocking,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Comparison:
    """The comparison of one scenario."""

    flow: str
    scenario: str
    scenario_digest: str
    plan_digest: str | None
    legacy: Observation
    plan: Observation
    divergences: tuple[Divergence, ...]

    @property
    def outcome(self) -> Outcome:
        if not self.divergences:
            return Outcome.MATCH
        if all(d.explained for d in self.divergences):
            return Outcome.EXPLAINED
        return Outcome.DIVERGED

    @property
    def blocking(self) -> bool:
        return any(d.blocking for d in self.divergences)

    @property
    def unexplained(self) -> tuple[Divergence, ...]:
        return tuple(d for d in self.divergences if not d.explained)

    def to_dict(self) -> dict[str, Any]:
        return {
            "flow": self.flow,
            "scenario": self.scenario,
            "scenario_digest": self.scenario_digest,
            "plan_digest": self.plan_digest,
            "outcome": self.outcome.value,
            "blocking": self.blocking,
            "divergences": [d.to_dict() for d in self.divergences],
            "legacy": self.legacy.to_dict(),
            "plan": self.plan.to_dict(),
        }


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _fails_closed(plan: Observation) -> bool:
    return plan.outcome == "failed" and (plan.fault_code or "").startswith("unsupported_")


def _effect_boundary_only(legacy: Observation, plan: Observation) -> bool:
    """The projections differ only by V2's Paused observations at effect completions."""
    effect_points = {e[0] for e in plan.effects}
    extra = [p for p in plan.projections if p not in legacy.projections]
    trimmed = [p for p in plan.projections if p not in extra]
    return (
        bool(extra)
        and all(
            status == "Paused" and (el or "").split("#")[0] in effect_points for status, el in extra
        )
        and trimmed == list(legacy.projections)
    )


def compare(
    flow: str,
    scenario: Scenario,
    plan_digest: str | None,
    legacy: Observation,
    plan: Observation,
    declared: frozenset[tuple[str, str]],
) -> Comparison:
    """Every divergence of ``legacy`` and ``plan`` on ``scenario`` (module docstring)."""
    found: list[Divergence] = []
    if _fails_closed(plan) and (legacy.outcome != "failed" or legacy.fault_code != plan.fault_code):
        # V2 refuses what it cannot run yet; nothing after that point is comparable.
        found.append(
            Divergence(
                "outcome",
                [legacy.outcome, legacy.fault_code],
                [plan.outcome, plan.fault_code],
                explained=True,
                blocking=True,
                reason=f"v2_fails_closed.{plan.fault_code}",
            )
        )
        return Comparison(
            flow, scenario.name, scenario.digest(), plan_digest, legacy, plan, tuple(found)
        )
    if legacy.trace != plan.trace:
        found.append(Divergence("element_trace", legacy.trace, plan.trace))
    if legacy.outcome != plan.outcome:
        found.append(Divergence("outcome", legacy.outcome, plan.outcome))
    if (legacy.fault_code, legacy.fault_element) != (plan.fault_code, plan.fault_element):
        found.append(
            Divergence(
                "fault_routing",
                [legacy.fault_code, legacy.fault_element],
                [plan.fault_code, plan.fault_element],
            )
        )
    if _jsonable(legacy.outputs) != _jsonable(plan.outputs):
        found.append(Divergence("outputs", legacy.outputs, plan.outputs))
    if legacy.writes != plan.writes:
        found.append(Divergence("writes", legacy.writes, plan.writes))
    if legacy.effects != plan.effects:
        found.append(Divergence("effects", legacy.effects, plan.effects))
    for side, observed in (("legacy", legacy), ("plan", plan)):
        undeclared = sorted(observed.resource_classes - declared)
        if undeclared:
            found.append(
                Divergence("resource_class", undeclared if side == "legacy" else [], undeclared)
            )
    if legacy.projections != plan.projections:
        benign = _effect_boundary_only(legacy, plan)
        found.append(
            Divergence(
                "projection",
                legacy.projections,
                plan.projections,
                explained=benign,
                blocking=not benign,
                reason="v2_effect_boundary" if benign else "",
            )
        )
    return Comparison(
        flow, scenario.name, scenario.digest(), plan_digest, legacy, plan, tuple(found)
    )
