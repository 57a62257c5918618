"""``make run``: the three services on embedded SQLite under ``./.data``, with the demo.

Starts a local SMTP sink (:mod:`flowctl.mailsink`, one ``.eml`` file per message under
``FLOW_MAIL_SINK_DIR``, default ``./.data/mail``) on the effect owner's
``FLOW_EFFECT_SMTP_PORT``, then ``catalog_svc``, ``runtime_svc`` and
``effect_owner_svc`` as child processes, waits (bounded) until each reports SERVING on
the standard health service, seeds the demo through the public APIs
(:func:`flowctl.demo.seed`: a sealed catalog generation and two ACTIVE Flows), prints how
to reach everything (and where the demo's e-mails land), and stops the children on
Ctrl-C / SIGTERM. A child that dies, a start-up timeout or a failed seeding takes the
stack down with a non-zero exit.

This is a client of the services (it only uses their public gRPC APIs), so it lives in
``flowctl`` rather than in the shared kernel ``services``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowctl.common import CliError
from flowctl.cookbook_setup import COOKBOOK_FILE, write_cookbook
from flowctl.demo import (
    SUMMARY_FILE,
    WAITING_FLOW,
    WELCOME_FLOW,
    DemoSeedError,
    DemoSummary,
    local_target,
    seed,
)
from services.auth import (
    OPERATOR_ROLES,
    WorkloadClaims,
    ensure_dev_keys,
    load_signing_key,
    mint_credential,
)
from services.config import (
    ServiceConfig,
    ServiceName,
    load_config,
    load_effect_owner_settings,
    mail_sink_dir,
)

__all__ = ["banner", "main"]

log = logging.getLogger("devstack")

_MODULES = {
    ServiceName.CATALOG: "catalog_svc",
    ServiceName.RUNTIME: "runtime_svc",
    ServiceName.EFFECT_OWNER: "effect_owner_svc",
}
DEMO_ORG = "org-demo"
_READY_TIMEOUT_S = 90.0
_STOP_TIMEOUT_S = 15.0
_TOKEN_TTL_S = 12 * 3600
_PLAN_SERVICE = "nexus.flow.runtime.v1.FlowDefinitionService"
_RUN_SERVICE = "nexus.flow.runtime.v1.FlowRunService"

Configs = Mapping[ServiceName, ServiceConfig]


def _serving(cfg: ServiceConfig) -> bool:
    try:
        with grpc.insecure_channel(local_target(cfg)) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for proc in children:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _start_mail_sink(env: Mapping[str, str], data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The dev SMTP sink on the effect owner's SMTP port; returns it and its address."""
    smtp = load_effect_owner_settings(env).smtp
    mail_dir = mail_sink_dir(env)
    with open(data_dir / "mailsink.log", "ab") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flowctl.mailsink",
                "--dir",
                str(mail_dir),
                "--host",
                smtp.host,
                "--port",
                str(smtp.port),
            ],
            env=dict(env),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return proc, f"smtp://{smtp.host}:{smtp.port} -> {mail_dir}/*.eml"


def _mint_dev_token(signing_key: Path, key_id: str, data_dir: Path, demo: DemoSummary) -> Path:
    """The banner's operator token: the demo's complete work scope, every audience and
    the operator roles (may cancel and delete runs), so it works for every RPC of the
    demo. Written ``0600`` to ``<data dir>/dev_token``."""
    token = mint_credential(
        load_signing_key(signing_key),
        key_id,
        WorkloadClaims(
            subject="devstack-operator",
            audiences=tuple(ServiceName),
            org_id=demo.org_id,
            app_installation_id=demo.app_installation_id,
            runtime_capability_id=demo.runtime_capability_id,
            runtime_work_binding_digest=demo.binding_digest,
            roles=OPERATOR_ROLES,
        ),
        ttl_s=_TOKEN_TTL_S,
    )
    token_file = data_dir / "dev_token"
    token_file.write_text(token + "\n", encoding="utf-8")
    token_file.chmod(0o600)
    return token_file


_PORT_VARS = {
    ServiceName.CATALOG: "FLOW_CATALOG_PORT",
    ServiceName.RUNTIME: "FLOW_RUNTIME_PORT",
    ServiceName.EFFECT_OWNER: "FLOW_EFFECT_PORT",
}
_LOG_TAIL_LINES = 20


def _listener_pid(port: int) -> str | None:
    """``pid (command line)`` of the process listening on TCP ``port`` (Linux), if visible."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        pid = fd_dir.parent.name
                        cmd = (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                        return f"pid {pid} ({cmd.decode(errors='replace').strip()})"
    return None


def _ports_in_use(configs: Configs) -> list[str]:
    """One line per configured port another process already holds."""
    problems = []
    for svc, cfg in configs.items():
        with socket.socket(socket.AF_INET6 if ":" in cfg.listen_host else socket.AF_INET) as s:
            try:
                s.bind((cfg.listen_host, cfg.port))
            except OSError as exc:
                holder = _listener_pid(cfg.port) or "another process"
                problems.append(
                    f"{svc.value}: {cfg.listen_host}:{cfg.port} ({_PORT_VARS[svc]}) is not "
                    f"free: {exc.strerror}; held by {holder}"
                )
    return problems


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-_LOG_TAIL_LINES:])


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s devstack: %(message)s")
    env = dict(os.environ)
    env.setdefault("FLOW_DATA_DIR", str(Path(".data").resolve()))
    data_dir = Path(env["FLOW_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    configs = {svc: load_config(svc, env) for svc in _MODULES}
    if any(cfg.port == 0 for cfg in configs.values()):
        # The stack dials its children at their configured ports; it cannot learn a
        # port a child picked itself.
        log.error("the dev stack needs fixed ports: FLOW_*_PORT=0 is not supported here")
        return 2
    busy = _ports_in_use(configs)
    if busy:
        log.error(
            "cannot start: %s\nIs another `make run` running? Stop it, or pick other ports "
            "(FLOW_CATALOG_PORT, FLOW_RUNTIME_PORT, FLOW_EFFECT_PORT).",
            "; ".join(busy),
        )
        return 2
    runtime_cfg = configs[ServiceName.RUNTIME]
    keys = ensure_dev_keys(data_dir, env=runtime_cfg.env, key_id=runtime_cfg.auth_signing_key_id)

    children: dict[ServiceName, subprocess.Popen[bytes]] = {}
    sink: subprocess.Popen[bytes] | None = None
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        del signum, frame
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        smtp = load_effect_owner_settings(env).smtp
        sink, mail = _start_mail_sink(env, data_dir)
        log.info("mail sink started (pid %d): %s", sink.pid, mail)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not _port_open(smtp.host, smtp.port):
            if sink.poll() is not None or time.monotonic() > deadline:
                log.error("the mail sink did not start; see %s", data_dir / "mailsink.log")
                return 1
            time.sleep(0.1)
        for svc, module in _MODULES.items():
            with open(data_dir / f"{module}.log", "ab") as log_file:  # the child keeps its copy
                children[svc] = subprocess.Popen(
                    [sys.executable, "-m", module, "serve"],
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            log.info(
                "%s started (pid %d), log: %s",
                module,
                children[svc].pid,
                data_dir / f"{module}.log",
            )
        deadline = time.monotonic() + _READY_TIMEOUT_S
        pending = set(children)
        while pending and not stopping:
            for svc in sorted(pending):
                if children[svc].poll() is not None:
                    log_path = data_dir / f"{_MODULES[svc]}.log"
                    log.error(
                        "%s exited during start-up (exit %s); the end of %s:\n%s",
                        svc.value,
                        children[svc].returncode,
                        log_path,
                        _log_tail(log_path),
                    )
                    return 1
                if _serving(configs[svc]):
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

        try:
            demo = seed(configs, data_dir)
        except DemoSeedError as exc:
            log.error("seeding the demo failed; stopping the stack\n%s", exc)
            return 1
        try:
            cookbook = write_cookbook(configs, data_dir, demo)
        except (grpc.RpcError, OSError, RuntimeError, CliError, ValueError, DemoSeedError) as exc:
            # The demo is up; only the pre-filled cookbook is missing.
            log.warning("could not prepare the grpcurl cookbook (docs/grpcurl.md): %s", exc)
        else:
            log.info("grpcurl cookbook with this stack's ids: %s", cookbook)
        if stopping:
            return 0
        token_file = _mint_dev_token(
            keys.signing_key, runtime_cfg.auth_signing_key_id, data_dir, demo
        )
        print(banner(configs, data_dir, token_file, demo, mail), flush=True)

        while not stopping:
            for svc, proc in children.items():
                if proc.poll() is not None:
                    log.error("%s exited with %s; stopping the stack", svc.value, proc.returncode)
                    return 1
            if sink.poll() is not None:
                log.error("the mail sink exited with %s; stopping the stack", sink.returncode)
                return 1
            time.sleep(0.5)
        log.info("stopping")
        return 0
    finally:
        # Services first (the owner may still be handing a message to the sink).
        _stop_all(list(children.values()))
        if sink is not None:
            _stop_all([sink])


def banner(
    configs: Configs, data_dir: Path, token_file: Path, demo: DemoSummary, mail: str = ""
) -> str:
    """The text printed once the stack is up and the demo is seeded."""
    bin_dir = Path(sys.executable).parent
    grpcurl, flowctl = shlex.quote(str(bin_dir / "grpcurl")), shlex.quote(str(bin_dir / "flowctl"))
    rt = local_target(configs[ServiceName.RUNTIME])
    cat = local_target(configs[ServiceName.CATALOG])
    data = shlex.quote(str(data_dir))
    lines = ["", f"Nexus Flow Runtime is up (embedded SQLite under {data_dir}):"]
    lines += [f"  {svc.value:<13} {local_target(configs[svc])}" for svc in _MODULES]
    if mail:
        lines += [f"  {'mail sink':<13} {mail}  (e-mails the demo Flows send land here)"]
    runtime = configs[ServiceName.RUNTIME]
    procs, tasks = runtime.runtime_worker_processes, runtime.runtime_workers
    lines += [
        f"  {'step workers':<13} "
        + (
            f"{procs} worker processes x {tasks} (FLOW_RUNTIME_WORKER_PROCESSES)"
            if procs
            else f"{tasks} in the runtime process (FLOW_RUNTIME_WORKER_PROCESSES=auto:"
            " one worker process per core)"
        )
    ]
    lines += [
        "",
        f"Demo ({demo.org_id} / {demo.app_installation_id} / {demo.runtime_capability_id}):",
        f"  work binding        {demo.binding_digest}",
        f"  catalog generation  {demo.catalog_generation_id}"
        f" ({'reused: catalog unchanged' if demo.generation_reused else 'sealed now'})",
        f"  catalog digest      {demo.catalog_digest}",
    ]
    for f in demo.flows:
        lines += [
            f"  {f.flow_api_name}: {f.state}, {f.profile}",
            f"      plan {f.plan_id}  {f.plan_digest}",
        ]
    lines += [
        "",
        "Try:",
        f"  TOKEN=$(cat {shlex.quote(str(token_file))})"
        "   # demo work scope, may cancel/delete runs",
        f"  FLOW_DATA_DIR={data} {flowctl} auth mint --role flow.runs.cancel"
        "   # another token (demo scope by default)",
        f"  FLOW_DATA_DIR={data} {flowctl} flow inventory --target {rt} \\",
        f"      --org {demo.org_id} --app-installation {demo.app_installation_id}"
        f" --capability {demo.runtime_capability_id} \\",
        f"      --binding-digest {demo.binding_digest} \\",
        f"      --generation {demo.catalog_generation_id} --catalog-digest {demo.catalog_digest}",
    ]
    for f in demo.flows:
        lines += [
            f'  {grpcurl} -plaintext -H "authorization: Bearer $TOKEN" \\',
            f'      -d \'{{"org_id": "{demo.org_id}", "plan_id": "{f.plan_id}"}}\' \\',
            f"      {rt} {_PLAN_SERVICE}/GetPlan",
        ]
    lines += [
        f"  {grpcurl} -plaintext {rt} list",
        f"  {grpcurl} -plaintext {cat} grpc.health.v1.Health/Check",
    ]
    scope_args = (
        f"      --org {demo.org_id} --app-installation {demo.app_installation_id}"
        f" --capability {demo.runtime_capability_id} \\\n"
        f"      --binding-digest {demo.binding_digest}"
    )
    mail_dir = shlex.quote(str(mail_sink_dir({**os.environ, "FLOW_DATA_DIR": str(data_dir)})))
    if any(f.flow_api_name == WELCOME_FLOW for f in demo.flows):
        lines += [
            "",
            f"The {WELCOME_FLOW} Flow runs for every new Contact with an e-mail: it formats the"
            " name, writes a",
            "follow-up Task, e-mails the Contact through the effect owner (crm.send_email ->"
            f" {mail_dir}/*.eml)",
            "and resumes on the owner's completion receipt. Create one and follow its run:",
            f"  FLOW_DATA_DIR={data} {flowctl} record create Contact --target {rt} \\",
            scope_args + " \\",
            "      --field FirstName=Ada --field LastName=Lovelace --field Email=ada@example.com",
            f"  FLOW_DATA_DIR={data} {flowctl} run watch RUN_ID --target {rt} \\",
            scope_args + "   # RUN_ID: the 'started run' above",
            f"  FLOW_DATA_DIR={data} {flowctl} run support RUN_ID --target {rt} \\",
            scope_args + "   # steps, the dependency, the effect",
            f"  ls {mail_dir}",
            "  An address the e-mail provider refuses (--field Email=not-an-address) takes the"
            " Flow's fault path",
            "  (the run ends terminal_failed with WELCOME_EMAIL_FAILED; nothing is sent).",
        ]
    w = demo.waiting_run
    if w is not None:
        lines += [
            "",
            f"A demo {WAITING_FLOW} run waits durably for an approval (run {w.flow_run_id},"
            f" {w.state}); wake it with:",
            f"  FLOW_DATA_DIR={data} {flowctl} signal send --target {rt} \\",
            f"      --org {demo.org_id} --app-installation {demo.app_installation_id}"
            f" --capability {demo.runtime_capability_id} \\",
            f"      --binding-digest {demo.binding_digest} \\",
            f"      --producer-kind {w.producer_kind} --producer-key {w.producer_key}"
            f" --token {w.wake_token} \\",
            f"      --evidence {shlex.quote(w.evidence_json)}",
            f'  {grpcurl} -plaintext -H "authorization: Bearer $TOKEN" \\',
            f'      -d \'{{"flow_run_id": "{w.flow_run_id}"}}\' {rt} {_RUN_SERVICE}/GetRunSupport',
        ]
    lines += [
        "",
        f"  grpcurl for every RPC, with this stack's ids: {data_dir / COOKBOOK_FILE}",
        "",
        f"Summary: {data_dir / SUMMARY_FILE}    Logs: {data_dir}/*.log    Stop: Ctrl-C",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
