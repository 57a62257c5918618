"""Release and rollback evidence from authoritative state (§20.9, §23.1-§23.3).

:func:`rollback_check` answers ``flowctl deploy rollback-check --target VERSION``: the
target's write-protocol generation (from the release manifest the binaries carry) against
the control record and the owned runs — a pre-bridge or unknown target is rejected while
V2 ownership is possible.

:func:`release_evidence` assembles what the system itself can prove — never what a merged
pull request, a build or a log line claims (§23.4 last paragraph):

* §23.1 source gate — the schema proof: clean-install head, live revision and ``verify``;
* §23.2 release gate — the exact release tuple (binary version, write-protocol
  generation, plan compiler generation, schema heads) and the installed distributions
  with their versions, flagging local (editable/path) replacements;
* §23.3 staging gate — live writers reporting their versions and compiler generation
  (fleet registry heartbeats), schema verification, cohort state, bridge control state,
  zero dual ownership, and zero unexplained projection divergence (shadow comparisons).

Items the system cannot evidence from its own state (test results, TiDB runs, the reviewed
head SHA when not given) are reported as ``not_evidenced_here``, not as a pass.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import COMPILER_VERSION
from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.migration import bridge, fleet
from runtime_svc.migration.cohorts import list_cohorts
from runtime_svc.migration.gates import RollbackVerdict, rollback_verdict
from runtime_svc.migration.protocol import (
    BINARY_VERSION,
    BINARY_WRITE_PROTOCOL_GENERATION,
    RELEASES,
    release_generation,
)
from runtime_svc.migration.reconcile import reconcile_ownership
from runtime_svc.schema_bridge import flow_shadow_comparisons
from services import migrate
from services.db import db_now, transaction

__all__ = ["DISTRIBUTIONS", "release_evidence", "rollback_check", "summary_lines"]

#: Distributions whose exact versions make up the release (§23.2 "exact released module
#: versions"); the runtime itself first.
DISTRIBUTIONS = (
    "nexus-flow-runtime",
    "grpcio",
    "protobuf",
    "sqlalchemy",
    "alembic",
    "asyncmy",
    "aiomysql",
    "aiosqlite",
    "cryptography",
    "opentelemetry-sdk",
)
_SERVICES = ("runtime_svc", "catalog_svc", "effect_owner_svc")


async def rollback_check(engine: AsyncEngine, target_version: str) -> RollbackVerdict:
    """Whether ``target_version`` is an acceptable rollback target now (§20.9)."""
    control = await bridge.read_control(engine)
    owned = await bridge.count_owned_runs(engine)
    return rollback_verdict(
        target_version,
        release_generation(target_version),
        control,
        v2_rows=owned.get(ExecutionOwner.FLOW_RUNTIME_V2.code, 0),
        legacy_rows=owned.get(ExecutionOwner.LEGACY_INTERPRETER.code, 0),
    )


def _distributions() -> list[dict[str, Any]]:
    out = []
    for name in DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            out.append({"name": name, "version": None, "local": False, "installed": False})
            continue
        direct = dist.read_text("direct_url.json")
        local = False
        if direct:
            info = json.loads(direct)
            local = str(info.get("url", "")).startswith("file:") or bool(
                info.get("dir_info", {}).get("editable")
            )
        out.append({"name": name, "version": dist.version, "local": local, "installed": True})
    return out


def _gate(items: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    verdicts = [i["status"] for i in items.values()]
    status = "fail" if "fail" in verdicts else "pass"
    if status == "pass" and "not_evidenced_here" in verdicts:
        status = "incomplete"
    return {"status": status, "items": dict(items)}


def _item(ok: bool | None, evidence: Any) -> dict[str, Any]:
    status = "not_evidenced_here" if ok is None else ("pass" if ok else "fail")
    return {"status": status, "evidence": evidence}


async def _divergence(engine: AsyncEngine) -> dict[str, Any]:
    s = flow_shadow_comparisons.c
    async with transaction(engine, readonly=True) as conn:
        counts = {
            str(o): int(n)
            for o, n in await conn.execute(select(s.outcome, func.count()).group_by(s.outcome))
        }
        unexplained = [
            {"org_id": o, "flow_version_id": f, "comparison_id": c}
            for o, f, c in await conn.execute(
                select(s.org_id, s.flow_version_id, s.comparison_id)
                .where(s.outcome == "diverged")
                .order_by(s.org_id, s.flow_version_id)
                .limit(50)
            )
        ]
    return {"comparisons_by_outcome": counts, "unexplained": unexplained}


async def release_evidence(
    engine: AsyncEngine,
    db_url: str,
    *,
    head_sha: str | None = None,
    expected_version: str | None = None,
) -> dict[str, Any]:
    """The §23.1-§23.3 evidence document (module docstring)."""
    problems = await migrate.verify(db_url, "runtime_svc")
    live_revision = await migrate.current(db_url, "runtime_svc")
    heads = {svc: migrate.heads(svc) for svc in _SERVICES}
    control = await bridge.read_control(engine)
    report = await reconcile_ownership(engine)
    cohorts = await list_cohorts(engine)
    divergence = await _divergence(engine)
    async with transaction(engine, readonly=True) as conn:
        now = await db_now(conn)
        writers = await fleet.live_writers_txn(conn, now)
    expected = expected_version or BINARY_VERSION
    mismatched = [
        w
        for w in writers
        if w["binary_version"] != expected or w["compiler_version"] != COMPILER_VERSION
    ]
    dists = _distributions()
    source = {
        "reviewed_head_sha": _item(None if head_sha is None else True, head_sha),
        "required_test_results": _item(None, "run `make test` / CI; not stored in the runtime"),
        "real_tidb_results": _item(None, "no TiDB server in this environment"),
        "schema_clean_install_and_upgrade": _item(
            not problems and live_revision == heads["runtime_svc"],
            {"live_revision": live_revision, "head": heads["runtime_svc"], "verify": problems},
        ),
    }
    release = {
        "release_tuple": _item(
            True,
            {
                "binary_version": BINARY_VERSION,
                "write_protocol_generation": BINARY_WRITE_PROTOCOL_GENERATION,
                "plan_compiler_generation": COMPILER_VERSION,
                "schema_heads": heads,
                "release_manifest": dict(RELEASES),
            },
        ),
        "exact_module_versions": _item(all(d["installed"] for d in dists), dists),
        "no_local_replacement": _item(
            not any(d["local"] for d in dists if d["name"] != "nexus-flow-runtime"),
            [d["name"] for d in dists if d["local"]],
        ),
    }
    v2_cohorts = [c.to_dict() for c in cohorts if c.new_run_owner is ExecutionOwner.FLOW_RUNTIME_V2]
    staging = {
        "live_versions_and_compiler_generation": _item(
            bool(writers) and not mismatched,
            {"expected_version": expected, "live_writers": writers, "mismatched": mismatched},
        ),
        "schema_verification": _item(not problems, problems),
        "bridge_control": _item(control.gates_passed, control.to_dict()),
        "selected_cohort_v2_enabled": _item(
            bool(v2_cohorts) or control.default_new_run_owner is ExecutionOwner.FLOW_RUNTIME_V2,
            {
                "default_new_run_owner": control.default_new_run_owner.code,
                "v2_cohorts": v2_cohorts,
            },
        ),
        "zero_dual_ownership": _item(report.dual_ownership_total == 0, report.to_dict()),
        "zero_unexplained_projection_divergence": _item(not divergence["unexplained"], divergence),
        "synthetic_contention_wait_crash_effect_cases": _item(
            None, "run the crash/soak suites against staging; not stored in the runtime"
        ),
    }
    return {
        "observed_at": now.isoformat(),
        "source_gate": _gate(source),
        "release_gate": _gate(release),
        "staging_gate": _gate(staging),
    }


def summary_lines(document: Mapping[str, Any]) -> Sequence[str]:
    """One line per gate and item, for a terminal."""
    lines = []
    for gate in ("source_gate", "release_gate", "staging_gate"):
        lines.append(f"{gate}: {document[gate]['status']}")
        for name, item in document[gate]["items"].items():
            lines.append(f"  {item['status']:<20} {name}")
    return lines
