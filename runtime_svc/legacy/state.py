"""The legacy interview state: frames, position, wait, outcome — and its JSON form.

A ``LegacyInterpreter`` interview is an element pointer plus variables, persisted as the
``legacy_context`` of its ``flow_runs`` row (and, before the bridge, as the
``context_payload`` of a pre-bridge ``flow_interviews`` row: the same JSON). A Subflow
element pushes a :class:`Frame`; element *paths* are the frame prefixes plus the local
API name (``reprice_items/each_item``), which is exactly how the compiler names inlined
subflow nodes, so legacy traces and plan traces use one vocabulary.

Pure: no I/O, no generated protos.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

__all__ = [
    "LEGACY_CONTEXT_VERSION",
    "MAX_TRACE",
    "Frame",
    "LegacyState",
    "WaitKind",
    "WaitSpec",
    "json_value",
]

#: Layout version of ``legacy_context``.
LEGACY_CONTEXT_VERSION = 1
#: Longest element trace kept in the context (the most recent elements).
MAX_TRACE = 1000


def json_value(value: Any) -> Any:
    """A JSON-safe value: exact decimals become ``int`` or their text (as the V2
    checkpoint does), datetimes ISO text, containers recursively."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    return value


class WaitKind(StrEnum):
    """What a paused interview waits for."""

    TIME = "time"
    EVENT = "event"
    ACTION = "action"  # a wait-class ActionCall (resumed with the action's result)


@dataclass(frozen=True)
class WaitSpec:
    """Where and for what an interview is paused.

    ``resume_at`` is the time-wait due time; ``deadline_at`` the terminal bound after
    which the element's expiry policy applies. ``run_after`` (the due-list time) is the
    earlier of the two, or the deadline for event/action waits.
    """

    element: str
    kind: WaitKind
    deadline_at: datetime | None
    expiry_policy: str
    resume_at: datetime | None = None
    producer_kind: str | None = None
    key: str | None = None

    @property
    def run_after(self) -> datetime | None:
        times = [t for t in (self.resume_at, self.deadline_at) if t is not None]
        return min(times) if times else None

    def to_json(self) -> dict[str, Any]:
        return {
            "element": self.element,
            "kind": self.kind.value,
            "deadline_at": None if self.deadline_at is None else self.deadline_at.isoformat(),
            "expiry_policy": self.expiry_policy,
            "resume_at": None if self.resume_at is None else self.resume_at.isoformat(),
            "producer_kind": self.producer_kind,
            "key": self.key,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WaitSpec:
        def _t(v: Any) -> datetime | None:
            return None if v is None else datetime.fromisoformat(str(v))

        return cls(
            element=str(d["element"]),
            kind=WaitKind(d["kind"]),
            deadline_at=_t(d.get("deadline_at")),
            expiry_policy=str(d.get("expiry_policy") or "terminal_failure"),
            resume_at=_t(d.get("resume_at")),
            producer_kind=d.get("producer_kind"),
            key=d.get("key"),
        )


@dataclass
class Frame:
    """One flow activation: the root Flow or a Subflow call.

    ``prefix`` is the element-path prefix of this frame's elements (``""`` for the
    root, ``"call/"`` for a subflow called by element ``call``); ``call_element`` is the
    calling Subflow element's *local* name in the parent frame.
    """

    flow: str
    version: int
    prefix: str
    variables: dict[str, Any]
    call_element: str | None = None
    loops: dict[str, list[Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "flow": self.flow,
            "version": self.version,
            "prefix": self.prefix,
            "call_element": self.call_element,
            "variables": json_value(self.variables),
            "loops": json_value(self.loops),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Frame:
        return cls(
            flow=str(d["flow"]),
            version=int(d["version"]),
            prefix=str(d.get("prefix") or ""),
            variables=copy.deepcopy(dict(d.get("variables") or {})),
            call_element=d.get("call_element"),
            loops={str(k): list(v) for k, v in (d.get("loops") or {}).items()},
        )


@dataclass
class LegacyState:
    """A whole interview (mutable while a segment runs; serialized between segments).

    ``position`` is the local name of the next element of the top frame (``None``: the
    top frame has reached its end). ``trace`` keeps the most recent element paths.
    """

    frames: list[Frame]
    position: str | None
    wait: WaitSpec | None = None
    trigger: dict[str, Any] | None = None
    trace: list[str] = field(default_factory=list)
    elements_executed: int = 0
    output: dict[str, Any] | None = None
    fault: dict[str, Any] | None = None

    @property
    def top(self) -> Frame:
        return self.frames[-1]

    @property
    def path(self) -> str | None:
        """The full element path of :attr:`position` (``None`` at a frame end)."""
        return None if self.position is None else self.top.prefix + self.position

    def to_json(self) -> dict[str, Any]:
        return {
            "v": LEGACY_CONTEXT_VERSION,
            "frames": [f.to_json() for f in self.frames],
            "position": self.position,
            "wait": None if self.wait is None else self.wait.to_json(),
            "trigger": self.trigger,
            "trace": self.trace[-MAX_TRACE:],
            "elements_executed": self.elements_executed,
            "output": None if self.output is None else json_value(self.output),
            "fault": self.fault,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LegacyState:
        """Decode ``legacy_context``.

        Raises:
            ValueError: not a legacy context of a known layout.
        """
        if int(d.get("v", 0)) != LEGACY_CONTEXT_VERSION or not d.get("frames"):
            raise ValueError("not a legacy interview context of a known layout")
        wait = d.get("wait")
        return cls(
            frames=[Frame.from_json(f) for f in d["frames"]],
            position=d.get("position"),
            wait=None if wait is None else WaitSpec.from_json(wait),
            trigger=d.get("trigger"),
            trace=[str(t) for t in d.get("trace") or ()],
            elements_executed=int(d.get("elements_executed", 0)),
            output=d.get("output"),
            fault=d.get("fault"),
        )

    @classmethod
    def loads(cls, text: str) -> LegacyState:
        return cls.from_json(json.loads(text))

    @classmethod
    def start(
        cls,
        flow: str,
        version: int,
        start: str,
        variables: Mapping[str, Any],
        trigger: Mapping[str, Any] | None = None,
    ) -> LegacyState:
        """A new interview positioned at the Flow's start element."""
        return cls(
            frames=[Frame(flow, version, "", copy.deepcopy(dict(variables)))],
            position=start,
            trigger=None if trigger is None else dict(trigger),
        )
