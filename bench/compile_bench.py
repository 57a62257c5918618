"""Compiler figures: a 200-element Flow's compile time and plans compiled per second."""

from __future__ import annotations

import time
from typing import Any

from runtime_svc.compiler import compile_plan
from tests.unit.compiler.compiler_corpus import load_inputs

__all__ = ["run"]


def _flow(elements: int) -> dict[str, Any]:
    """A chain of Assignment/Decision pairs joined by next connectors (pure compute)."""
    body: list[dict[str, Any]] = []
    for i in range(elements // 2):
        nxt = f"a{i + 1}" if i + 1 < elements // 2 else None
        assign: dict[str, Any] = {
            "api_name": f"a{i}",
            "type": "Assignment",
            "assignments": [{"target": "score", "value": f"score + {i % 7} * amount"}],
            "next": f"d{i}",
        }
        decide: dict[str, Any] = {
            "api_name": f"d{i}",
            "type": "Decision",
            "rules": [
                {"name": f"hi{i}", "condition": f"score > {1000 + i}", "next": nxt or "done"}
            ],
        }
        if nxt:
            decide["next"] = nxt
        else:
            decide["next"] = "done"
        body += [assign, decide]
    body.append(
        {
            "api_name": "done",
            "type": "Assignment",
            "assignments": [{"target": "tier", "value": "'x'"}],
        }
    )
    return {
        "api_name": f"bench_{elements}",
        "version": 1,
        "process_type": "autolaunched",
        "variables": [
            {"name": "amount", "type": "number", "input": True},
            {"name": "score", "type": "number", "output": True},
            {"name": "tier", "type": "string", "output": True},
        ],
        "start": "a0",
        "elements": body,
    }


def run(seconds: float) -> None:
    inputs = load_inputs()
    big = _flow(200)
    start = time.perf_counter()
    plan = compile_plan(big, inputs)
    once = time.perf_counter() - start
    shape = f"({len(plan.steps)} steps, {plan.profile.value})"
    print(f"{'compile':<8} 200-element Flow          {once * 1000:10.1f} ms  {shape}")
    small = _flow(10)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        compile_plan(small, inputs)
        n += 1
    print(f"{'compile':<8} 10-element plans/s        {n / (time.perf_counter() - start):10.0f}")
