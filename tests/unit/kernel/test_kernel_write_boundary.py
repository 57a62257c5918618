"""Module-boundary gate (§10.1 "a module-boundary gate rejects direct FlowInterview SQL
and generic table DML outside the state store"; §22.2 "generic CRUD, bulk, upsert, and
physical delete reject all FlowInterview writes").

``FlowRunStateStore`` (``runtime_svc/kernel/store*.py``) is the only writer of the four
lifecycle tables. This test parses every module under ``runtime_svc/`` (migrations
excluded: DDL and data migrations are versioned schema history) and fails on any DML
against those tables: ``<table>.insert()/.update()/.delete()``, ``insert(<table>)`` /
``update(...)`` / ``delete(...)`` in any spelling, the kernel's ``cas_update`` /
``insert_if_absent`` helpers aimed at them, ad-hoc ``table("flow_runs")`` handles, and
raw SQL text that writes them. The scanner is itself tested on planted violations.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "runtime_svc"
PROTECTED = frozenset(
    {"flow_runs", "flow_step_executions", "flow_step_attempts", "flow_checkpoints"}
)
_DML_METHODS = frozenset({"insert", "update", "delete"})
_HELPERS = frozenset({"cas_update", "insert_if_absent"})
_RAW_SQL = re.compile(
    r"\b(?:INSERT\s+(?:IGNORE\s+)?INTO|REPLACE\s+INTO|UPDATE|DELETE\s+FROM|TRUNCATE(?:\s+TABLE)?)"
    r"\s+[`\"]?(" + "|".join(sorted(PROTECTED)) + r")\b",
    re.IGNORECASE,
)


def _allowed(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    return rel.startswith("migrations/") or re.fullmatch(r"kernel/store\w*\.py", rel) is not None


def _table_ref(node: ast.AST | None) -> str | None:
    """The protected table a node names: ``flow_runs`` or ``schema.flow_runs``."""
    if isinstance(node, ast.Name) and node.id in PROTECTED:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in PROTECTED:
        return node.attr
    return None


def _callee(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def violations(
    source: str, filename: str = "<memory>", *, schema_module: bool = False
) -> list[str]:
    """Every write to a protected table in ``source`` (``file:line: what``)."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _callee(node)
            func = node.func
            # flow_runs.insert() / schema.flow_steps.update() / .delete()
            if isinstance(func, ast.Attribute) and func.attr in _DML_METHODS:
                table = _table_ref(func.value)
                if table:
                    found.append(f"{filename}:{node.lineno}: {table}.{func.attr}()")
            # insert(flow_runs) / sa.update(schema.flow_runs) / delete(...)
            if name in _DML_METHODS and node.args and _table_ref(node.args[0]):
                found.append(f"{filename}:{node.lineno}: {name}({_table_ref(node.args[0])})")
            # cas_update(conn, flow_runs, ...) / insert_if_absent(conn, table=flow_runs, ...)
            if name in _HELPERS:
                candidates = [
                    *node.args[1:2],
                    *(k.value for k in node.keywords if k.arg == "table"),
                ]
                for arg in candidates:
                    if _table_ref(arg):
                        found.append(f"{filename}:{node.lineno}: {name}({_table_ref(arg)})")
            # table("flow_runs") / Table("flow_runs", ...) outside the schema module
            if (
                name in ("table", "Table")
                and not schema_module
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in PROTECTED
            ):
                found.append(f"{filename}:{node.lineno}: {name}({node.args[0].value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _RAW_SQL.search(node.value)
            if match:
                found.append(f"{filename}:{node.lineno}: raw SQL writes {match.group(1)}")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not _allowed(p))


def test_no_module_outside_the_state_store_writes_the_lifecycle_tables() -> None:
    modules = _modules()
    assert PACKAGE / "definitions" / "repository.py" in modules  # a real reader is scanned
    assert PACKAGE / "kernel" / "transitions.py" in modules  # so are the pure kernel modules
    offenders = [
        v
        for path in modules
        for v in violations(
            path.read_text(encoding="utf-8"),
            str(path.relative_to(ROOT)),
            schema_module=path == PACKAGE / "schema.py",
        )
    ]
    assert offenders == []


def test_the_state_store_is_where_the_writes_are() -> None:
    store_sources = "\n".join(
        p.read_text(encoding="utf-8") for p in sorted((PACKAGE / "kernel").glob("store*.py"))
    )
    found = violations(store_sources)
    assert any("insert_if_absent(flow_runs)" in v for v in found)
    assert any("cas_update(flow_runs)" in v for v in found)
    assert any("update(flow_step_executions)" in v for v in found)


@pytest.mark.parametrize(
    "planted",
    [
        "flow_runs.insert().values(x=1)",
        "schema.flow_step_attempts.update().values(x=1)",
        "flow_checkpoints.delete()",
        "sa.insert(flow_runs)",
        "update(schema.flow_step_executions)",
        "delete(flow_step_attempts)",
        "cas_update(conn, flow_runs, org_id='o', key={}, expected_version=1, values={})",
        "insert_if_absent(conn, table=flow_checkpoints, values={})",
        "text('UPDATE flow_runs SET runtime_state = 1')",
        "conn.exec_driver_sql('delete from `flow_step_attempts` where 1')",
        "'INSERT INTO flow_checkpoints (org_id) VALUES (1)'",
        "'REPLACE INTO flow_runs VALUES (1)'",
        "sqlalchemy.table('flow_runs')",
    ],
)
def test_the_scanner_catches_every_planted_write(planted: str) -> None:
    assert violations(f"from x import *\n{planted}\n"), planted


@pytest.mark.parametrize(
    "allowed",
    [
        "select(flow_runs).where(flow_runs.c.org_id == 'o')",
        "flow_runs.c.runtime_state.in_(['Running'])",
        "update(records).values(x=1)",
        "'SELECT * FROM flow_runs'",
        "'update the flow_runs docs'",
    ],
)
def test_the_scanner_ignores_reads_and_other_tables(allowed: str) -> None:
    assert violations(f"{allowed}\n") == []
