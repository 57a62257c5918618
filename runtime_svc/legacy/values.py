"""The values the legacy interpreter exchanges with its callers and ports: faults,
observed writes and effects, action outcomes, resume signals, segment outcomes, and the
:class:`LegacyPorts` protocol. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime_svc.compiler import FlowDef
from runtime_svc.legacy.state import LegacyState, WaitSpec

__all__ = [
    "ActionDone",
    "ActionFailed",
    "ActionOutcome",
    "ActionPauses",
    "Due",
    "EffectCall",
    "EventArrived",
    "Failed",
    "Finished",
    "LegacyFault",
    "LegacyPorts",
    "Paused",
    "RecordWrite",
    "Resume",
    "Segment",
    "SegmentStatus",
    "StillWaiting",
]


class LegacyFault(Exception):
    """A classified failure of one element; ``routable`` faults follow fault connectors."""

    def __init__(self, code: str, message: str = "", *, routable: bool = False) -> None:
        super().__init__(message or code)
        self.code = code
        self.routable = routable


@dataclass(frozen=True)
class RecordWrite:
    """One record mutation an element performed (``create`` | ``update`` | ``delete``)."""

    kind: str
    object_name: str
    record_id: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    element: str = ""


@dataclass(frozen=True)
class EffectCall:
    """An external-effect action the walk invoked (observed; the port decides whether it
    really runs — the shadow ports never run one)."""

    element: str
    action_type: str
    inputs: Mapping[str, Any]


@dataclass(frozen=True)
class ActionDone:
    """The action returned ``value``."""

    value: Any = None
    effect: bool = False


@dataclass(frozen=True)
class ActionFailed:
    """The action failed with a stable safe code (follows the fault connector)."""

    code: str
    effect: bool = False


@dataclass(frozen=True)
class ActionPauses:
    """A wait-class action: the interview pauses until the producer resumes it."""

    producer_kind: str


ActionOutcome = ActionDone | ActionFailed | ActionPauses


class LegacyPorts(Protocol):
    """What the walk needs from outside the interview state."""

    async def read_record(self, object_name: str, record_id: str) -> dict[str, Any] | None:
        """The live record (``Id`` included), or ``None``."""

    async def query_records(
        self, object_name: str, field_name: str, value: Any, limit: int
    ) -> list[dict[str, Any]]:
        """Live records whose ``field_name`` equals ``value`` (ordered by id, ``limit``).

        Raises:
            LegacyFault: ``unsupported_element`` when the field cannot be queried.
        """

    async def write_record(self, write: RecordWrite) -> None:
        """Apply (live) or record (shadow) one mutation.

        Raises:
            LegacyFault: ``record_not_found`` / ``record_invalid`` (routable).
        """

    def new_record_id(self) -> str:
        """A fresh record id for a CreateRecord."""

    async def call_action(
        self, element: str, action_type: str, inputs: Mapping[str, Any]
    ) -> ActionOutcome:
        """Run (or replay) an action.

        Raises:
            LegacyFault: ``unsupported_action`` when no handler may run it.
        """

    def subflow(self, api_name: str, version: int) -> FlowDef | None:
        """The parsed Flow version a Subflow element calls."""


@dataclass(frozen=True)
class Due:
    """The due-list claim of a paused interview: a time wait is due, or a deadline."""


@dataclass(frozen=True)
class EventArrived:
    """A direct legacy resume with the producer's evidence (event/action waits)."""

    evidence: Mapping[str, Any]


Resume = Due | EventArrived


@dataclass(frozen=True)
class Finished:
    """The root frame ended; ``outputs`` are the declared output variables."""

    outputs: Mapping[str, Any]


@dataclass(frozen=True)
class Paused:
    """The interview waits (legacy status ``Paused``)."""

    wait: WaitSpec


@dataclass(frozen=True)
class Failed:
    """The interview failed (legacy status ``Error``); ``quarantined`` marks a wait that
    expired under the quarantine policy."""

    code: str
    element: str | None
    quarantined: bool = False


@dataclass(frozen=True)
class StillWaiting:
    """The resume did not release the wait (not due, or the event condition is false);
    the interview is unchanged."""

    wait: WaitSpec


SegmentStatus = Finished | Paused | Failed | StillWaiting


@dataclass(frozen=True)
class Segment:
    """What one segment did: its outcome, the state to persist, and observations."""

    status: SegmentStatus
    state: LegacyState
    trace: tuple[str, ...]
    writes: tuple[RecordWrite, ...]
    effects: tuple[EffectCall, ...]
