"""The legacy element walker's reference semantics (docs/flow-language.md §4-§5), pure."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from runtime_svc.compiler import FlowDef
from runtime_svc.legacy.interpreter import (
    ActionDone,
    ActionFailed,
    ActionOutcome,
    Due,
    EventArrived,
    Failed,
    Finished,
    LegacyFault,
    Paused,
    RecordWrite,
    StillWaiting,
    initial_variables,
    run_segment,
)
from runtime_svc.legacy.ports import parse_source
from runtime_svc.legacy.state import LegacyState, WaitKind, json_value

NOW = datetime(2030, 1, 1, tzinfo=UTC)


class Ports:
    """Dict-backed ports that record what the walk asked for."""

    def __init__(self, subflows: Mapping[tuple[str, int], FlowDef] | None = None) -> None:
        self.records: dict[tuple[str, str], dict[str, Any]] = {}
        self.writes: list[RecordWrite] = []
        self.fail_writes = False
        self.subflows = dict(subflows or {})
        self.created = 0

    async def read_record(self, object_name: str, record_id: str) -> dict[str, Any] | None:
        row = self.records.get((object_name, record_id))
        return None if row is None else {"Id": record_id, **row}

    async def query_records(
        self, object_name: str, field_name: str, value: Any, limit: int
    ) -> list[dict[str, Any]]:
        return [
            {"Id": rid, **row}
            for (obj, rid), row in sorted(self.records.items())
            if obj == object_name and row.get(field_name) == value
        ][:limit]

    async def write_record(self, write: RecordWrite) -> None:
        if self.fail_writes:
            raise LegacyFault("record_not_found", routable=True)
        self.writes.append(write)

    def new_record_id(self) -> str:
        self.created += 1
        return f"r{self.created}"

    async def call_action(
        self, element: str, action_type: str, inputs: Mapping[str, Any]
    ) -> ActionOutcome:
        if action_type == "double":
            return ActionDone(inputs["n"] * 2)
        if action_type == "broken":
            return ActionFailed("action_failed")
        raise LegacyFault("unsupported_action")

    def subflow(self, api_name: str, version: int) -> FlowDef | None:
        return self.subflows.get((api_name, version))


def flow(
    elements: list[dict[str, Any]], variables: list[dict[str, Any]], name: str = "f"
) -> FlowDef:
    return parse_source(
        {
            "api_name": name,
            "version": 1,
            "process_type": "autolaunched",
            "variables": variables,
            "start": elements[0]["api_name"],
            "elements": elements,
        }
    )


async def walk(f: FlowDef, ports: Ports | None = None, **inputs: Any) -> tuple[Any, Any]:
    ports = ports or Ports()
    state = LegacyState.start(f.api_name, f.version, f.start, initial_variables(f, inputs))
    segment = await run_segment(f, state, ports, now=NOW)
    return segment, ports


NUM = {"name": "n", "type": "number", "input": True, "output": True}
LIST = {"name": "xs", "type": "number", "collection": True, "output": True}


async def test_assignment_operators() -> None:
    f = flow(
        [
            {
                "api_name": "a",
                "type": "Assignment",
                "assignments": [
                    {"target": "n", "op": "add", "value": "5"},
                    {"target": "n", "op": "subtract", "value": "2"},
                    {"target": "xs", "op": "add_item", "value": "n"},
                    {"target": "xs", "op": "add", "value": "n * 10"},
                ],
            }
        ],
        [NUM, LIST],
    )
    segment, _ = await walk(f, n=1)
    assert segment.status == Finished({"n": 4, "xs": [4, 40]})
    assert segment.trace == ("a",)


async def test_decision_takes_the_first_true_rule_and_null_is_false() -> None:
    f = flow(
        [
            {
                "api_name": "d",
                "type": "Decision",
                "rules": [
                    {"name": "none", "condition": "missing == 1", "next": "x"},
                    {"name": "big", "condition": "n > 10", "next": "x"},
                    {"name": "also", "condition": "n > 5", "next": "y"},
                ],
                "next": "z",
            },
            {
                "api_name": "x",
                "type": "Assignment",
                "assignments": [{"target": "out", "value": "'x'"}],
            },
            {
                "api_name": "y",
                "type": "Assignment",
                "assignments": [{"target": "out", "value": "'y'"}],
            },
            {
                "api_name": "z",
                "type": "Assignment",
                "assignments": [{"target": "out", "value": "'z'"}],
            },
        ],
        [
            NUM,
            {"name": "out", "type": "string", "output": True},
            {"name": "missing", "type": "number"},
        ],
    )
    assert (await walk(f, n=20))[0].status.outputs["out"] == "x"
    assert (await walk(f, n=7))[0].status.outputs["out"] == "y"
    assert (await walk(f, n=1))[0].trace == ("d", "z")


async def test_a_loop_runs_its_body_once_per_item_and_rejects_a_non_collection() -> None:
    f = flow(
        [
            {
                "api_name": "each",
                "type": "Loop",
                "collection": "xs",
                "item_variable": "x",
                "each": "add",
                "next": "end",
            },
            {
                "api_name": "add",
                "type": "Assignment",
                "assignments": [{"target": "n", "op": "add", "value": "x"}],
                "next": "each",
            },
            {"api_name": "end", "type": "End"},
        ],
        [NUM, {**LIST, "input": True}, {"name": "x", "type": "number"}],
    )
    segment, _ = await walk(f, n=0, xs=[1, 2, 3])
    assert segment.status.outputs == {"n": 6, "xs": [1, 2, 3]}
    assert segment.trace == ("each", "add", "each", "add", "each", "add", "each", "end")
    empty, _ = await walk(f, n=0, xs=[])
    assert empty.trace == ("each", "end")
    broken, _ = await walk(f, n=0, xs=5)
    assert broken.status == Failed("loop_collection_invalid", "each")


async def test_record_faults_follow_the_fault_connector_and_fail_without_one() -> None:
    elements = [
        {
            "api_name": "make",
            "type": "CreateRecord",
            "object": "Task",
            "fields": {"Subject": "'s'"},
            "output_variable": "t",
            "next": "ok",
            "fault": "handled",
        },
        {
            "api_name": "ok",
            "type": "Assignment",
            "assignments": [{"target": "out", "value": "'ok'"}],
        },
        {
            "api_name": "handled",
            "type": "Assignment",
            "assignments": [{"target": "out", "value": "'handled'"}],
        },
    ]
    variables = [
        {"name": "out", "type": "string", "output": True},
        {"name": "t", "type": "record", "object": "Task"},
    ]
    ports = Ports()
    done, _ = await walk(flow(elements, variables), ports)
    assert done.status.outputs == {"out": "ok"}
    assert [w.kind for w in ports.writes] == ["create"]

    failing = Ports()
    failing.fail_writes = True
    routed, _ = await walk(flow(elements, variables), failing)
    assert routed.status.outputs == {"out": "handled"}
    unrouted = [{**elements[0], "fault": None}, *elements[1:]]
    failed, _ = await walk(flow(unrouted, variables), failing)
    assert failed.status == Failed("record_not_found", "make")


async def test_an_expression_error_fails_even_with_a_fault_connector() -> None:
    f = flow(
        [
            {
                "api_name": "a",
                "type": "ActionCall",
                "action_type": "double",
                "inputs": {"n": "n / 0"},
                "next": "b",
                "fault": "b",
            },
            {"api_name": "b", "type": "End"},
        ],
        [NUM],
    )
    segment, _ = await walk(f, n=1)
    assert segment.status == Failed("expression_error", "a")


async def test_actions_assign_results_route_failures_and_refuse_unknown_ones() -> None:
    variables = [NUM, {"name": "out", "type": "number", "output": True}]
    ok = flow(
        [
            {
                "api_name": "a",
                "type": "ActionCall",
                "action_type": "double",
                "inputs": {"n": "n"},
                "output_variable": "out",
            }
        ],
        variables,
    )
    assert (await walk(ok, n=21))[0].status.outputs["out"] == 42
    bad = flow(
        [{"api_name": "a", "type": "ActionCall", "action_type": "broken", "inputs": {}}], variables
    )
    assert (await walk(bad, n=1))[0].status == Failed("action_failed", "a")
    unknown = flow(
        [{"api_name": "a", "type": "ActionCall", "action_type": "nope", "inputs": {}}], variables
    )
    assert (await walk(unknown, n=1))[0].status == Failed("unsupported_action", "a")


async def test_a_subflow_maps_inputs_and_outputs_and_prefixes_its_elements() -> None:
    child = flow(
        [
            {
                "api_name": "calc",
                "type": "Assignment",
                "assignments": [{"target": "y", "value": "x + 1"}],
                "next": "check",
            },
            {
                "api_name": "check",
                "type": "Decision",
                "rules": [{"name": "bad", "condition": "y > 100", "next": "boom"}],
                "next": None,
            },
            {"api_name": "boom", "type": "Fault", "code": "TOO_BIG"},
        ],
        [
            {"name": "x", "type": "number", "input": True},
            {"name": "y", "type": "number", "output": True},
        ],
        name="child",
    )
    parent = flow(
        [
            {
                "api_name": "call",
                "type": "Subflow",
                "flow": "child",
                "version": 1,
                "inputs": {"x": "n"},
                "outputs": {"n": "y"},
                "next": "done",
            },
            {"api_name": "done", "type": "End"},
        ],
        [NUM],
    )
    ports = Ports({("child", 1): child})
    segment, _ = await walk(parent, ports, n=1)
    assert segment.status == Finished({"n": 2})
    assert segment.trace == ("call", "call/calc", "call/check", "done")
    failed, _ = await walk(parent, ports, n=500)
    assert failed.status == Failed("TOO_BIG", "call/boom")
    missing, _ = await walk(parent, Ports(), n=1)
    assert missing.status == Failed("subflow_missing", "call")


async def test_a_child_fault_routes_to_the_calling_subflow_fault_connector() -> None:
    child = flow(
        [
            {
                "api_name": "w",
                "type": "UpdateRecord",
                "object": "Task",
                "record": "r",
                "fields": {"Subject": "'x'"},
            }
        ],
        [{"name": "r", "type": "string", "input": True}],
        name="child",
    )
    parent = flow(
        [
            {
                "api_name": "call",
                "type": "Subflow",
                "flow": "child",
                "version": 1,
                "inputs": {"r": "'t-1'"},
                "next": None,
                "fault": "rescue",
            },
            {
                "api_name": "rescue",
                "type": "Assignment",
                "assignments": [{"target": "n", "value": "-1"}],
            },
        ],
        [NUM],
    )
    ports = Ports({("child", 1): child})
    ports.fail_writes = True
    segment, _ = await walk(parent, ports, n=0)
    assert segment.status == Finished({"n": -1})
    assert segment.trace == ("call", "call/w", "rescue")


def _wait_flow(expiry: str, kind: str = "time") -> FlowDef:
    wait = (
        {"kind": "time", "duration": "PT1H"}
        if kind == "time"
        else {
            "kind": "event",
            "producer_kind": "approval.decision",
            "key": "'k'",
            "condition": "$Event.ok == true",
        }
    )
    fault = {"fault": "late"} if expiry == "fault_path" else {}
    return flow(
        [
            {
                "api_name": "w",
                "type": "Wait",
                "wait": wait,
                "deadline": "PT2H",
                "expiry_policy": expiry,
                "next": "after",
                **fault,
            },
            {
                "api_name": "after",
                "type": "Assignment",
                "assignments": [{"target": "n", "value": "1"}],
            },
            {
                "api_name": "late",
                "type": "Assignment",
                "assignments": [{"target": "n", "value": "-1"}],
            },
        ],
        [NUM],
    )


async def test_a_time_wait_pauses_resumes_when_due_and_expires_past_its_deadline() -> None:
    f = _wait_flow("fault_path")
    paused, ports = await walk(f, n=0)
    assert isinstance(paused.status, Paused)
    wait = paused.status.wait
    assert wait.kind is WaitKind.TIME and wait.element == "w"
    assert (wait.resume_at, wait.deadline_at) == (
        NOW + timedelta(hours=1),
        NOW + timedelta(hours=2),
    )
    assert wait.run_after == wait.resume_at

    early = await run_segment(f, paused.state, ports, now=NOW, resume=Due())
    assert isinstance(early.status, StillWaiting)
    due = await run_segment(f, paused.state, ports, now=NOW + timedelta(hours=1), resume=Due())
    assert due.status == Finished({"n": 1})
    late = await run_segment(f, paused.state, ports, now=NOW + timedelta(hours=3), resume=Due())
    assert late.status == Finished({"n": -1})  # expiry wins once the deadline passed


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("terminal_failure", Failed("wait_expired", "w")),
        ("quarantine", Failed("wait_expired", "w", quarantined=True)),
    ],
)
async def test_expiry_policies(policy: str, expected: Failed) -> None:
    f = _wait_flow(policy, kind="event")
    paused, ports = await walk(f, n=0)
    expired = await run_segment(f, paused.state, ports, now=NOW + timedelta(hours=5), resume=Due())
    assert expired.status == expected


async def test_an_event_wait_is_released_only_by_evidence_meeting_its_condition() -> None:
    f = _wait_flow("terminal_failure", kind="event")
    paused, ports = await walk(f, n=0)
    assert paused.status.wait.key == "k" and paused.status.wait.run_after == NOW + timedelta(
        hours=2
    )
    no = await run_segment(f, paused.state, ports, now=NOW, resume=EventArrived({"ok": False}))
    assert isinstance(no.status, StillWaiting)
    yes = await run_segment(f, paused.state, ports, now=NOW, resume=EventArrived({"ok": True}))
    assert yes.status == Finished({"n": 1})
    assert paused.state.wait is not None  # the input state is never changed in place


async def test_transform_mode_updates_the_trigger_record_in_memory() -> None:
    f = flow(
        [
            {
                "api_name": "t",
                "type": "UpdateRecord",
                "object": "Task",
                "record": "$Record",
                "fields": {"Subject": "'new'"},
            }
        ],
        [],
    )
    ports = Ports()
    state = LegacyState.start("f", 1, "t", {"$Record": {"Id": "t-1", "Subject": "old"}})
    segment = await run_segment(f, state, ports, now=NOW, transform=True)
    assert isinstance(segment.status, Finished) and ports.writes == []
    assert segment.state.frames[0].variables["$Record"] == {"Id": "t-1", "Subject": "new"}


async def test_an_element_cycle_is_bounded_and_the_state_round_trips() -> None:
    f = flow(
        [
            {
                "api_name": "a",
                "type": "Assignment",
                "assignments": [{"target": "n", "value": "n + 0.5"}],
                "next": "b",
            },
            {
                "api_name": "b",
                "type": "Assignment",
                "assignments": [{"target": "n", "value": "n"}],
                "next": "a",
            },
        ],
        [NUM],
    )
    state = LegacyState.start("f", 1, "a", initial_variables(f, {"n": 1.0}))
    assert state.frames[0].variables["n"] == 1  # an integral protobuf double is an int
    segment = await run_segment(f, state, Ports(), now=NOW, max_elements=7)
    assert segment.status == Failed("element_limit_exceeded", "b")
    restored = LegacyState.loads(segment.state.dumps())
    assert restored.frames[0].variables["n"] == 3  # 1 + 4 x 0.5, an integral decimal
    assert restored.fault == {"code": "element_limit_exceeded", "element": "b"}
    assert json_value({"x": Decimal("2.5")}) == {"x": "2.5"}  # exact decimals persist as text
