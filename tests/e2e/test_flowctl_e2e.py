"""``flowctl run …`` and ``flowctl record …`` end to end against a running dev stack.

The stack's runtime serves the API with ``FLOW_RUNTIME_WORKERS=0``; steps are executed by
a separate ``python -m runtime_svc worker`` process on the same database (the split the
Helm charts deploy), started by the ``worker`` fixture. Tests that need a run to stay
put (cancel, delete) run before any test asks for the worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowctl.__main__ import main as flowctl_main
from tests.support.browser import dump_dom, screenshot
from tests.support.procs import ROOT, ServiceProcess, free_port, wait_until
from tests.support.stack import DemoStack, demo_stack

pytestmark = pytest.mark.e2e

#: Autolaunched and provably safe: Bounded Atomic, executed inside StartRun.
PING_FLOW = {
    "api_name": "FlowctlPing",
    "version": 1,
    "process_type": "autolaunched",
    "variables": [
        {"name": "subject", "type": "string", "input": True},
        {"name": "greeting", "type": "string", "output": True},
    ],
    "start": "greet",
    "elements": [
        {
            "api_name": "greet",
            "type": "Assignment",
            "assignments": [{"target": "greeting", "value": "CONCAT('Hello ', subject)"}],
            "next": "make_task",
        },
        {
            "api_name": "make_task",
            "type": "CreateRecord",
            "object": "Task",
            "fields": {"Subject": "greeting"},
        },
    ],
}
#: Autolaunched with an at-most-once owned-transaction, system-mode action: Durable
#: Orchestration, so the run waits for a worker.
HOLD_FLOW = {
    "api_name": "FlowctlHold",
    "version": 1,
    "process_type": "autolaunched",
    "variables": [{"name": "whoId", "type": "string", "input": True}],
    "start": "task",
    "elements": [
        {
            "api_name": "task",
            "type": "ActionCall",
            "action_type": "core.create_task",
            "inputs": {"who_id": "whoId", "subject": "'call back'"},
            # The demo catalog runs core.create_task in system mode: it needs an explicit
            # declared identity (§17.1).
            "system_identity": "svc-platform-tasks",
        }
    ],
}

#: A Subflow target the next Flow calls; only registered (activation reads registered
#: versions, not active ones).
SUBFLOW_CHILD = {
    "api_name": "FlowctlShout",
    "version": 1,
    "process_type": "autolaunched",
    "variables": [
        {"name": "text", "type": "string", "input": True},
        {"name": "loud", "type": "string", "output": True},
    ],
    "start": "shout",
    "elements": [
        {
            "api_name": "shout",
            "type": "Assignment",
            "assignments": [{"target": "loud", "value": "CONCAT(text, '!')"}],
        }
    ],
}
#: Calls :data:`SUBFLOW_CHILD`: ``flowctl flow compile`` needs the child's source too.
SUBFLOW_PARENT = {
    "api_name": "FlowctlCallShout",
    "version": 1,
    "process_type": "autolaunched",
    "variables": [
        {"name": "subject", "type": "string", "input": True},
        {"name": "greeting", "type": "string", "output": True},
    ],
    "start": "call_shout",
    "elements": [
        {
            "api_name": "call_shout",
            "type": "Subflow",
            "flow": "FlowctlShout",
            "version": 1,
            "inputs": {"text": "subject"},
            "outputs": {"greeting": "loud"},
        }
    ],
}


class Cli:
    """Runs ``flowctl`` in-process against the stack, capturing its output."""

    def __init__(self, stack: DemoStack, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
        for key, value in stack.env.items():
            if key.startswith("FLOW_"):
                monkeypatch.setenv(key, value)
        self._capsys = capsys

    def __call__(self, *argv: str, rc: int = 0) -> str:
        self._capsys.readouterr()
        code = flowctl_main(list(argv))
        out, err = self._capsys.readouterr()
        assert code == rc, f"flowctl {' '.join(argv)} -> {code}\n{out}\n{err}"
        return out + err

    def json(self, *argv: str) -> Any:
        return json.loads(self(*argv, "--json"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoStack]:
    with demo_stack(
        tmp_path_factory.mktemp("flowctl-stack"), extra_env={"FLOW_RUNTIME_WORKERS": "0"}
    ) as running:
        yield running


@pytest.fixture(scope="module")
def worker(stack: DemoStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """``python -m runtime_svc worker`` on the stack's database: the only step executor."""
    port = free_port()
    env = dict(stack.env)
    env.update(
        {
            "FLOW_RUNTIME_PORT": str(port),
            "FLOW_RUNTIME_WORKERS": "1",
            "FLOW_RUNTIME_SWEEPS": "false",
        }
    )
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    proc = ServiceProcess("runtime", port, env, log)
    proc.proc = subprocess.Popen(
        [sys.executable, "-m", "runtime_svc", "worker"],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def cli(stack: DemoStack, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> Cli:
    return Cli(stack, monkeypatch, capsys)


def _activate(cli: Cli, tmp_path: Path, flow: dict[str, Any], stack: DemoStack) -> None:
    path = tmp_path / f"{flow['api_name']}.json"
    path.write_text(json.dumps(flow), encoding="utf-8")
    version = json.loads(cli("flow", "register", str(path)))["flow_version_id"]
    cli(
        "flow",
        "activate",
        "--flow-version",
        version,
        "--generation",
        stack.demo["catalog_generation_id"],
        "--catalog-digest",
        stack.demo["catalog_digest"],
    )


def _clean_env(**flow: str) -> dict[str, str]:
    """This process's environment without any FLOW_* variable, plus ``flow``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    return {**env, **flow}


def _flowctl(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowctl", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- without a stack --------------------------------------------------------------------


def test_bad_flags_exit_2_with_a_message_naming_the_flag_or_variable(tmp_path: Path) -> None:
    env = _clean_env(FLOW_DATA_DIR=str(tmp_path), FLOW_RUNTIME_PORT="1")
    cases = [
        (("run", "start"), "needs a FLOW api name or --plan-id"),
        (("run", "start", "Foo"), "missing --app-installation, --capability, --binding-digest"),
        (("record", "update", "Contact", "r1", "--field", "A=1"), "--expected-version"),
        (("record", "create", "Contact"), "--field NAME=VALUE or --fields JSON"),
        (("run", "watch", "r1", "--timeout", "0"), "--timeout: must be > 0"),
        (("run", "list", "--state", "bogus"), "argument --state: invalid choice"),
        (("run", "view", "r1"), "the following arguments are required: --html"),
    ]
    for argv, message in cases:
        result = _flowctl(*argv, env=env)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert message in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr
    bad = _flowctl("run", "list", env={**env, "FLOW_RUNTIME_PORT": "http"})
    assert bad.returncode == 2 and "FLOW_RUNTIME_PORT must be an integer" in bad.stderr, bad.stderr


def test_an_unreachable_server_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from services.auth import ensure_dev_keys

    ensure_dev_keys(tmp_path, env="development", key_id="dev")
    env = _clean_env(FLOW_DATA_DIR=str(tmp_path))
    dead = f"127.0.0.1:{free_port()}"
    for argv in (("run", "get", "run_x"), ("record", "get", "Contact", "r1"), ("run", "list")):
        result = _flowctl(*argv, "--target", dead, env=env)
        assert result.returncode == 1, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"flowctl: cannot reach {dead}:"), lines
        assert "Traceback" not in result.stderr


# --- against the stack (no worker yet) ----------------------------------------------------


def test_run_start_of_a_bounded_atomic_flow_prints_its_outputs(
    cli: Cli, stack: DemoStack, tmp_path: Path
) -> None:
    _activate(cli, tmp_path, PING_FLOW, stack)
    text = cli("run", "start", "FlowctlPing", "--input", '{"subject": "Ada"}', "--wait", "20")
    assert re.search(r"^state:\s+succeeded$", text, re.M), text
    assert 'greeting = "Hello Ada"' in text
    first = cli.json(
        "run",
        "start",
        "FlowctlPing",
        "--input",
        '{"subject": "Bo"}',
        "--idempotency-key",
        "k-1",
        "--wait",
        "20",
    )
    again = cli.json(
        "run", "start", "FlowctlPing", "--input", '{"subject": "Bo"}', "--idempotency-key", "k-1"
    )
    assert first["completed"] is True and first["run"]["runtime_state"] == "RUN_STATE_SUCCEEDED"
    assert again["existing_run"] is True
    assert again["run"]["flow_run_id"] == first["run"]["flow_run_id"]
    listed = cli("run", "list", "--flow", "FlowctlPing")
    assert first["run"]["flow_run_id"] in listed and "succeeded" in listed
    got = cli.json("run", "get", first["run"]["flow_run_id"])
    assert got["output_variables"] == {"greeting": "Hello Bo"}


def test_cancel_then_delete_a_run_no_worker_has_picked_up(
    cli: Cli, stack: DemoStack, tmp_path: Path
) -> None:
    _activate(cli, tmp_path, HOLD_FLOW, stack)
    started = cli.json("run", "start", "FlowctlHold", "--input", '{"whoId": "c-1"}')
    run_id = started["run"]["flow_run_id"]
    assert started["run"]["execution_profile"] == "EXECUTION_PROFILE_DURABLE_ORCHESTRATION"
    assert cli.json("run", "get", run_id)["runtime_state"] in (
        "RUN_STATE_ACCEPTED",
        "RUN_STATE_RUNNABLE",
    )
    cancelled = cli.json("run", "cancel", run_id, "--reason", "operator_test")
    assert cancelled["runtime_state"] in ("RUN_STATE_CANCEL_REQUESTED", "RUN_STATE_CANCELLED")
    # The API process's sweep finishes the cleanup; watch follows it to the end.
    text = cli("run", "watch", run_id, "--interval", "0.2", "--timeout", "60", rc=1)
    assert text.strip().splitlines()[-1].split()[1] == "cancelled", text
    deleted = cli.json("run", "delete", run_id)
    assert deleted["is_deleted"] is True
    assert "NOT_FOUND" in cli("run", "get", run_id, rc=1)
    assert run_id not in cli("run", "list", "--flow", "FlowctlHold")


def test_flow_compile_of_the_demo_flows_against_the_running_catalog_gives_the_active_plans(
    cli: Cli, stack: DemoStack
) -> None:
    examples = ROOT / "examples" / "flows"
    files = {
        json.loads(p.read_text(encoding="utf-8"))["api_name"]: p for p in examples.glob("*.json")
    }
    assert {f["flow_api_name"] for f in stack.demo["flows"]} == {
        "NormalizeContactName",
        "WelcomeContact",
        "AwaitApproval",
    }
    for flow in stack.demo["flows"]:
        text = cli("flow", "compile", str(files[flow["flow_api_name"]]))  # demo.json's generation
        assert f"Flow {flow['flow_api_name']}@" in text, text
        assert f"Plan digest: {flow['plan_digest']}" in text, text
    mermaid = cli("flow", "plan", str(examples / "welcome_contact.json"))
    assert mermaid.startswith("flowchart TD")
    assert "together" in cli(
        "flow", "compile", str(examples / "welcome_contact.json"), "--generation", "g", rc=2
    )
    missing = cli(
        "flow",
        "compile",
        str(examples / "welcome_contact.json"),
        "--generation",
        "gen-unknown",
        "--catalog-digest",
        stack.demo["catalog_digest"],
        rc=1,
    )
    assert "gen-unknown" in missing and "Traceback" not in missing


def test_flow_compile_of_a_flow_with_a_subflow_reads_the_registered_subflow_from_the_runtime(
    cli: Cli, stack: DemoStack, tmp_path: Path
) -> None:
    child = tmp_path / "child.json"
    child.write_text(json.dumps(SUBFLOW_CHILD), encoding="utf-8")
    cli("flow", "register", str(child))  # registered, never activated: activation reads it
    parent = tmp_path / "parent.json"
    parent.write_text(json.dumps(SUBFLOW_PARENT), encoding="utf-8")
    version = json.loads(cli("flow", "register", str(parent)))["flow_version_id"]
    activation = json.loads(
        cli(
            "flow",
            "activate",
            "--flow-version",
            version,
            "--generation",
            stack.demo["catalog_generation_id"],
            "--catalog-digest",
            stack.demo["catalog_digest"],
        )
    )
    text = cli("flow", "compile", str(parent))
    assert f"Plan digest: {activation['plan_digest']}" in text, text


# --- with the worker-only replica ---------------------------------------------------------


def _create_contact(cli: Cli, first: str) -> tuple[str, str]:
    text = cli(
        "record",
        "create",
        "Contact",
        "--field",
        f"FirstName={first}",
        "--field",
        "LastName=  Lovelace ",
        "--field",
        "Email=ada@example.com",
    )
    record_id = re.search(r"^record:\s+Contact (\S+)$", text, re.M)
    run_id = re.search(r"^started run: (\S+)$", text, re.M)
    assert record_id and run_id, text
    assert 'LastName = "Lovelace"' in text  # the demo's before-save Flow trimmed it
    return record_id.group(1), run_id.group(1)


def test_records_and_the_triggered_run_on_a_worker_only_replica(
    cli: Cli, stack: DemoStack, worker: ServiceProcess
) -> None:
    record_id, run_id = _create_contact(cli, "Ada")
    code = flowctl_main(["run", "watch", run_id, "--interval", "0.2", "--timeout", "120"])
    final = cli.json("run", "get", run_id)
    # The whole demo Flow, its e-mail effect included, ends Succeeded (issue 12).
    assert final["runtime_state"] == "RUN_STATE_SUCCEEDED", final
    assert code == 0
    assert any(
        "Welcome, Ada Lovelace!" in p.read_text() for p in (stack.data_dir / "mail").glob("*.eml")
    )
    # Only the worker process executes steps: the API runtime runs none (its own log says
    # so), yet every step of the run has an attempt.
    api_log = (stack.data_dir / "runtime_svc.log").read_text(errors="replace")
    assert "runtime background: 0 worker(s)" in api_log
    assert "runtime background: 1 worker(s), sweeps=False" in worker.log_text()
    support = cli.json("run", "support", run_id)
    assert support["steps"] and all(int(s["attempt_count"]) >= 1 for s in support["steps"])
    assert any(s["plan_step_key"] == "format_name" for s in support["steps"])

    got = cli("record", "get", "Contact", record_id)
    assert re.search(r"^version:\s+1$", got, re.M), got
    updated = cli(
        "record",
        "update",
        "Contact",
        record_id,
        "--expected-version",
        "1",
        "--field",
        "FirstName=  Grace  ",
    )
    assert re.search(r"^version:\s+2$", updated, re.M) and 'FirstName = "Grace"' in updated
    stale = cli(
        "record",
        "update",
        "Contact",
        record_id,
        "--expected-version",
        "1",
        "--field",
        "FirstName=Ada",
        rc=1,
    )
    assert "ABORTED" in stale
    assert cli.json("record", "get", "Contact", record_id)["record"]["version"] == "2"


def test_support_read_and_the_timeline_page_in_headless_chromium(
    cli: Cli, stack: DemoStack, worker: ServiceProcess, tmp_path: Path
) -> None:
    _, run_id = _create_contact(cli, "Alan")
    flowctl_main(["run", "watch", run_id, "--interval", "0.2", "--timeout", "120"])
    support = cli.json("run", "support", run_id)
    steps = [s["plan_step_key"] for s in support["steps"]]
    assert steps[:2] == ["format_name", "create_follow_up"], steps
    table = cli("run", "support", run_id)
    for heading in ("STEPS", "ATTEMPTS", "DEPENDENCIES", "EFFECTS"):
        assert heading in table
    for key in steps:
        assert key in table

    page = tmp_path / "run.html"
    assert f"({len(steps)} steps" in cli("run", "view", run_id, "--html", str(page))
    dom = dump_dom(page)
    assert 'data-rendered="true"' in dom, dom[:2000]  # the page's script ran
    rows = re.findall(r'<div class="row" data-step-key="([^"]+)"', dom)
    assert rows == steps, (rows, steps)
    bars = re.findall(r'<div class="bar (\w+)"', dom)
    assert len(bars) == len(support["attempts"]) and bars, bars
    assert support["run"]["flow_run_id"] in dom and "WelcomeContact" in dom
    png = screenshot(page, tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_worker_process_drains_on_sigterm(worker: ServiceProcess) -> None:
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=60) == 0
    wait_until(lambda: worker.proc is not None and worker.proc.poll() is not None, timeout=5)
