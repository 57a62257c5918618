"""Each service as its own process: health, reflection, auth, schema CLI, SIGTERM, fault guard."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName
from services.proto import effect_v1, runtime_v1
from tests.support.procs import (
    ROOT,
    SERVICE_MODULES,
    ServiceProcess,
    free_port,
    running_service,
    service_env,
)

pytestmark = pytest.mark.e2e

EXPECTED_SERVICES = {
    "catalog": {"nexus.flow.catalog.v1.CatalogService"},
    "runtime": {
        "nexus.flow.runtime.v1.FlowDefinitionService",
        "nexus.flow.runtime.v1.FlowRunService",
        "nexus.flow.runtime.v1.RecordService",
        "nexus.flow.runtime.v1.WakeSignalService",
    },
    "effect-owner": {"nexus.flow.effect.v1.EffectOwnerService"},
}
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


def _grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30, check=False
    )


def _token(data_dir: Path, audience: ServiceName, org: str = "org-a") -> str:
    key = load_signing_key(data_dir / "auth" / "dev_signing_key.pem")
    return mint_credential(
        key, "dev", WorkloadClaims(subject="e2e", audiences=(audience,), org_id=org), ttl_s=300
    )


@pytest.mark.parametrize("name", ["catalog", "runtime", "effect-owner"])
def test_service_reports_serving_and_lists_its_services_through_reflection(
    tmp_path: Path, name: str
) -> None:
    with running_service(tmp_path, name) as svc:
        listed = _grpcurl(f"127.0.0.1:{svc.port}", "list")
        assert listed.returncode == 0, listed.stderr
        names = set(listed.stdout.split())
        assert EXPECTED_SERVICES[name] <= names
        assert "grpc.health.v1.Health" in names
        some = sorted(EXPECTED_SERVICES[name])[0]
        described = _grpcurl(f"127.0.0.1:{svc.port}", "describe", some)
        assert described.returncode == 0 and "rpc " in described.stdout, described.stderr
        health = _grpcurl(
            "-d",
            json.dumps({"service": some}),
            f"127.0.0.1:{svc.port}",
            "grpc.health.v1.Health/Check",
        )
        assert '"SERVING"' in health.stdout


def test_sigterm_drains_and_exits_cleanly(tmp_path: Path) -> None:
    port = free_port()
    svc = ServiceProcess(
        "effect-owner", port, service_env(tmp_path, "effect-owner", port), tmp_path / "e.log"
    )
    svc.start()
    try:
        svc.wait_serving()
        assert svc.proc is not None
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.wait_exit(timeout=30) == 0
    finally:
        svc.kill()


def test_rpcs_require_a_credential_and_unimplemented_ones_say_so(tmp_path: Path) -> None:
    with (
        running_service(tmp_path, "runtime") as svc,
        grpc.insecure_channel(f"127.0.0.1:{svc.port}") as channel,
    ):
        stub = runtime_v1.WakeSignalServiceStub(channel)
        with pytest.raises(grpc.RpcError) as no_cred:
            stub.GetWakeSignal(runtime_v1.GetWakeSignalRequest(), timeout=10)
        assert no_cred.value.code() == grpc.StatusCode.UNAUTHENTICATED

        wrong_aud = _token(tmp_path, ServiceName.CATALOG)
        with pytest.raises(grpc.RpcError) as aud:
            stub.GetWakeSignal(
                runtime_v1.GetWakeSignalRequest(),
                metadata=[("authorization", f"Bearer {wrong_aud}")],
                timeout=10,
            )
        assert aud.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_effect_owner_serves_its_rpcs(tmp_path: Path) -> None:
    """The effect owner answers with its own validation, no longer UNIMPLEMENTED."""
    with (
        running_service(tmp_path, "effect-owner") as svc,
        grpc.insecure_channel(f"127.0.0.1:{svc.port}") as channel,
    ):
        md = [("authorization", f"Bearer {_token(tmp_path, ServiceName.EFFECT_OWNER)}")]
        with pytest.raises(grpc.RpcError) as err:
            effect_v1.EffectOwnerServiceStub(channel).GetReceipt(
                effect_v1.GetReceiptRequest(), metadata=md, timeout=10
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_wake_signal_service_is_served_and_needs_a_complete_work_scope(tmp_path: Path) -> None:
    with (
        running_service(tmp_path, "runtime") as svc,
        grpc.insecure_channel(f"127.0.0.1:{svc.port}") as channel,
    ):
        md = [("authorization", f"Bearer {_token(tmp_path, ServiceName.RUNTIME)}")]
        with pytest.raises(grpc.RpcError) as err:
            runtime_v1.WakeSignalServiceStub(channel).GetWakeSignal(
                runtime_v1.GetWakeSignalRequest(wake_signal_id="sig_x"), metadata=md, timeout=10
            )
        # An org-only credential names no work scope: a signal is never read without one.
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def _serve_once(
    data_dir: Path, name: str, extra: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python -m <service> serve`` with ``extra`` settings, for a start that must be
    refused (it returns instead of serving)."""
    env = service_env(data_dir, name, free_port(), extra=extra)
    return subprocess.run(
        [sys.executable, "-m", SERVICE_MODULES[name], "serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_production_server_with_a_fault_hook_refuses_to_start(tmp_path: Path) -> None:
    proc = _serve_once(
        tmp_path, "catalog", {"FLOW_ENV": "production", "FLOW_CRASH_AT": "after_step_commit"}
    )
    assert proc.returncode != 0
    assert "FLOW_CRASH_AT" in proc.stderr


@pytest.mark.parametrize("name", ["catalog", "runtime", "effect-owner"])
def test_db_upgrade_then_verify_via_the_service_cli(tmp_path: Path, name: str, db_url: str) -> None:
    env = service_env(tmp_path, name, 0, db_url=db_url)
    module = SERVICE_MODULES[name]
    for args in (["db", "upgrade"], ["db", "verify"]):
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"{module} {' '.join(args)}: {proc.stdout}\n{proc.stderr}"


def test_db_verify_reports_drift_and_exits_non_zero(tmp_path: Path) -> None:
    import sqlite3

    db_file = tmp_path / "drift.db"
    env = service_env(tmp_path, "catalog", 0, db_url=f"sqlite+aiosqlite:///{db_file}")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "catalog_svc", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    assert run("db", "upgrade").returncode == 0
    with sqlite3.connect(db_file) as conn:
        conn.execute("CREATE TABLE rogue_table (org_id TEXT PRIMARY KEY)")
    drift = run("db", "verify")
    assert drift.returncode == 1
    assert "rogue_table" in drift.stdout + drift.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_runtime_serves_on_the_event_loop_flow_event_loop_names(
    tmp_path: Path, loop: str
) -> None:
    with running_service(tmp_path, "runtime", extra={"FLOW_EVENT_LOOP": loop}) as svc:
        listed = _grpcurl(f"127.0.0.1:{svc.port}", "list")
        assert listed.returncode == 0, listed.stderr
        assert "nexus.flow.runtime.v1.FlowRunService" in listed.stdout
        log = svc.log_path.read_text(encoding="utf-8", errors="replace")
        assert f"event loop: {loop}" in log


def test_an_unknown_event_loop_refuses_to_start_naming_the_variable(tmp_path: Path) -> None:
    proc = _serve_once(tmp_path, "runtime", {"FLOW_EVENT_LOOP": "trio"})
    assert proc.returncode == 2
    assert "FLOW_EVENT_LOOP" in proc.stderr
