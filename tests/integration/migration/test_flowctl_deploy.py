"""``flowctl deploy`` and ``flowctl release evidence`` against real databases (§20.9,
§23; §22.2 V22.2-30 "rollback to a pre-bridge binary is rejected while V2 ownership is
possible"; §22.8 V22.8-01 "clean install and every supported upgrade path").

The CLI is called in-process (``flowctl.__main__.main``) with the runtime's configuration
pointing at a temporary data directory whose development keys act as the control plane.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from flowctl.__main__ import main as flowctl
from runtime_svc.compiler import COMPILER_VERSION
from runtime_svc.migration import bridge, fleet
from runtime_svc.migration.control import Origin, Phase
from runtime_svc.migration.protocol import BINARY_VERSION
from runtime_svc.schema import flow_runs
from services import db, migrate
from services.auth import ensure_dev_keys
from tests.integration.kernel.conftest import seed_plan
from tests.integration.migration.conftest import new_scope, register_flow
from tests.integration.migration.flows import pure_flow
from tests.support.prebridge import old_insert


@pytest.fixture
def deploy_db(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    asyncio.run(migrate.upgrade(db_url, "runtime_svc"))
    keys = ensure_dev_keys(tmp_path, env="test")
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FLOW_RUNTIME_DB_URL", db_url)
    monkeypatch.setenv("FLOW_AUTH_TRUSTED_KEYS", str(keys.trusted_keys))
    monkeypatch.setenv("FLOW_AUTH_SIGNING_KEY", str(keys.signing_key))
    return db_url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = flowctl(list(argv))
    out = capsys.readouterr().out
    try:
        return code, json.loads(out)
    except json.JSONDecodeError:
        return code, out


def _db(db_url: str, fn: Any) -> Any:
    async def main() -> Any:
        engine = db.create_engine(db_url)
        try:
            return await fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def test_rollback_to_a_pre_bridge_binary_is_rejected_while_v2_ownership_is_possible(
    deploy_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A clean install is born at write-protocol generation 1: V2 ownership is possible.
    code, verdict = run(capsys, "deploy", "rollback-check", "--target", "0.1.0")
    assert code == 1 and not verdict["allowed"]
    assert "pre_bridge_target_while_v2_ownership_possible" in verdict["reasons"]
    assert verdict["target_write_protocol_generation"] == 0

    code, verdict = run(capsys, "deploy", "rollback-check", "--target", BINARY_VERSION)
    assert code == 0 and verdict["allowed"]
    code, verdict = run(capsys, "deploy", "rollback-check", "--target", "9.9.9")
    assert code == 1 and verdict["reasons"] == ["unknown_release"]


def test_before_the_gate_a_pre_bridge_rollback_is_still_allowed(
    deploy_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, control = run(capsys, "deploy", "bridge", "begin")
    assert code == 0 and control["write_protocol_generation"] == 0
    code, verdict = run(capsys, "deploy", "rollback-check", "--target", "0.1.0")
    assert code == 0 and verdict == {
        "allowed": True,
        "reasons": [],
        "target_version": "0.1.0",
        "target_write_protocol_generation": 0,
        "v2_ownership_possible": False,
    }


def test_flowctl_drives_the_bridge_end_to_end(
    deploy_db: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    scope = new_scope()
    _db(deploy_db, lambda e: register_flow(e, scope.org_id, pure_flow("legacy_pure")))
    assert run(capsys, "deploy", "bridge", "begin")[0] == 0
    _db(deploy_db, lambda e: old_insert(e, flow="legacy_pure", position="calc"))
    code, statement = run(
        capsys,
        "deploy",
        "routing",
        "mint",
        "--org",
        scope.org_id,
        "--app-installation",
        scope.app_installation_id,
        "--capability",
        scope.runtime_capability_id,
        "--binding-digest",
        scope.runtime_work_binding_digest,
    )
    assert code == 0 and str(statement).startswith("nfw1.")
    routing = tmp_path / "routing.txt"
    routing.write_text(str(statement))

    code, receipt = run(capsys, "deploy", "org-backfill", "--routing", str(routing))
    assert code == 0 and (receipt["stamped"], receipt["org_id"]) == (1, scope.org_id), receipt
    code, refused = run(capsys, "deploy", "admission", "enable")
    assert code == 1 and refused["reasons"] == ["write_protocol_not_enabled"]
    assert run(capsys, "deploy", "drain", "begin")[0] == 0
    time.sleep(bridge.DRAIN_SETTLE_S + 0.1)
    code, drained = run(capsys, "deploy", "drain", "verify")
    assert code == 0 and drained["phase"] == Phase.DRAINED.value
    code, final = run(capsys, "deploy", "org-schema", "--routing", str(routing))
    assert code == 0 and (final["kind"], final["adopted"], final["null_count"]) == ("final", 1, 0)
    assert run(capsys, "deploy", "write-protocol", "enable")[0] == 0
    code, control = run(capsys, "deploy", "admission", "enable")
    assert code == 0 and control["v2_admission_enabled"] is True
    assert run(capsys, "deploy", "default-owner", "v2")[0] == 0

    code, report = run(capsys, "deploy", "reconcile")
    assert code == 0 and report["dual_ownership_total"] == 0
    assert report["runs_by_owner"] == [
        {"execution_owner": "LegacyInterpreter", "ownership_epoch": 0, "runs": 1}
    ]
    code, metrics = run(capsys, "deploy", "reconcile", "--prometheus")
    assert code == 0 and 'nexus_flow_dual_ownership_runs{kind="legacy_epoch_nonzero"} 0' in metrics
    code, status = run(capsys, "deploy", "status")
    assert status["control"]["origin"] == Origin.LEGACY_ADOPTION.value
    assert status["control"]["write_protocol_generation"] == 1

    _db(
        deploy_db,
        lambda e: fleet.register_writer(
            e, fleet.WriterRegistration("rt-1", BINARY_VERSION, 1, COMPILER_VERSION, "h")
        ),
    )
    code, evidence = run(capsys, "release", "evidence", "--head", "abc123")
    assert code == 0, evidence
    staging = evidence["staging_gate"]["items"]
    for item in (
        "live_versions_and_compiler_generation",
        "schema_verification",
        "bridge_control",
        "selected_cohort_v2_enabled",
        "zero_dual_ownership",
        "zero_unexplained_projection_divergence",
    ):
        assert staging[item]["status"] == "pass", (item, staging[item])
    assert evidence["staging_gate"]["status"] == "incomplete"  # synthetic runs: not here
    assert evidence["source_gate"]["items"]["schema_clean_install_and_upgrade"]["status"] == "pass"
    assert (
        evidence["release_gate"]["items"]["release_tuple"]["evidence"]["plan_compiler_generation"]
        == COMPILER_VERSION
    )


def test_release_evidence_fails_on_dual_ownership_and_a_stale_writer(
    deploy_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    scope = new_scope()
    _db(deploy_db, lambda e: seed_plan(e, scope))
    _db(
        deploy_db,
        lambda e: fleet.register_writer(
            e, fleet.WriterRegistration("rt-old", "0.1.9", 1, "nexus-flow-compiler/0", "h")
        ),
    )

    async def corrupt(engine: Any) -> None:  # a V2 root carrying legacy state
        async with db.transaction(engine) as conn:
            plan_id = (
                await conn.execute(text("SELECT plan_id FROM execution_plans LIMIT 1"))
            ).scalar_one()
            now = await db.db_now(conn)
            await conn.execute(
                flow_runs.insert().values(
                    org_id=scope.org_id,
                    app_installation_id=scope.app_installation_id,
                    runtime_capability_id=scope.runtime_capability_id,
                    runtime_work_binding_digest=scope.runtime_work_binding_digest,
                    flow_run_id="run-dual",
                    flow_version_id="fv",
                    plan_id=plan_id,
                    execution_profile="durable_orchestration",
                    execution_owner="FlowRuntimeV2",
                    runtime_state="Runnable",
                    state_version=0,
                    ownership_epoch=1,
                    queue_class="durable_mutation",
                    priority=0,
                    is_deleted=False,
                    interview_status="Running",
                    legacy_context="{}",
                    created_at=now,
                    updated_at=now,
                )
            )

    _db(deploy_db, corrupt)
    code, report = run(capsys, "deploy", "reconcile")
    assert code == 1 and report["dual_ownership"]["v2_with_legacy_state"] == 1
    assert report["samples"] == [
        {"kind": "v2_with_legacy_state", "org_id": scope.org_id, "flow_run_id": "run-dual"}
    ]
    code, evidence = run(capsys, "release", "evidence")
    assert code == 1
    staging = evidence["staging_gate"]["items"]
    assert staging["zero_dual_ownership"]["status"] == "fail"
    assert staging["live_versions_and_compiler_generation"]["status"] == "fail"


async def test_upgrading_a_v2_deployment_keeps_its_runs_and_is_born_bridged(db_url: str) -> None:
    await migrate.upgrade(db_url, "runtime_svc", "0006")
    engine = db.create_engine(db_url)
    try:
        scope = new_scope()
        plan_id, _ = await seed_plan(engine, scope)
        async with db.transaction(engine) as conn:
            now = (await db.db_now(conn)).replace(tzinfo=None)
            await conn.execute(
                text(
                    "INSERT INTO flow_runs (org_id, app_installation_id, runtime_capability_id,"
                    " runtime_work_binding_digest, flow_run_id, flow_version_id, plan_id,"
                    " execution_profile, execution_owner, runtime_state, state_version,"
                    " ownership_epoch, queue_class, priority, is_deleted, interview_status,"
                    " created_at, updated_at) VALUES (:o, :a, :c, :d, 'run-1', 'fv', :p,"
                    " 'durable_orchestration', 'FlowRuntimeV2', 'Runnable', 3, 1,"
                    " 'durable_mutation', 0, 0, 'Running', :n, :n)"
                ),
                {
                    "o": scope.org_id,
                    "a": scope.app_installation_id,
                    "c": scope.runtime_capability_id,
                    "d": scope.runtime_work_binding_digest,
                    "p": plan_id,
                    "n": now,
                },
            )
            await conn.execute(
                text(
                    "INSERT INTO flow_step_executions (org_id, step_execution_id, flow_run_id,"
                    " plan_step_key, invocation_ordinal, step_kind, state, state_version,"
                    " attempt_count, ownership_epoch, queue_class, created_at, updated_at)"
                    " VALUES (:o, 'step-1', 'run-1', 's1', 0, 'PureCompute', 'Pending', 0, 0,"
                    " 1, 'durable_mutation', :n, :n)"
                ),
                {"o": scope.org_id, "n": now},
            )
        await engine.dispose()
        await migrate.upgrade(db_url, "runtime_svc")
        assert await migrate.verify(db_url, "runtime_svc") == []
        engine = db.create_engine(db_url)
        control = await bridge.read_control(engine)
        assert (control.origin, control.generation, control.phase) == (
            Origin.CLEAN_INSTALL,
            1,
            Phase.WRITE_PROTOCOL_ENABLED,
        )
        async with db.transaction(engine, readonly=True) as conn:
            row = (
                (await conn.execute(select(flow_runs).where(flow_runs.c.flow_run_id == "run-1")))
                .mappings()
                .one()
            )
        assert (row["plan_id"], row["state_version"], row["legacy_context"]) == (plan_id, 3, None)
        await engine.dispose()
        await migrate.downgrade(db_url, "runtime_svc", "0006")  # and back: no legacy rows
        await migrate.upgrade(db_url, "runtime_svc")
        assert await migrate.verify(db_url, "runtime_svc") == []
    finally:
        await engine.dispose()
