"""``flowctl signal send|get`` as a real subprocess against a ``WakeSignalService`` on
loopback (issue 15 item 4): readable output by default, ``--json``, a missing flag exits
2 with a message, a refusal or an unreachable server is one line without a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.signals import wake_signal_registration
from runtime_svc.kernel import RunState
from runtime_svc.kernel.wait_model import DependencyState
from services import migrate
from services.auth import CredentialVerifier, generate_keypair
from services.config import ServiceName, load_config
from services.grpc_server import start_server
from tests.integration.waits.support import World, signal_flow
from tests.support.procs import ROOT, free_port

KEY_ID = "flowctl-test"


@pytest.fixture(scope="module")
def kernel_db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SQLite only: these tests cover the CLI, whose behaviour does not depend on the
    backend (the service behind it is tested on both)."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('flowctl') / 'runtime.db'}"
    asyncio.run(migrate.upgrade(url, "runtime_svc"))
    return url


class _AnyBinding:
    async def view_for(self, scope: Any) -> Any:
        return None


@pytest.fixture
async def cli(engine: AsyncEngine, world: World, tmp_path: Path) -> AsyncIterator[Any]:
    private, public = generate_keypair()
    key_file = tmp_path / "signing.pem"
    key_file.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cfg = load_config(
        ServiceName.RUNTIME,
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(tmp_path),
            "FLOW_RUNTIME_PORT": "0",
            "FLOW_OTEL_ENABLED": "false",
        },
    )
    server = await start_server(
        cfg,
        [wake_signal_registration(world.rt.signals, _AnyBinding())],
        verifier=CredentialVerifier({KEY_ID: public}, ServiceName.RUNTIME),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env |= {
        "FLOW_DATA_DIR": str(tmp_path),
        "FLOW_AUTH_SIGNING_KEY": str(key_file),
        "FLOW_AUTH_SIGNING_KEY_ID": KEY_ID,
    }
    scope = world.scope
    scope_args = [
        "--target",
        f"127.0.0.1:{server.port}",
        "--org",
        scope.org_id,
        "--app-installation",
        scope.app_installation_id,
        "--capability",
        scope.runtime_capability_id,
        "--binding-digest",
        scope.runtime_work_binding_digest,
    ]

    async def run(*args: str, with_scope: bool = True) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "flowctl",
            *args[:2],  # group and command, then the scope (a later flag overrides it)
            *(scope_args if with_scope else []),
            *args[2:],
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        return int(proc.returncode or 0), out.decode(), err.decode()

    try:
        yield run
    finally:
        await server.stop(0)


async def test_send_wakes_a_waiting_run_and_prints_what_happened(cli: Any, world: World) -> None:
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="42")
    await world.drive(run.flow_run_id)
    args = (
        "signal",
        "send",
        "--producer-kind",
        "external.signal",
        "--producer-key",
        "approval:42",
        "--token",
        "approved-1",
        "--evidence",
        '{"status": "approved"}',
    )
    code, out, err = await cli(*args)
    assert code == 0, err
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED
    assert (
        out.splitlines()[0] == f"accepted {dep.wake_signal_id}: woke dependency {dep.dependency_id}"
    )
    assert 'evidence  {"status":"approved"}' in out
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED

    code, out, _ = await cli(*args)
    assert code == 0 and out.startswith("duplicate: token already accepted")
    code, out, _ = await cli(*args, "--json")
    reply = json.loads(out)
    assert reply["duplicate"] is True and reply["signal"]["wake_signal_id"] == dep.wake_signal_id

    code, out, _ = await cli(
        "signal",
        "get",
        "--producer-kind",
        "external.signal",
        "--producer-key",
        "approval:42",
        "--token",
        "approved-1",
    )
    assert code == 0 and out.startswith(f"signal {dep.wake_signal_id}: consumed")


async def test_missing_flags_exit_2_with_a_message(cli: Any) -> None:
    code, out, err = await cli("signal", "send", "--producer-kind", "external.signal")
    assert code == 2 and out == ""
    assert "the following arguments are required: --producer-key, --token" in err
    code, _, err = await cli(
        "signal",
        "send",
        "--producer-kind",
        "k",
        "--producer-key",
        "p",
        "--token",
        "t",
        with_scope=False,
    )
    assert code == 2 and "the work scope is required" in err
    code, _, err = await cli(
        "signal",
        "send",
        "--producer-kind",
        "k",
        "--producer-key",
        "p",
        "--token",
        "t",
        "--evidence",
        "[1]",
    )
    assert code == 2 and "--evidence" in err


async def test_refusal_and_unreachable_server_are_one_line_without_traceback(cli: Any) -> None:
    code, out, err = await cli(
        "signal",
        "send",
        "--producer-kind",
        "carrier.pigeon",
        "--producer-key",
        "p",
        "--token",
        "t",
    )
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("flowctl: INVALID_ARGUMENT: unknown producer kind 'carrier.pigeon'")
    assert err.rstrip().endswith("(field producer_kind)")

    port = free_port()  # nothing listens there
    code, out, err = await cli(
        "signal",
        "send",
        "--producer-kind",
        "external.signal",
        "--producer-key",
        "p",
        "--token",
        "t",
        "--timeout",
        "3",
        "--target",
        f"127.0.0.1:{port}",
    )
    assert code == 1 and out == "" and "Traceback" not in err
    assert err == f"flowctl: cannot reach the runtime at 127.0.0.1:{port} (unavailable)\n"
