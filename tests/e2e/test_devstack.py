"""`make run` (`python -m flowctl.devstack`) as a child: demo seeded, idempotent, clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct

from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName
from services.effect_contract import HANDOFF_SUBMIT_ROLE, provider_idempotency_key
from services.proto import common_v1, effect_v1, runtime_v1
from tests.integration.effects.harness import Scope, envelope
from tests.support.procs import ROOT, free_port, wait_until

pytestmark = pytest.mark.e2e

BANNER = "Nexus Flow Runtime is up"
EXPECTED_PROFILES = {
    "NormalizeContactName": common_v1.ExecutionProfile.EXECUTION_PROFILE_EMBEDDED_BEFORE_SAVE,
    "WelcomeContact": common_v1.ExecutionProfile.EXECUTION_PROFILE_DURABLE_ORCHESTRATION,
    "AwaitApproval": common_v1.ExecutionProfile.EXECUTION_PROFILE_DURABLE_ORCHESTRATION,
}
ACTIVE = runtime_v1.ActivationState.ACTIVATION_STATE_ACTIVE


@dataclass
class Stack:
    """One ``flowctl.devstack`` child and where its output goes."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    runtime_port: int
    out: Path
    err: Path
    effect_port: int = 0

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def children(self) -> list[int]:
        """PIDs whose parent is the dev stack (Linux ``/proc``)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process went away while we looked
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids

    def wait_banner(self, timeout: float = 45.0) -> str:
        def up() -> str | None:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"devstack exited with {self.proc.returncode}:\n{self.output()[-4000:]}"
                )
            text = self.out.read_text(errors="replace")
            # The banner is printed in one flushed write ending with the "Summary:" line.
            return text if BANNER in text and "Summary:" in text else None

        return wait_until(up, timeout=timeout, interval=0.2, what="the devstack banner")

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def _env(data_dir: Path, extra: Mapping[str, str] | None = None) -> tuple[dict[str, str], int]:
    catalog, runtime, effect, smtp = free_port(), free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env.update(
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(data_dir),
            "FLOW_CATALOG_PORT": str(catalog),
            "FLOW_RUNTIME_PORT": str(runtime),
            "FLOW_EFFECT_PORT": str(effect),
            "FLOW_EFFECT_SMTP_PORT": str(smtp),
            "FLOW_CATALOG_TARGET": f"127.0.0.1:{catalog}",
            "FLOW_SHUTDOWN_GRACE_S": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    env["_EFFECT_PORT"] = str(effect)  # read back by devstack(); not a FLOW_* setting
    return env, runtime


@contextmanager
def devstack(
    data_dir: Path,
    name: str,
    extra: Mapping[str, str] | None = None,
    *,
    new_session: bool = False,
) -> Iterator[Stack]:
    env, runtime_port = _env(data_dir, extra)
    effect_port = int(env.pop("_EFFECT_PORT"))
    out, err = data_dir.parent / f"{name}.out", data_dir.parent / f"{name}.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowctl.devstack"],
            cwd=ROOT,
            env=env,
            stdout=o,
            stderr=e,
            start_new_session=new_session,  # its own process group: a terminal's Ctrl-C
        )
    stack = Stack(proc, data_dir, runtime_port, out, err, effect_port)
    try:
        yield stack
    finally:
        if proc.poll() is None:  # a failed assertion: do not leave the stack behind
            proc.kill()
            proc.wait(timeout=30)
        for pid in stack.children():
            os.kill(pid, signal.SIGKILL)


def _gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def _md(data_dir: Path, **scope: str) -> list[tuple[str, str]]:
    key = load_signing_key(data_dir / "auth" / "dev_signing_key.pem")
    claims = WorkloadClaims(
        subject="e2e", audiences=(ServiceName.RUNTIME,), org_id="org-demo", **scope
    )
    return [("authorization", f"Bearer {mint_credential(key, 'dev', claims, ttl_s=300)}")]


def _assert_demo_active(stack: Stack) -> dict[str, Any]:
    """Both demo Flows ACTIVE with their expected profiles; returns ``demo.json``."""
    demo: dict[str, Any] = json.loads((stack.data_dir / "demo.json").read_text())
    by_name = {f["flow_api_name"]: f for f in demo["flows"]}
    assert set(by_name) == set(EXPECTED_PROFILES)
    scoped = _md(
        stack.data_dir,
        app_installation_id=demo["app_installation_id"],
        runtime_capability_id=demo["runtime_capability_id"],
        runtime_work_binding_digest=demo["binding_digest"],
    )
    with grpc.insecure_channel(f"127.0.0.1:{stack.runtime_port}") as channel:
        stub = runtime_v1.FlowDefinitionServiceStub(channel)
        listed = stub.ListFlowVersions(
            runtime_v1.ListFlowVersionsRequest(), metadata=_md(stack.data_dir), timeout=10
        )
        active = {a.flow_api_name: a for a in listed.activations if a.state == ACTIVE}
        assert set(active) == set(EXPECTED_PROFILES)
        for name, profile in EXPECTED_PROFILES.items():
            assert active[name].plan_id == by_name[name]["plan_id"]
            assert active[name].runtime_work_binding_digest == demo["binding_digest"]
            plan = stub.GetPlan(
                runtime_v1.GetPlanRequest(plan_id=active[name].plan_id),
                metadata=_md(stack.data_dir),
                timeout=10,
            ).plan
            assert plan.execution_profile == profile, name
            assert plan.plan_digest == active[name].plan_digest == by_name[name]["plan_digest"]
            assert plan.catalog_generation_id == demo["catalog_generation_id"]
            assert plan.catalog_digest == demo["catalog_digest"]
        inventory = stub.GetInventory(
            runtime_v1.GetInventoryRequest(
                scope=common_v1.TrustedRuntimeWorkScope(
                    org_id="org-demo",
                    app_installation_id=demo["app_installation_id"],
                    runtime_capability_id=demo["runtime_capability_id"],
                    runtime_work_binding_digest=demo["binding_digest"],
                ),
                catalog_generation_id=demo["catalog_generation_id"],
                catalog_digest=demo["catalog_digest"],
            ),
            metadata=scoped,
            timeout=30,
        )
        rows = {e.flow_api_name: e for e in inventory.entries}
        assert {n: (r.compilable, r.selected_profile) for n, r in rows.items()} == {
            n: (True, p) for n, p in EXPECTED_PROFILES.items()
        }
    return demo


def _assert_before_save_transforms(stack: Stack, demo: dict[str, Any]) -> str:
    """A Contact write runs the demo's Embedded Before-Save Flow inside its transaction
    (names trimmed, a blank first name stored as null) and starts the after-save run."""
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id="org-demo",
        app_installation_id=demo["app_installation_id"],
        runtime_capability_id=demo["runtime_capability_id"],
        runtime_work_binding_digest=demo["binding_digest"],
    )
    md = _md(
        stack.data_dir,
        app_installation_id=demo["app_installation_id"],
        runtime_capability_id=demo["runtime_capability_id"],
        runtime_work_binding_digest=demo["binding_digest"],
    )
    fields = Struct()
    fields.update({"FirstName": "   ", "LastName": "  Lovelace  ", "Email": "ada@example.com"})
    with grpc.insecure_channel(f"127.0.0.1:{stack.runtime_port}") as channel:
        created = runtime_v1.RecordServiceStub(channel).CreateRecord(
            runtime_v1.CreateRecordRequest(
                request_id=f"req-{uuid.uuid4().hex}",
                scope=scope,
                object_api_name="Contact",
                fields=fields,
            ),
            metadata=md,
            timeout=30,
        )
    assert dict(created.record.fields) == {"LastName": "Lovelace", "Email": "ada@example.com"}
    assert len(created.triggered_flow_run_ids) == 1  # WelcomeContact (after-save)
    return str(created.triggered_flow_run_ids[0])


def _flowctl_mint(data_dir: Path, *args: str) -> list[tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env |= {"FLOW_ENV": "test", "FLOW_DATA_DIR": str(data_dir)}
    out = subprocess.run(
        [sys.executable, "-m", "flowctl", "auth", "mint", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [("authorization", f"Bearer {out.strip()}")]


def _assert_operator_tokens(stack: Stack, demo: dict[str, Any], run_id: str) -> None:
    """The banner's token and ``flowctl auth mint``'s default token carry the demo's
    complete work scope (scoped RPCs accept them); only a token minted with a role may
    cancel (issue 10 item 13, issue 15 item 4)."""
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=demo["org_id"],
        app_installation_id=demo["app_installation_id"],
        runtime_capability_id=demo["runtime_capability_id"],
        runtime_work_binding_digest=demo["binding_digest"],
    )
    banner_token = (stack.data_dir / "dev_token").read_text(encoding="utf-8").strip()
    minted = _flowctl_mint(stack.data_dir)
    with grpc.insecure_channel(f"127.0.0.1:{stack.runtime_port}") as channel:
        records = runtime_v1.RecordServiceStub(channel)
        for md in ([("authorization", f"Bearer {banner_token}")], minted):
            created = records.CreateRecord(
                runtime_v1.CreateRecordRequest(
                    request_id=f"req-{uuid.uuid4().hex}",
                    scope=scope,
                    object_api_name="Contact",
                    fields=_struct(LastName="Hopper"),
                ),
                metadata=md,
                timeout=30,
            )
            assert created.record.version == 1
        runs = runtime_v1.FlowRunServiceStub(channel)
        cancel = runtime_v1.CancelRunRequest(
            request_id=f"req-{uuid.uuid4().hex}", flow_run_id=run_id
        )
        with pytest.raises(grpc.RpcError) as refused:
            runs.CancelRun(cancel, metadata=minted, timeout=30)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        for md in (
            _flowctl_mint(stack.data_dir, "--role", "flow.runs.cancel"),
            [("authorization", f"Bearer {banner_token}")],
        ):
            try:
                runs.CancelRun(cancel, metadata=md, timeout=30)
            except grpc.RpcError as exc:  # the run may have settled already
                assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION, exc


def _struct(**values: Any) -> Struct:
    out = Struct()
    out.update(values)
    return out


def _wake_command(banner: str) -> str:
    """The ready-to-paste ``flowctl signal send`` command the banner prints."""
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if "signal send" in line)
    command = []
    for line in lines[start:]:
        command.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(command)


def _assert_the_banner_command_wakes_the_waiting_run(
    stack: Stack, banner: str, demo: dict[str, Any]
) -> None:
    """The demo run is parked on its durable wait; pasting the banner's command wakes it
    and the run finishes (its confirmation Task written by the resumed step)."""
    waiting = demo["waiting_run"]
    assert waiting["state"] == "waiting", waiting
    md = _md(
        stack.data_dir,
        app_installation_id=demo["app_installation_id"],
        runtime_capability_id=demo["runtime_capability_id"],
        runtime_work_binding_digest=demo["binding_digest"],
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    pasted = subprocess.run(
        ["bash", "-c", _wake_command(banner)],
        cwd=stack.data_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pasted.returncode == 0, pasted.stderr
    assert pasted.stdout.startswith("accepted "), pasted.stdout
    assert "woke dependency" in pasted.stdout, pasted.stdout

    def finished() -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{stack.runtime_port}") as channel:
            run = (
                runtime_v1.FlowRunServiceStub(channel)
                .GetRun(
                    runtime_v1.GetRunRequest(flow_run_id=waiting["flow_run_id"]),
                    metadata=md,
                    timeout=10,
                )
                .run
            )
        return run.runtime_state == common_v1.RunState.RUN_STATE_SUCCEEDED

    wait_until(finished, timeout=60, interval=0.3, what="the woken demo run to finish")


def _banner_command(banner: str, marker: str) -> str:
    """The ready-to-paste (multi-line) command of the banner that contains ``marker``."""
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    command = []
    for line in lines[start:]:
        command.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(command)


def _paste(stack: Stack, command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    return subprocess.run(
        ["bash", "-c", command],
        cwd=stack.data_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _assert_the_banner_commands_run_the_welcome_email(stack: Stack, banner: str) -> None:
    """Issue 12 item 9: the banner's commands create a Contact; WelcomeContact formats the
    name, writes the Task, e-mails the Contact (the .eml lands in data/mail), resumes on
    the owner's receipt and succeeds; an address the provider refuses takes the fault
    path."""
    create = _banner_command(banner, "record create Contact")
    watch = _banner_command(banner, "run watch RUN_ID")
    created = _paste(stack, create)
    assert created.returncode == 0, created.stderr
    run_id = re.search(r"^started run: (\S+)$", created.stdout, re.M)
    assert run_id, created.stdout
    watched = _paste(stack, watch.replace("RUN_ID", run_id.group(1)))
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert watched.stdout.strip().splitlines()[-1].split()[1] == "succeeded", watched.stdout
    mails = [
        p.read_text() for p in (stack.data_dir / "mail").glob("*.eml")
        if "Welcome, Ada Lovelace!" in p.read_text()
    ]  # fmt: skip
    assert len(mails) == 1 and "To: ada@example.com" in mails[0]

    refused = _paste(stack, create.replace("ada@example.com", "not-an-address"))
    assert refused.returncode == 0, refused.stderr
    failed_id = re.search(r"^started run: (\S+)$", refused.stdout, re.M)
    assert failed_id, refused.stdout
    failed = _paste(stack, watch.replace("RUN_ID", failed_id.group(1)))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "terminal_failed" in failed.stdout.strip().splitlines()[-1], failed.stdout
    support = _paste(
        stack,
        _banner_command(banner, "run support RUN_ID").replace("RUN_ID", failed_id.group(1)),
    )
    assert "WELCOME_EMAIL_FAILED" in support.stdout, support.stdout


def _assert_owner_mail_lands_in_the_sink(stack: Stack, demo: dict[str, Any]) -> None:
    """An effect handed to the effect owner (as the runtime's dispatcher hands it) is
    sent by the owner's email provider to the dev sink: one .eml under data/mail."""
    scope = Scope(
        "org-demo",
        demo["app_installation_id"],
        demo["runtime_capability_id"],
        demo["binding_digest"],
    )
    # Signed as the runtime signs it: with the runtime's own service key, the only key of
    # the dev stack whose trusted-keys entry may claim the handoff role.
    key = load_signing_key(stack.data_dir / "auth" / "runtime_service_key.pem")
    claims = WorkloadClaims(
        subject="runtime",
        audiences=(ServiceName.EFFECT_OWNER,),
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
        roles=(HANDOFF_SUBMIT_ROLE,),
    )
    token = mint_credential(key, "runtime-service", claims, ttl_s=300)
    md = [("authorization", f"Bearer {token}")]
    env = envelope(scope, run=f"run-{uuid.uuid4().hex[:8]}")
    with grpc.insecure_channel(f"127.0.0.1:{stack.effect_port}") as channel:
        effect_v1.EffectOwnerServiceStub(channel).AcceptHandoff(
            effect_v1.AcceptHandoffRequest(
                request_id=uuid.uuid4().hex, scope=scope.proto(), envelope=env
            ),
            metadata=md,
            timeout=30,
        )
    key_id = provider_idempotency_key("email.smtp", env.effect_handoff_key)

    def landed() -> list[Path]:
        return [p for p in (stack.data_dir / "mail").glob("*.eml") if key_id in p.read_text()]

    [mail] = wait_until(landed, timeout=60, what="the e-mail in the dev mail sink")
    assert "Subject: Welcome, ada!" in mail.read_text()


def _stop_cleanly(stack: Stack) -> None:
    children = stack.children()
    assert len(children) == 4, children  # three services and the mail sink
    assert stack.stop() == 0, stack.output()[-4000:]
    wait_until(lambda: _gone(children), timeout=10, what="the service processes to exit")


def test_devstack_seeds_the_demo_idempotently_and_stops_cleanly(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with devstack(data_dir, "first") as stack:
        text = stack.wait_banner()
        for expected in (
            "NormalizeContactName: active, embedded_before_save",
            "WelcomeContact: active, durable_orchestration",
            "AwaitApproval: active, durable_orchestration",
            "waits durably for an approval",
            "flow inventory",
            "FlowDefinitionService/GetPlan",
            "(sealed now)",
            "mail sink     smtp://127.0.0.1:",
            f"{data_dir / 'mail'}/*.eml",
        ):
            assert expected in text, text
        first = _assert_demo_active(stack)
        assert not first["generation_reused"]
        run_id = _assert_before_save_transforms(stack, first)
        _assert_the_banner_command_wakes_the_waiting_run(stack, text, first)
        _assert_operator_tokens(stack, first, run_id)
        _assert_the_banner_commands_run_the_welcome_email(stack, text)
        _assert_owner_mail_lands_in_the_sink(stack, first)
        _stop_cleanly(stack)

    # Same data dir again: the unchanged catalog reuses the generation the plans pin, so
    # compile and activation are no-ops and every identity is unchanged.
    with devstack(data_dir, "second") as stack:
        text = stack.wait_banner()
        assert "(reused: catalog unchanged)" in text, text
        second = _assert_demo_active(stack)
        assert second["generation_reused"]
        for key in ("binding_digest", "catalog_generation_id", "catalog_digest", "flows"):
            assert second[key] == first[key], key
        # Each start parks a new waiting run (the first one's signal was consumed).
        assert second["waiting_run"]["flow_run_id"] != first["waiting_run"]["flow_run_id"]
        _assert_the_banner_command_wakes_the_waiting_run(stack, text, second)
        _stop_cleanly(stack)


def test_devstack_seeding_failure_stops_the_stack(tmp_path: Path) -> None:
    # The runtime cannot reach the catalog, so compiling the demo fails after the
    # services report SERVING: the stack must say why, stop its children and exit 1.
    dead = free_port()
    data_dir = tmp_path / "data"
    with devstack(data_dir, "broken", {"FLOW_CATALOG_TARGET": f"127.0.0.1:{dead}"}) as stack:
        seen: list[int] = []

        def exited() -> bool:
            seen.extend(p for p in stack.children() if p not in seen)
            return stack.proc.poll() is not None

        wait_until(exited, timeout=60, interval=0.1, what="devstack to exit")
        assert stack.proc.returncode == 1
        err = stack.err.read_text(errors="replace")
        assert "seeding the demo failed" in err and "compiling" in err, err
        assert BANNER not in stack.out.read_text()
        assert seen, "the services were never started"
        assert _gone(seen), seen


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, grand-children, …; Linux ``/proc``)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        found += kids
        frontier += kids
    return found


def test_devstack_with_worker_processes_runs_flows_and_ctrl_c_leaves_no_process(
    tmp_path: Path,
) -> None:
    """``FLOW_RUNTIME_WORKER_PROCESSES=2 make run``: the runtime supervises two worker
    processes that execute the demo (the waiting run parks and, woken, finishes); a
    terminal's Ctrl-C (SIGINT to the whole process group) stops every process — the worker
    processes included — and the stack exits 0."""
    data_dir = tmp_path / "data"
    extra = {"FLOW_RUNTIME_WORKER_PROCESSES": "2"}
    with devstack(data_dir, "procs", extra, new_session=True) as stack:
        text = stack.wait_banner()
        assert "step workers  2 worker processes x 1" in text, text
        demo = _assert_demo_active(stack)
        _assert_the_banner_command_wakes_the_waiting_run(stack, text, demo)
        family = _descendants(stack.proc.pid)
        # Three services, the mail sink and the runtime's two worker processes.
        assert len(family) == 6, family
        os.killpg(stack.proc.pid, signal.SIGINT)
        assert stack.proc.wait(timeout=90) == 0, stack.output()[-4000:]
        wait_until(lambda: _gone(family), timeout=60, what="every process of the stack to exit")
