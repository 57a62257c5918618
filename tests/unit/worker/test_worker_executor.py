"""The worker's pure step interpreter (no database): element semantics, advances, and
fail-closed step kinds."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from decimal import Decimal
from typing import Any

import pytest

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, StepKind, compile_plan
from runtime_svc.compiler.kinds import TerminalOutcome
from runtime_svc.kernel.decisions import FailRun, FinishRun, NextStep
from runtime_svc.worker import (
    MutationIntent,
    StepFault,
    WorkerSettings,
    interpret,
    needs_transaction,
)
from runtime_svc.worker.executor import LOOPS_KEY, env_of, to_json_value, to_record_value
from services.config import ConfigError, ServiceName, load_config
from tests.unit.compiler.compiler_corpus import FLOWS, inputs_doc, merge_patch, read_json


def _ctx(**variables: Any) -> dict[str, Any]:
    """A checkpoint context in the canonical layout."""
    return {"variables": variables}


def _plan(elements: list[dict[str, Any]], variables: list[dict[str, Any]]) -> ExecutionPlan:
    doc = merge_patch(inputs_doc(), {"policy": {"version": 9, "bounded_atomic": {"max_writes": 0}}})
    flow = {
        "api_name": "unit_flow",
        "version": 1,
        "description": "worker unit test",
        "process_type": "autolaunched",
        "variables": variables,
        "start": elements[0]["api_name"],
        "elements": elements,
    }
    return compile_plan(flow, CompilerInputs.from_dict(doc))


ROUTED = _plan(
    [
        {
            "api_name": "route",
            "type": "Decision",
            "rules": [{"name": "big", "condition": "n > 10", "next": "make_big"}],
            "next": "make_small",
        },
        {
            "api_name": "make_big",
            "type": "CreateRecord",
            "object": "Account",
            "fields": {"Name": "CONCAT('big ', TEXT(n))"},
            "output_variable": "acct",
            "next": "bump",
        },
        {
            "api_name": "make_small",
            "type": "CreateRecord",
            "object": "Account",
            "fields": {"Name": "'small'"},
            "output_variable": "acct",
            "next": "bump",
        },
        {
            "api_name": "bump",
            "type": "UpdateRecord",
            "object": "Account",
            "record": "acct",
            "fields": {"AnnualRevenue": "n * 2"},
            "next": "stop",
        },
        {"api_name": "stop", "type": "Fault", "code": "DONE_BADLY", "message": "x"},
    ],
    [
        {"name": "n", "type": "number", "input": True},
        {"name": "acct", "type": "record", "object": "Account"},
    ],
)


async def test_decision_routes_to_the_rule_target_step() -> None:
    out = await interpret(ROUTED, ROUTED.step("route"), _ctx(n=20))
    assert isinstance(out.advance, NextStep) and out.advance.plan_step_key == "make_big"
    out = await interpret(ROUTED, ROUTED.step("route"), _ctx(n=2))
    assert isinstance(out.advance, NextStep) and out.advance.plan_step_key == "make_small"
    assert out.intents == ()


async def test_create_record_is_an_intent_and_binds_the_output_variable() -> None:
    step = ROUTED.step("make_big")
    assert needs_transaction(step)
    out = await interpret(ROUTED, step, _ctx(n=20))
    [intent] = out.intents
    assert intent.kind == "create" and intent.object_name == "Account"
    assert intent.fields == {"Name": "big 20"}
    assert out.context["variables"]["acct"] == {"Id": intent.record_id, "Name": "big 20"}
    assert isinstance(out.advance, NextStep) and out.advance.plan_step_key == "bump"


async def test_update_record_targets_the_variable_record() -> None:
    out = await interpret(ROUTED, ROUTED.step("bump"), _ctx(n=3, acct={"Id": "acc-1"}))
    assert out.intents == (MutationIntent("update", "Account", "acc-1", {"AnnualRevenue": 6}),)


async def test_update_without_record_id_is_a_terminal_step_fault() -> None:
    with pytest.raises(StepFault) as err:
        await interpret(ROUTED, ROUTED.step("bump"), _ctx(n=3, acct=None))
    assert err.value.code == "missing_record_id"


async def test_explicit_fault_fails_the_run_with_its_code() -> None:
    out = await interpret(ROUTED, ROUTED.step("stop"), {})
    assert out.advance == FailRun("DONE_BADLY")


async def test_terminal_steps_finish_or_fail() -> None:
    terminals = [s for s in ROUTED.steps if s.kind is StepKind.TERMINAL]
    assert terminals
    for step in terminals:
        advance = (await interpret(ROUTED, step, {})).advance
        expected = FailRun if step.outcome is TerminalOutcome.FAILED else FinishRun
        assert isinstance(advance, expected)


async def test_effect_and_wait_steps_fail_closed_as_unsupported() -> None:
    plan = ExecutionPlan.from_dict(read_json(FLOWS / "durable_snapshot_verify" / "plan.json"))
    for key in ("tell_owner#submit", "tell_owner#completion"):
        with pytest.raises(StepFault) as err:
            await interpret(plan, plan.step(key), {})
        assert err.value.code == "unsupported_step_kind"


async def test_expression_errors_are_step_faults() -> None:
    with pytest.raises(StepFault) as err:
        await interpret(ROUTED, ROUTED.step("route"), _ctx(n="not a number"))
    assert err.value.code == "expression_error"


async def test_assignment_and_loop_run_in_one_pure_step() -> None:
    plan = _plan(
        [
            {
                "api_name": "each",
                "type": "Loop",
                "collection": "items",
                "item_variable": "it",
                "each": "add",
                "next": "make",
            },
            {
                "api_name": "add",
                "type": "Assignment",
                "assignments": [{"target": "total", "op": "add", "value": "it"}],
                "next": "each",
            },
            {
                "api_name": "make",
                "type": "CreateRecord",
                "object": "Account",
                "fields": {"Name": "TEXT(total)"},
            },
        ],
        [
            {"name": "items", "type": "number", "collection": True, "input": True},
            {"name": "total", "type": "number"},
            {"name": "it", "type": "number"},
        ],
    )
    # Durable Orchestration: the loop and its body are separate steps, so the loop cursor
    # and the step invocation counters travel in the checkpoint context.
    context: dict[str, Any] = _ctx(items=[1, 2, 3], total=0)
    key, ordinals = plan.start_step, []
    for _ in range(10):
        out = await interpret(plan, plan.step(key), context)
        context = out.context
        assert isinstance(out.advance, NextStep)
        key = out.advance.plan_step_key
        ordinals.append((key, out.advance.invocation_ordinal))
        if key == "make":
            break
    assert context["variables"]["total"] == 6
    assert LOOPS_KEY not in context
    assert ordinals == [
        ("add", 0),
        ("each", 1),
        ("add", 1),
        ("each", 2),
        ("add", 2),
        ("each", 3),
        ("make", 0),
    ]


def test_checkpoint_values_are_json_safe() -> None:
    value = {"a": Decimal("2"), "b": [Decimal("1.50")], "c": "x"}
    assert json.loads(json.dumps(to_json_value(value))) == {"a": 2, "b": ["1.50"], "c": "x"}


class _Tagged(str):
    """A str subclass: not a JSON scalar's own type (it takes the general path)."""


def _mixed() -> dict[Any, Any]:
    """Plain and general shapes together: an int key, decimals, a tuple, an ordered
    mapping, a str subclass, nested containers."""
    return {
        1: True,
        "n": None,
        "f": 1.5,
        "t": (Decimal("3"), [Decimal("0.5")]),
        "m": OrderedDict(k=Decimal("4")),
        "s": _Tagged("tag"),
        "nested": [{"d": Decimal("1.0")}, []],
    }


def test_json_values_take_the_fast_path_with_the_same_result() -> None:
    value = _mixed()
    converted = to_json_value(value)
    assert converted == {
        "1": True,
        "n": None,
        "f": 1.5,
        "t": [3, ["0.5"]],
        "m": {"k": 4},
        "s": "tag",
        "nested": [{"d": 1}, []],
    }
    assert type(converted["m"]) is dict and type(converted["t"]) is list
    inner = value["nested"]
    assert converted["nested"] is not inner and converted["nested"][0] is not inner[0]


def _settings(env: dict[str, str]) -> WorkerSettings:
    return WorkerSettings.from_config(load_config(ServiceName.RUNTIME, env))


def test_settings_are_read_through_the_service_config() -> None:
    s = _settings(
        {
            "FLOW_RUNTIME_WORKERS": "0",
            "FLOW_RUNTIME_SWEEPS": "false",
            "FLOW_RUNTIME_LEASE_MS": "900",
            "FLOW_RUNTIME_RETRY_BASE_MS": "400000",
            "FLOW_REQUEST_RETENTION_HOURS": "2",
        }
    )
    assert (s.workers, s.sweeps, s.retry_policy().lease_duration_ms) == (0, False, 900)
    assert (s.retry_base_ms, s.retry_max_ms, s.request_retention_hours) == (400000, 400000, 2)
    assert _settings({}) == WorkerSettings()
    for bad in (
        {"FLOW_RUNTIME_WORKERS": "-1"},
        {"FLOW_RUNTIME_SWEEPS": "maybe"},
        {"FLOW_RUNTIME_RETRY_BASE_MS": "10", "FLOW_RUNTIME_RETRY_MAX_MS": "5"},
    ):
        with pytest.raises(ConfigError):
            _settings(bad)


def _containers(value: Any) -> list[int]:
    if isinstance(value, dict):
        return [id(value), *(i for v in value.values() for i in _containers(v))]
    if isinstance(value, list):
        return [id(value), *(i for v in value for i in _containers(v))]
    return []


def test_env_of_is_a_deep_copy_sharing_no_container_with_the_context() -> None:
    """``env_of`` copies a context's JSON shapes itself (no ``copy.deepcopy`` memo) and
    hands anything else to ``copy.deepcopy``: equal to it, nothing shared."""
    context: dict[str, Any] = {
        "variables": {
            "n": 1,
            "x": 2.5,
            "s": "text",
            "flag": False,
            "none": None,
            "exact": Decimal("1.10"),
            "list": [1, {"a": [2, 3]}, []],
            "nested": {"b": {"c": ["d"]}},
            "pair": (1, [2]),
        },
        "$output": {"record_id": "r1", "fields": {"Name": "Ada"}},
        "trigger": {"ignored": True},
    }
    env = env_of(context)
    expected = copy.deepcopy(dict(context["variables"]))
    expected["$output"] = copy.deepcopy(context["$output"])
    assert env == expected
    assert not set(_containers(env)) & set(_containers(context))
    assert env["pair"] == (1, [2]) and env["pair"][1] is not context["variables"]["pair"][1]
    env["list"][1]["a"].append(4)
    assert context["variables"]["list"][1]["a"] == [2, 3]


def test_record_values_take_the_fast_path_with_the_same_result() -> None:
    value = _mixed()
    converted = to_record_value(value)
    assert converted == {
        "1": True,
        "n": None,
        "f": 1.5,
        "t": [3, [0.5]],  # record number fields hold JSON numbers
        "m": {"k": 4},
        "s": "tag",
        "nested": [{"d": 1}, []],
    }
    assert type(converted["m"]) is dict and type(converted["t"]) is list
    assert type(converted["t"][1][0]) is float and type(converted["nested"][0]["d"]) is int
    inner = value["nested"]
    assert converted["nested"] is not inner and converted["nested"][0] is not inner[0]
