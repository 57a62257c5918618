"""Loads the golden Flow corpus under ``tests/flows`` and renders expected outputs.

Each ``tests/flows/<name>/`` holds ``flow.json`` and, optionally,
``inputs_patch.json`` (an RFC 7396 JSON merge patch applied to the shared
inputs in ``tests/flows/_inputs``). A successful compile renders ``plan.json``
and ``explain.txt``; a rejected one renders ``diagnostics.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime_svc.compiler import CompilerInputs, PlanCompileError, compile_plan, explain
from runtime_svc.waits.registry import ProducerRegistry

FLOWS = Path(__file__).resolve().parents[2] / "flows"
INPUTS = FLOWS / "_inputs"
OUTPUT_FILES = ("plan.json", "explain.txt", "diagnostics.json")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def read_flow(name: str) -> dict[str, Any]:
    """The ``flow.json`` of corpus case ``name``."""
    doc: dict[str, Any] = read_json(FLOWS / name / "flow.json")
    return doc


def render_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def inputs_doc() -> dict[str, Any]:
    """The shared inputs as one JSON document (``CompilerInputs.from_dict`` shape)."""
    return {
        "binding": read_json(INPUTS / "binding.json"),
        "catalog": read_json(INPUTS / "catalog.json"),
        "metadata_view": read_json(INPUTS / "metadata_view.json"),
        "policy": read_json(INPUTS / "policy.json"),
        "subflows": [read_json(p) for p in sorted((INPUTS / "subflows").glob("*.json"))],
    }


def load_inputs(patch: dict[str, Any] | None = None) -> CompilerInputs:
    doc = inputs_doc()
    if patch:
        doc = merge_patch(doc, patch)
    return CompilerInputs.from_dict(doc)


def flow_names() -> list[str]:
    return sorted(p.name for p in FLOWS.iterdir() if p.is_dir() and not p.name.startswith("_"))


def case_inputs(name: str) -> CompilerInputs:
    patch_file = FLOWS / name / "inputs_patch.json"
    return load_inputs(read_json(patch_file) if patch_file.exists() else None)


def render_case(name: str) -> dict[str, str]:
    """Expected output files of one corpus case, rendered from a fresh compile."""
    source = read_json(FLOWS / name / "flow.json")
    inputs = case_inputs(name)
    try:
        plan = compile_plan(source, inputs)
    except PlanCompileError as exc:
        return {"diagnostics.json": render_json(exc.to_dict())}
    # As ``flowctl flow compile --explain``: the runtime's producer registry annotates
    # every dependency with its producer contract and the policy's wait bounds (here a
    # runtime configured with the view's event producers as its external signal kinds).
    kinds = [p.kind for p in inputs.metadata_view.wait_producers if p.reconciliation == "event"]
    notes = ProducerRegistry(kinds).explainer(inputs.policy)
    return {"plan.json": render_json(plan.to_dict()), "explain.txt": explain(plan, notes)}


def autolaunched(
    name: str,
    elements: list[dict[str, Any]],
    *,
    start: str | None = None,
    variables: list[dict[str, Any]] | None = None,
    run_atomically: bool | None = None,
) -> dict[str, Any]:
    """A small autolaunched Flow document for focused tests."""
    doc: dict[str, Any] = {
        "api_name": name,
        "version": 1,
        "process_type": "autolaunched",
        "variables": variables or [],
        "start": start or elements[0]["api_name"],
        "elements": elements,
    }
    if run_atomically is not None:
        doc["run_atomically"] = run_atomically
    return doc


def with_subflows(*flows: dict[str, Any], patch: dict[str, Any] | None = None) -> CompilerInputs:
    """Shared inputs plus extra subflow sources (and an optional merge patch)."""
    doc = inputs_doc()
    if patch:
        doc = merge_patch(doc, patch)
    doc["subflows"] = [*doc["subflows"], *flows]
    return CompilerInputs.from_dict(doc)
