"""The Flow metadata language: typed model of one Flow version.

The JSON shape is documented in ``docs/flow-language.md`` and
``docs/flow-language.schema.json``; :mod:`.parse` turns a JSON/YAML document
into these values. Every model value has a canonical ``to_dict`` whose
expressions are printed in canonical form and whose unordered collections
(elements, variables, trigger events) are sorted, so formatting, key order and
element order never reach the metadata digest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from services.digest import versioned_digest

from .expressions import Expr, Ref, unparse
from .kinds import ExpiryPolicy

__all__ = [
    "IDENT_RE",
    "ActionCall",
    "AssignOp",
    "Assignment",
    "AssignmentItem",
    "CreateRecord",
    "Decision",
    "DecisionRule",
    "DeleteRecord",
    "Element",
    "ElementType",
    "End",
    "EventWait",
    "Fault",
    "Filter",
    "FlowDef",
    "GetRecords",
    "Loop",
    "LoopBoundDecl",
    "ProcessType",
    "ReadMode",
    "RecordWait",
    "Subflow",
    "TimeWait",
    "Trigger",
    "TriggerEvent",
    "TriggerTiming",
    "UpdateRecord",
    "VarType",
    "Variable",
    "Wait",
    "parse_duration",
]

IDENT_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,79}$")
_DURATION_RE = re.compile(r"^P(?:(\d+)W)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?$")


def parse_duration(text: str) -> int | None:
    """Seconds of an ISO-8601 duration made of weeks, days, hours, minutes, seconds.

    Years and months are refused (``None``): their length depends on the
    calendar, and a plan must mean the same thing whenever it runs.
    """
    m = _DURATION_RE.match(text)
    if m is None or text in ("P", "PT") or text.endswith("T"):
        return None
    w, d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return (((w * 7 + d) * 24 + h) * 60 + mi) * 60 + s


class ProcessType(StrEnum):
    """How a Flow starts."""

    RECORD_TRIGGERED = "record_triggered"
    AUTOLAUNCHED = "autolaunched"


class TriggerTiming(StrEnum):
    """When a record-triggered Flow runs relative to the record save."""

    BEFORE_SAVE = "before_save"
    AFTER_SAVE = "after_save"


class TriggerEvent(StrEnum):
    """Record events a trigger subscribes to."""

    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"


class VarType(StrEnum):
    """Variable data types."""

    STRING = "string"
    NUMBER = "number"
    BOOLEAN = "boolean"
    DATE = "date"
    DATETIME = "datetime"
    RECORD = "record"


class ElementType(StrEnum):
    """Element types of the language."""

    ASSIGNMENT = "Assignment"
    DECISION = "Decision"
    LOOP = "Loop"
    GET_RECORDS = "GetRecords"
    CREATE_RECORD = "CreateRecord"
    UPDATE_RECORD = "UpdateRecord"
    DELETE_RECORD = "DeleteRecord"
    ACTION_CALL = "ActionCall"
    SUBFLOW = "Subflow"
    WAIT = "Wait"
    FAULT = "Fault"
    END = "End"


class AssignOp(StrEnum):
    """Assignment operators."""

    SET = "set"
    ADD = "add"
    SUBTRACT = "subtract"
    ADD_ITEM = "add_item"


class ReadMode(StrEnum):
    """How GetRecords reads: inside a transaction, or as a verified snapshot."""

    CURRENT = "current"
    SNAPSHOT = "snapshot"


def _x(e: Expr | None) -> str | None:
    return None if e is None else unparse(e)


@dataclass(frozen=True)
class Trigger:
    """The record trigger of a ``record_triggered`` Flow."""

    object: str
    timing: TriggerTiming
    events: tuple[TriggerEvent, ...]
    entry_condition: Expr | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "object": self.object,
            "timing": self.timing.value,
            "events": sorted(e.value for e in self.events),
            "entry_condition": _x(self.entry_condition),
        }


@dataclass(frozen=True)
class Variable:
    """A typed Flow variable; ``max_items`` declares a collection's bound."""

    name: str
    type: VarType
    collection: bool = False
    object: str | None = None
    input: bool = False
    output: bool = False
    max_items: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "name": self.name,
            "type": self.type.value,
            "collection": self.collection,
            "object": self.object,
            "input": self.input,
            "output": self.output,
            "max_items": self.max_items,
        }


@dataclass(frozen=True, kw_only=True)
class Element:
    """Fields every element has; ``next``/``fault`` are connectors (element names)."""

    api_name: str
    next: str | None = None
    fault: str | None = None

    TYPE: ClassVar[ElementType]

    @property
    def type(self) -> ElementType:
        """The element type."""
        return self.TYPE

    def connectors(self) -> tuple[tuple[str, str, str], ...]:
        """``(label, connector field path, target)`` for every set connector."""
        out: list[tuple[str, str, str]] = []
        if self.next is not None:
            out.append(("next", "next", self.next))
        if self.fault is not None:
            out.append(("fault", "fault", self.fault))
        return tuple(out)

    def body(self) -> dict[str, Any]:
        """Type-specific canonical fields."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "api_name": self.api_name,
            "type": self.type.value,
            "next": self.next,
            "fault": self.fault,
            **self.body(),
        }


@dataclass(frozen=True)
class AssignmentItem:
    """``target op value``; targets are variables or ``$Record`` fields."""

    target: Ref
    op: AssignOp
    value: Expr


@dataclass(frozen=True, kw_only=True)
class Assignment(Element):
    """Sets variables or trigger-record fields, in order."""

    items: tuple[AssignmentItem, ...]

    TYPE: ClassVar[ElementType] = ElementType.ASSIGNMENT

    def body(self) -> dict[str, Any]:
        return {
            "assignments": [
                {"target": i.target.dotted(), "op": i.op.value, "value": unparse(i.value)}
                for i in self.items
            ]
        }


@dataclass(frozen=True)
class DecisionRule:
    """One outcome of a Decision; rules are tried in order."""

    name: str
    condition: Expr
    next: str | None


@dataclass(frozen=True, kw_only=True)
class Decision(Element):
    """First matching rule wins; ``next`` is the default outcome."""

    rules: tuple[DecisionRule, ...]

    TYPE: ClassVar[ElementType] = ElementType.DECISION

    def connectors(self) -> tuple[tuple[str, str, str], ...]:
        out = [(r.name, f"rules[{r.name}].next", r.next) for r in self.rules if r.next is not None]
        if self.next is not None:
            out.append(("default", "next", self.next))
        return tuple(out)

    def body(self) -> dict[str, Any]:
        return {
            "rules": [
                {"name": r.name, "condition": unparse(r.condition), "next": r.next}
                for r in self.rules
            ]
        }


@dataclass(frozen=True)
class LoopBoundDecl:
    """An author-declared loop bound: a static maximum or a relationship to derive it from."""

    max: int | None = None
    relationship: str | None = None


@dataclass(frozen=True, kw_only=True)
class Loop(Element):
    """Iterates ``collection``; ``each`` enters the body, ``next`` follows the last item."""

    collection: str
    item_variable: str
    each: str | None
    bound: LoopBoundDecl | None = None

    TYPE: ClassVar[ElementType] = ElementType.LOOP

    def connectors(self) -> tuple[tuple[str, str, str], ...]:
        out = [("each", "each", self.each)] if self.each is not None else []
        if self.next is not None:
            out.append(("done", "next", self.next))
        return tuple(out)

    def body(self) -> dict[str, Any]:
        bound = (
            None
            if self.bound is None
            else {"max": self.bound.max, "relationship": self.bound.relationship}
        )
        return {
            "collection": self.collection,
            "item_variable": self.item_variable,
            "each": self.each,
            "bound": bound,
        }


@dataclass(frozen=True)
class Filter:
    """``field op value`` against the queried object."""

    field: str
    op: str
    value: Expr

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {"field": self.field, "op": self.op, "value": unparse(self.value)}


def _filters(fs: tuple[Filter, ...]) -> list[dict[str, Any]]:
    # Filters are a conjunction: their order is not semantic.
    return sorted((f.to_dict() for f in fs), key=lambda d: (d["field"], d["op"], d["value"]))


def _fields(fs: tuple[tuple[str, Expr], ...]) -> dict[str, str]:
    return {k: unparse(v) for k, v in fs}


@dataclass(frozen=True, kw_only=True)
class GetRecords(Element):
    """Queries ``object``; ``first_only`` yields one record, else a collection."""

    object: str
    filters: tuple[Filter, ...] = ()
    limit: int | None = None
    first_only: bool = False
    output_variable: str | None = None
    read_mode: ReadMode = ReadMode.SNAPSHOT

    TYPE: ClassVar[ElementType] = ElementType.GET_RECORDS

    def body(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "filters": _filters(self.filters),
            "limit": self.limit,
            "first_only": self.first_only,
            "output_variable": self.output_variable,
            "read_mode": self.read_mode.value,
        }


@dataclass(frozen=True, kw_only=True)
class CreateRecord(Element):
    """Creates one record from ``fields`` or every record of ``from_variable``."""

    object: str
    fields: tuple[tuple[str, Expr], ...] = ()
    from_variable: str | None = None
    output_variable: str | None = None

    TYPE: ClassVar[ElementType] = ElementType.CREATE_RECORD

    def body(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "fields": _fields(self.fields),
            "from_variable": self.from_variable,
            "output_variable": self.output_variable,
        }


@dataclass(frozen=True, kw_only=True)
class UpdateRecord(Element):
    """Updates ``record`` (``$Record`` or a variable) or the records ``filters`` select."""

    object: str
    record: str | None = None
    filters: tuple[Filter, ...] = ()
    limit: int | None = None
    fields: tuple[tuple[str, Expr], ...] = ()

    TYPE: ClassVar[ElementType] = ElementType.UPDATE_RECORD

    def body(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "record": self.record,
            "filters": _filters(self.filters),
            "limit": self.limit,
            "fields": _fields(self.fields),
        }


@dataclass(frozen=True, kw_only=True)
class DeleteRecord(Element):
    """Deletes ``record`` or the records ``filters`` select."""

    object: str
    record: str | None = None
    filters: tuple[Filter, ...] = ()
    limit: int | None = None

    TYPE: ClassVar[ElementType] = ElementType.DELETE_RECORD

    def body(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "record": self.record,
            "filters": _filters(self.filters),
            "limit": self.limit,
        }


@dataclass(frozen=True, kw_only=True)
class ActionCall(Element):
    """Invokes an action type from the sealed capability catalog."""

    action_type: str
    inputs: tuple[tuple[str, Expr], ...] = ()
    output_variable: str | None = None
    #: The explicit system/background identity (§17.1) the action runs as when its
    #: catalog security policy is ``system`` or hands off to system on a denial.
    system_identity: str | None = None

    TYPE: ClassVar[ElementType] = ElementType.ACTION_CALL

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "action_type": self.action_type,
            "inputs": _fields(self.inputs),
            "output_variable": self.output_variable,
        }
        if self.system_identity is not None:
            # Only when declared: the metadata digest of every other Flow is unchanged.
            out["system_identity"] = self.system_identity
        return out


@dataclass(frozen=True, kw_only=True)
class Subflow(Element):
    """Calls Flow ``flow`` version ``version``; maps inputs in and outputs back."""

    flow: str
    version: int
    inputs: tuple[tuple[str, Expr], ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()

    TYPE: ClassVar[ElementType] = ElementType.SUBFLOW

    def body(self) -> dict[str, Any]:
        return {
            "flow": self.flow,
            "version": self.version,
            "inputs": _fields(self.inputs),
            "outputs": dict(sorted(self.outputs)),
        }


@dataclass(frozen=True)
class TimeWait:
    """Resume after ``duration`` (seconds) or at the time ``until`` evaluates to."""

    duration: str | None = None
    duration_seconds: int | None = None
    until: Expr | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {"kind": "time", "duration": self.duration, "until": _x(self.until)}


@dataclass(frozen=True)
class EventWait:
    """Resume when producer ``producer_kind`` signals ``key`` and ``condition`` holds."""

    producer_kind: str
    key: Expr
    condition: Expr | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "kind": "event",
            "producer_kind": self.producer_kind,
            "key": unparse(self.key),
            "condition": _x(self.condition),
        }


@dataclass(frozen=True)
class RecordWait:
    """Resume when record ``record_id`` of ``object`` matches ``condition``.

    ``condition`` reads the record as ``$Event`` (``$Event.Status == 'Closed'``); it is
    evaluated against the record itself, both when the wait starts and on every change
    the record engine signals, so a record that already matches resumes at once.
    """

    object: str
    record_id: Expr
    condition: Expr

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "kind": "record",
            "object": self.object,
            "record_id": unparse(self.record_id),
            "condition": unparse(self.condition),
        }


@dataclass(frozen=True, kw_only=True)
class Wait(Element):
    """A durable wait with a terminal deadline and an expiry policy."""

    wait: TimeWait | EventWait | RecordWait
    deadline: str
    deadline_seconds: int
    expiry_policy: ExpiryPolicy

    TYPE: ClassVar[ElementType] = ElementType.WAIT

    def body(self) -> dict[str, Any]:
        return {
            "wait": self.wait.to_dict(),
            "deadline": self.deadline,
            "expiry_policy": self.expiry_policy.value,
        }


@dataclass(frozen=True, kw_only=True)
class Fault(Element):
    """Ends the run as failed with a stable code and a static message."""

    code: str
    message: str = ""

    TYPE: ClassVar[ElementType] = ElementType.FAULT

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True, kw_only=True)
class End(Element):
    """Ends the run successfully."""

    TYPE: ClassVar[ElementType] = ElementType.END


@dataclass(frozen=True)
class FlowDef:
    """One parsed Flow version; ``elements`` and ``variables`` are sorted by name."""

    api_name: str
    version: int
    process_type: ProcessType
    start: str
    elements: tuple[Element, ...]
    variables: tuple[Variable, ...] = ()
    trigger: Trigger | None = None
    run_atomically: bool | None = None

    def element(self, name: str) -> Element | None:
        """The element named ``name``, or ``None``."""
        return next((e for e in self.elements if e.api_name == name), None)

    def variable(self, name: str) -> Variable | None:
        """The variable named ``name``, or ``None``."""
        return next((v for v in self.variables if v.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """Canonical normalized metadata (the input of :meth:`metadata_digest`)."""
        return {
            "api_name": self.api_name,
            "version": self.version,
            "process_type": self.process_type.value,
            "run_atomically": self.run_atomically,
            "trigger": None if self.trigger is None else self.trigger.to_dict(),
            "variables": [v.to_dict() for v in sorted(self.variables, key=lambda v: v.name)],
            "start": self.start,
            "elements": [e.to_dict() for e in sorted(self.elements, key=lambda e: e.api_name)],
        }

    def metadata_digest(self) -> str:
        """Digest of the normalized source metadata (§7.4 ``MetadataDigest``)."""
        return versioned_digest("flow-metadata", self.to_dict())
