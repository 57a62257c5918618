"""Flow documents and catalog inputs used by the definitions tests.

The catalog inputs are the shared corpus inputs (``tests/flows/_inputs``) published
through a catalog; the Flows are small ones written for these tests.
"""

from __future__ import annotations

from typing import Any

from tests.integration.definitions.catalog_protos import read_input, view_proto

#: Trigger subscription the view publishes for :func:`welcome_flow`.
WELCOME_SUBSCRIPTION = {
    "flow_api_name": "welcome_contact",
    "object": "Contact",
    "timing": "after_save",
    "events": ["create"],
}


def entries() -> list[dict[str, Any]]:
    """The corpus catalog entries."""
    entries: list[dict[str, Any]] = read_input("catalog.json")["entries"]
    return entries


def view(org: str, app: str = "inst-1", **kwargs: Any) -> Any:
    """The corpus metadata view as a ``catalog_v1.MetadataView`` of ``org``/``app``."""
    kwargs.setdefault("extra_subscriptions", [WELCOME_SUBSCRIPTION])
    return view_proto(read_input("metadata_view.json"), org, app, **kwargs)


def task_flow(
    name: str = "make_task", *, version: int = 1, run_atomically: bool = True, subject: str = "x"
) -> dict[str, Any]:
    """Autolaunched; creates one Task. Bounded Atomic under the default policy."""
    return {
        "api_name": name,
        "version": version,
        "label": f"Make a task ({name})",
        "process_type": "autolaunched",
        "run_atomically": run_atomically,
        "variables": [{"name": "recordId", "type": "string", "input": True}],
        "start": "make",
        "elements": [
            {
                "api_name": "make",
                "type": "CreateRecord",
                "object": "Task",
                "fields": {"Subject": f"'{subject}'", "Status": "'Open'"},
                "next": "done",
            },
            {"api_name": "done", "type": "End"},
        ],
    }


def welcome_flow(version: int = 1) -> dict[str, Any]:
    """Record-triggered after-save on Contact create (subscribed by the view)."""
    return {
        "api_name": "welcome_contact",
        "version": version,
        "process_type": "record_triggered",
        "trigger": {"object": "Contact", "timing": "after_save", "events": ["create"]},
        "start": "mark",
        "elements": [
            {
                "api_name": "mark",
                "type": "UpdateRecord",
                "object": "Contact",
                "record": "$Record",
                "fields": {"Welcomed": "true"},
            }
        ],
    }


def email_flow(name: str = "email_owner") -> dict[str, Any]:
    """Autolaunched external effect (send_email): Durable Orchestration."""
    return {
        "api_name": name,
        "version": 1,
        "process_type": "autolaunched",
        "variables": [
            {"name": "to", "type": "string", "input": True},
            {"name": "msgId", "type": "string"},
        ],
        "start": "send",
        "elements": [
            {
                "api_name": "send",
                "type": "ActionCall",
                "action_type": "send_email",
                "inputs": {"to": "to", "subject": "'Hi'", "body": "'Hello'"},
                "output_variable": "msgId",
                "fault": "failed",
            },
            {"api_name": "failed", "type": "Fault", "code": "SEND_FAILED", "message": "no mail"},
        ],
    }


def unknown_capability_flow(name: str = "sync_legacy") -> dict[str, Any]:
    """run_atomically with an action whose capabilities are undeclared: never compiles."""
    return {
        "api_name": name,
        "version": 1,
        "process_type": "autolaunched",
        "run_atomically": True,
        "variables": [{"name": "recordId", "type": "string", "input": True}],
        "start": "sync",
        "elements": [
            {
                "api_name": "sync",
                "type": "ActionCall",
                "action_type": "legacy_sync",
                "inputs": {"recordId": "recordId"},
            }
        ],
    }


def parent_flow(name: str, child: str, child_version: int = 1) -> dict[str, Any]:
    """Autolaunched; calls ``child`` as a Subflow."""
    return {
        "api_name": name,
        "version": 1,
        "process_type": "autolaunched",
        "variables": [{"name": "recordId", "type": "string", "input": True}],
        "start": "call",
        "elements": [
            {
                "api_name": "call",
                "type": "Subflow",
                "flow": child,
                "version": child_version,
                "inputs": {"recordId": "recordId"},
            }
        ],
    }
