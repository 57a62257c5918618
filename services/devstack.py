"""``make run``: the three services on embedded SQLite under ``./.data``, with a demo.

Starts ``catalog_svc``, ``runtime_svc`` and ``effect_owner_svc`` as child
processes, waits (bounded) until each reports SERVING on the standard health
service, seeds the demo through the public APIs when a seeder is available,
prints how to reach everything, and stops the children on Ctrl-C / SIGTERM.
A child that dies takes the stack down with a non-zero exit.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import WorkloadClaims, ensure_dev_keys, load_signing_key, mint_credential
from services.config import ServiceConfig, ServiceName, load_config

__all__ = ["main"]

log = logging.getLogger("devstack")

_MODULES = {
    ServiceName.CATALOG: "catalog_svc",
    ServiceName.RUNTIME: "runtime_svc",
    ServiceName.EFFECT_OWNER: "effect_owner_svc",
}
DEMO_ORG = "org-demo"
_READY_TIMEOUT_S = 90.0


def _serving(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def _stop_all(children: dict[ServiceName, subprocess.Popen[bytes]]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in children.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s devstack: %(message)s")
    env = dict(os.environ)
    env.setdefault("FLOW_DATA_DIR", str(Path(".data").resolve()))
    data_dir = Path(env["FLOW_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    configs = {svc: load_config(svc, env) for svc in _MODULES}
    keys = ensure_dev_keys(data_dir, env=configs[ServiceName.RUNTIME].env)

    children: dict[ServiceName, subprocess.Popen[bytes]] = {}
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        del signum, frame
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for svc, module in _MODULES.items():
            log_file = open(data_dir / f"{module}.log", "ab")  # noqa: SIM115 - owned by the child
            children[svc] = subprocess.Popen(
                [sys.executable, "-m", module, "serve"],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + _READY_TIMEOUT_S
        pending = set(children)
        while pending and not stopping:
            for svc in sorted(pending):
                if children[svc].poll() is not None:
                    log.error(
                        "%s exited during start-up; see %s",
                        svc.value,
                        data_dir / f"{_MODULES[svc]}.log",
                    )
                    return 1
                if _serving(configs[svc].port):
                    pending.discard(svc)
            if time.monotonic() > deadline:
                log.error(
                    "timed out waiting for %s to report SERVING",
                    ", ".join(s.value for s in pending),
                )
                return 1
            time.sleep(0.2)
        if stopping:
            return 0

        token = mint_credential(
            load_signing_key(keys.signing_key),
            configs[ServiceName.RUNTIME].auth_signing_key_id,
            WorkloadClaims(
                subject="devstack-operator", audiences=tuple(ServiceName), org_id=DEMO_ORG
            ),
            ttl_s=12 * 3600,
        )
        token_file = data_dir / "dev_token"
        token_file.write_text(token + "\n", encoding="utf-8")
        token_file.chmod(0o600)
        _seed_demo(configs, token)
        _print_banner(configs, token_file)

        while not stopping:
            for svc, proc in children.items():
                if proc.poll() is not None:
                    log.error("%s exited with %s; stopping the stack", svc.value, proc.returncode)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop_all(children)


def _seed_demo(configs: dict[ServiceName, ServiceConfig], token: str) -> None:
    """Load the demo through the public APIs (see ``services.demo``) when it is present."""
    try:
        demo = importlib.import_module("services.demo")
    except ModuleNotFoundError:
        return
    demo.seed(configs, token)


def _print_banner(configs: dict[ServiceName, ServiceConfig], token_file: Path) -> None:
    grpcurl = Path(sys.executable).parent / "grpcurl"
    lines = ["", "Nexus Flow Runtime is up (embedded SQLite under ./.data):"]
    for svc in _MODULES:
        cfg = configs[svc]
        lines.append(f"  {svc.value:<13} 127.0.0.1:{cfg.port}")
    rt = configs[ServiceName.RUNTIME].port
    cat = configs[ServiceName.CATALOG].port
    lines += [
        "",
        "Try:",
        f"  {grpcurl} -plaintext 127.0.0.1:{rt} list",
        f"  {grpcurl} -plaintext 127.0.0.1:{rt} describe nexus.flow.runtime.v1.FlowRunService",
        f"  {grpcurl} -plaintext 127.0.0.1:{cat} grpc.health.v1.Health/Check",
        f"  TOKEN=$(cat {token_file})",
        f"  {grpcurl} -plaintext -H \"authorization: Bearer $TOKEN\" -d '{{}}' \\",
        f"      127.0.0.1:{rt} nexus.flow.runtime.v1.FlowRunService/ListRuns",
        "",
        "Logs: ./.data/*.log    Stop: Ctrl-C",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
