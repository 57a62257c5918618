"""No ``assert`` as a runtime check in production code (STYLE "not to copy"; issue 10,
item 14): ``python -O`` strips it. Invariants raise ``services.invariants.InvariantError``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "catalog_svc", "runtime_svc", "effect_owner_svc", "flowctl", "bench")


def _asserts(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]


def _sources() -> list[Path]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "proto/nexus" not in path.as_posix():
                out.append(path)
    return out


def test_no_production_module_uses_assert() -> None:
    found = {str(p.relative_to(ROOT)): lines for p in _sources() if (lines := _asserts(p))}
    assert found == {}


def test_the_scanner_finds_an_assert(tmp_path: Path) -> None:
    planted = tmp_path / "m.py"
    planted.write_text("def f(x):\n    assert x\n", encoding="utf-8")
    assert _asserts(planted) == [2]
