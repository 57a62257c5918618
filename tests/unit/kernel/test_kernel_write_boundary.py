"""Module-boundary gate (§10.1 "a module-boundary gate rejects direct FlowInterview SQL
and generic table DML outside the state store"; §22.2 "generic CRUD, bulk, upsert, and
physical delete reject all FlowInterview writes"; §20.3 9 "a boundary/inventory test
proves there is no ID-only FlowInterview read/claim/mutation/repair path").

Writers, per table (everything else fails):

* ``FlowRunStateStore`` (``runtime_svc/kernel/store*.py``) — the four V2 lifecycle tables;
* ``LegacyInterviewStore`` (``runtime_svc/legacy/store.py``) — ``flow_runs`` only, and only
  inside its two helpers: the creation insert that forces ``LegacyInterpreter``/0, and the
  compare-and-swap whose predicate carries ``execution_owner``, ``ownership_epoch`` and
  ``state_version`` (so it cannot match a V2-owned row);
* the trusted backfill (``runtime_svc/migration/backfill.py``) — the pre-bridge
  ``flow_interviews`` shape (OrgID stamping, adoption marks).

The legacy owner also shares no code path with the V2 write paths: no module of
``runtime_svc/legacy`` imports the V2 kernel store/transitions or the V2 worker, atomic
or embedded executors, and none of those imports the legacy package.

This test parses every module under ``runtime_svc/`` (migrations excluded: DDL and data
migrations are versioned schema history) and fails on any DML against those tables:
``<table>.insert()/.update()/.delete()``, ``insert(<table>)`` / ``update(...)`` /
``delete(...)`` in any spelling, the kernel's ``cas_update`` / ``fenced_update`` /
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
    {
        "flow_runs",
        "flow_step_executions",
        "flow_step_attempts",
        "flow_checkpoints",
        "flow_interviews",
    }
)
#: Module (relative to runtime_svc/) -> the protected tables it may write.
WRITERS: dict[str, frozenset[str]] = {
    "legacy/store.py": frozenset({"flow_runs"}),
    "migration/backfill.py": frozenset({"flow_interviews"}),
}
#: The only functions of legacy/store.py that may write flow_runs.
LEGACY_WRITE_HELPERS = frozenset({"_insert_legacy_row", "_legacy_cas"})
_DML_METHODS = frozenset({"insert", "update", "delete"})
_HELPERS = frozenset({"cas_update", "fenced_update", "insert_if_absent"})
#: Helpers taking the table first: a batch write's INSERT (``services.db_batch``) and the
#: shared INSERT construct (``services.db.insert_statement``).
_TABLE_FIRST_HELPERS = frozenset({"insert_if_absent_write", "insert_statement"})
_RAW_SQL = re.compile(
    r"\b(?:INSERT\s+(?:IGNORE\s+)?INTO|REPLACE\s+INTO|UPDATE|DELETE\s+FROM|TRUNCATE(?:\s+TABLE)?)"
    r"\s+[`\"]?(" + "|".join(sorted(PROTECTED)) + r")\b",
    re.IGNORECASE,
)


def _allowed(path: Path) -> bool:
    """Modules not scanned at all: schema history and the V2 state store."""
    rel = path.relative_to(PACKAGE).as_posix()
    return rel.startswith("migrations/") or re.fullmatch(r"kernel/store\w*\.py", rel) is not None


def _table_of(violation: str) -> str:
    return next(t for t in sorted(PROTECTED, key=len, reverse=True) if t in violation)


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
            # cas_update(conn, flow_runs, ...) / insert_if_absent(conn, table=flow_runs, ...) /
            # insert_if_absent_write(flow_runs, ...)
            if name in _HELPERS or name in _TABLE_FIRST_HELPERS:
                first = 0 if name in _TABLE_FIRST_HELPERS else 1
                candidates = [
                    *node.args[first : first + 1],
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
    assert PACKAGE / "legacy" / "store.py" in modules  # the legacy owner is scanned too
    offenders = []
    for path in modules:
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = WRITERS.get(rel, frozenset())
        for v in violations(
            path.read_text(encoding="utf-8"),
            str(path.relative_to(ROOT)),
            schema_module=path.name in ("schema.py", "schema_bridge.py"),
        ):
            if _table_of(v) not in allowed:
                offenders.append(v)
    assert offenders == []


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def legacy_write_sites(source: str) -> dict[str, list[str]]:
    """``function name -> flow_runs writes`` of a legacy store module (module level: "")."""
    tree = ast.parse(source)
    out: dict[str, list[str]] = {}
    inside: set[int] = set()
    for fn in _functions(tree):
        fn_source = ast.get_source_segment(source, fn) or ""
        found = [v for v in violations(fn_source) if "flow_runs" in v]
        if found:
            out[fn.name] = found
            inside.update(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
    stray = [v for v in violations(source) if "flow_runs" in v]
    top = [v for v in stray if int(v.split(":")[1]) not in inside]
    if top:
        out[""] = top
    return out


def _predicated(fn_source: str) -> bool:
    """A legacy write helper pins owner and epoch (CAS predicate or forced insert values)."""
    compact = re.sub(r"\s+", "", fn_source)
    cas = "execution_owner==LEGACY_OWNER" in compact and "ownership_epoch==LEGACY_EPOCH" in compact
    insert = (
        '"execution_owner":LEGACY_OWNER' in compact
        and '"ownership_epoch":LEGACY_EPOCH' in compact
        and compact.index("**values") < compact.index('"execution_owner":LEGACY_OWNER')
    )
    return cas or insert


def test_the_legacy_owner_writes_flow_runs_only_through_its_predicated_helpers() -> None:
    source = (PACKAGE / "legacy" / "store.py").read_text(encoding="utf-8")
    sites = legacy_write_sites(source)
    assert set(sites) == LEGACY_WRITE_HELPERS, sites
    tree = ast.parse(source)
    for fn in _functions(tree):
        if fn.name in LEGACY_WRITE_HELPERS:
            assert _predicated(ast.get_source_segment(source, fn) or ""), fn.name
    # The CAS also compares the state version (services.db.cas_update's expected_version).
    cas = next(f for f in _functions(tree) if f.name == "_legacy_cas")
    assert "expected_version=expected_version" in (ast.get_source_segment(source, cas) or "")


@pytest.mark.parametrize(
    "planted",
    [
        "async def claim(conn):\n    await conn.execute(update(flow_runs).values(x=1))\n",
        "async def _legacy_cas(conn):\n    await cas_update(conn, flow_runs, org_id='o')\n",
        # the caller's values could override owner and epoch: not predicated
        "async def _insert_legacy_row(conn, values):\n"
        '    row = {"execution_owner": LEGACY_OWNER, "ownership_epoch": LEGACY_EPOCH, **values}\n'
        "    await insert_if_absent(conn, flow_runs, row)\n",
    ],
)
def test_the_legacy_helper_check_catches_stray_or_unpredicated_writes(planted: str) -> None:
    sites = legacy_write_sites(f"from x import *\n{planted}")
    tree = ast.parse(planted)
    fns = [f for f in _functions(tree) if f.name in sites]
    assert set(sites) - LEGACY_WRITE_HELPERS or not all(
        _predicated(ast.get_source_segment(planted, f) or "") for f in fns
    )


#: Modules of the V2 write paths the legacy owner must not share.
_V2_WRITE_PATHS = (
    "runtime_svc.kernel.store",
    "runtime_svc.kernel.transitions",
    "runtime_svc.kernel.decisions",
    "runtime_svc.kernel.patches",
    "runtime_svc.worker.loop",
    "runtime_svc.worker.executor",
    "runtime_svc.worker.background",
    "runtime_svc.worker.snapshots",
    "runtime_svc.atomic",
    "runtime_svc.embedded",
)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_legacy_owner_shares_no_code_path_with_the_v2_write_paths() -> None:
    legacy = sorted((PACKAGE / "legacy").glob("*.py"))
    assert legacy, "runtime_svc/legacy is scanned"
    offenders = [
        f"{p.name}: {m}"
        for p in legacy
        for m in sorted(_imports(p))
        if any(m == v or m.startswith(v) for v in _V2_WRITE_PATHS)
    ]
    assert offenders == []
    v2 = [
        *sorted((PACKAGE / "kernel").glob("store*.py")),
        *sorted((PACKAGE / "worker").glob("*.py")),
        *sorted((PACKAGE / "atomic").glob("*.py")),
        *sorted((PACKAGE / "embedded").glob("*.py")),
    ]
    back = [
        f"{p.name}: {m}"
        for p in v2
        for m in sorted(_imports(p))
        if m.startswith("runtime_svc.legacy")
    ]
    assert back == []


def test_the_state_store_is_where_the_writes_are() -> None:
    store_sources = "\n".join(
        p.read_text(encoding="utf-8") for p in sorted((PACKAGE / "kernel").glob("store*.py"))
    )
    found = violations(store_sources)
    assert any("insert_if_absent_write(flow_runs)" in v for v in found)
    assert any("fenced_update(flow_runs)" in v for v in found)
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
        "fenced_update(conn, flow_runs, org_id='o', key={}, expected_version=1, values={})",
        "insert_if_absent(conn, table=flow_checkpoints, values={})",
        "insert_if_absent_write(flow_runs, {})",
        "db_batch.insert_if_absent_write(table=flow_step_attempts, values={})",
        "insert_statement(schema.flow_checkpoints)",
        "text('UPDATE flow_runs SET runtime_state = 1')",
        "conn.exec_driver_sql('delete from `flow_step_attempts` where 1')",
        "'INSERT INTO flow_checkpoints (org_id) VALUES (1)'",
        "'REPLACE INTO flow_runs VALUES (1)'",
        "sqlalchemy.table('flow_runs')",
        "flow_interviews.update().values(org_id='o')",
        "'UPDATE flow_interviews SET org_id = NULL'",
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
