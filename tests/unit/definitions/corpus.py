"""The shared compiler corpus inputs (``tests/flows``), loaded for definitions unit tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, compile_plan

FLOWS = Path(__file__).resolve().parents[2] / "flows"
INPUTS = FLOWS / "_inputs"


def read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def inputs_doc() -> dict[str, Any]:
    return {
        "binding": read(INPUTS / "binding.json"),
        "catalog": read(INPUTS / "catalog.json"),
        "metadata_view": read(INPUTS / "metadata_view.json"),
        "policy": read(INPUTS / "policy.json"),
        "subflows": [read(p) for p in sorted((INPUTS / "subflows").glob("*.json"))],
    }


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def inputs(name: str | None = None) -> CompilerInputs:
    """The shared inputs, with case ``name``'s ``inputs_patch.json`` applied if it has one."""
    doc = inputs_doc()
    patch = FLOWS / name / "inputs_patch.json" if name else None
    if patch is not None and patch.exists():
        doc = _merge(doc, read(patch))
    return CompilerInputs.from_dict(doc)


def flow(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = read(FLOWS / name / "flow.json")
    return doc


def plan(name: str) -> ExecutionPlan:
    return compile_plan(flow(name), inputs(name))
