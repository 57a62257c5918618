"""Flow sources the migration tests run on the legacy owner (and on V2 where they compile):
small, each exercising one legacy behaviour the bridge must keep safe."""

from __future__ import annotations

from typing import Any

__all__ = ["event_wait_flow", "pure_flow", "pure_wait_flow", "time_wait_flow", "write_flow"]


def _flow(
    name: str, elements: list[dict[str, Any]], variables: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "api_name": name,
        "version": 1,
        "process_type": "autolaunched",
        "variables": variables,
        "start": elements[0]["api_name"],
        "elements": elements,
    }


def pure_flow(name: str = "legacy_pure") -> dict[str, Any]:
    """Assignments and a Decision: finishes in the creating call."""
    return _flow(
        name,
        [
            {
                "api_name": "calc",
                "type": "Assignment",
                "assignments": [{"target": "total", "value": "amount * 2"}],
                "next": "pick",
            },
            {
                "api_name": "pick",
                "type": "Decision",
                "rules": [{"name": "big", "condition": "total >= 100", "next": "big"}],
                "next": "small",
            },
            {
                "api_name": "big",
                "type": "Assignment",
                "assignments": [{"target": "size", "value": "'big'"}],
            },
            {
                "api_name": "small",
                "type": "Assignment",
                "assignments": [{"target": "size", "value": "'small'"}],
            },
        ],
        [
            {"name": "amount", "type": "number", "input": True},
            {"name": "total", "type": "number", "output": True},
            {"name": "size", "type": "string", "output": True},
        ],
    )


def write_flow(name: str = "legacy_write") -> dict[str, Any]:
    """Creates an Account and updates it: two business writes in one segment."""
    return _flow(
        name,
        [
            {
                "api_name": "make",
                "type": "CreateRecord",
                "object": "Account",
                "fields": {"Name": "label", "Status": "'new'"},
                "output_variable": "acct",
                "next": "touch",
            },
            {
                "api_name": "touch",
                "type": "UpdateRecord",
                "object": "Account",
                "record": "acct",
                "fields": {"Status": "'touched'"},
            },
        ],
        [
            {"name": "label", "type": "string", "input": True},
            {"name": "acct", "type": "record", "object": "Account", "output": True},
        ],
    )


def time_wait_flow(name: str = "legacy_time_wait") -> dict[str, Any]:
    """Creates an Account, waits one hour (deadline one day, fault path on expiry), then
    marks it; a paused interview the due list serves."""
    return _flow(
        name,
        [
            {
                "api_name": "make",
                "type": "CreateRecord",
                "object": "Account",
                "fields": {"Name": "label", "Status": "'waiting'"},
                "output_variable": "acct",
                "next": "cool_off",
            },
            {
                "api_name": "cool_off",
                "type": "Wait",
                "wait": {"kind": "time", "duration": "PT1H"},
                "deadline": "P1D",
                "expiry_policy": "fault_path",
                "next": "done",
                "fault": "expired",
            },
            {
                "api_name": "done",
                "type": "UpdateRecord",
                "object": "Account",
                "record": "acct",
                "fields": {"Status": "'done'"},
            },
            {"api_name": "expired", "type": "Fault", "code": "WAIT_EXPIRED"},
        ],
        [
            {"name": "label", "type": "string", "input": True},
            {"name": "acct", "type": "record", "object": "Account"},
        ],
    )


def event_wait_flow(
    name: str = "legacy_event_wait", *, expiry: str = "terminal_failure"
) -> dict[str, Any]:
    """Waits for an approval event keyed by the input ``ticket``; on expiry
    ``terminal_failure`` (default), or ``fault_path`` to a ``Fault`` element."""
    fault = {"fault": "expired"} if expiry == "fault_path" else {}
    extra = (
        [{"api_name": "expired", "type": "Fault", "code": "WAIT_EXPIRED"}]
        if expiry == "fault_path"
        else []
    )
    return _flow(
        name,
        [
            {
                "api_name": "await_decision",
                "type": "Wait",
                "wait": {
                    "kind": "event",
                    "producer_kind": "approval.decision",
                    "key": "ticket",
                    "condition": "$Event.status == 'approved'",
                },
                "deadline": "P7D",
                "expiry_policy": expiry,
                "next": "approved",
                **fault,
            },
            {
                "api_name": "approved",
                "type": "Assignment",
                "assignments": [{"target": "outcome", "value": "'approved'"}],
            },
            *extra,
        ],
        [
            {"name": "ticket", "type": "string", "input": True},
            {"name": "outcome", "type": "string", "output": True},
        ],
    )


def pure_wait_flow(name: str = "legacy_pure_wait") -> dict[str, Any]:
    """A one-hour timer between two assignments: pauses without touching any record."""
    return _flow(
        name,
        [
            {
                "api_name": "before",
                "type": "Assignment",
                "assignments": [{"target": "stage", "value": "'waiting'"}],
                "next": "hold",
            },
            {
                "api_name": "hold",
                "type": "Wait",
                "wait": {"kind": "time", "duration": "PT1H"},
                "deadline": "P1D",
                "expiry_policy": "terminal_failure",
                "next": "after",
            },
            {
                "api_name": "after",
                "type": "Assignment",
                "assignments": [{"target": "stage", "value": "'done'"}],
            },
        ],
        [{"name": "stage", "type": "string", "output": True}],
    )
