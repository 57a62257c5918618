"""Every call of the grpcurl cookbook ``make run`` writes answers what the page says.

The page (``./.data/grpcurl.md``, the filled-in twin of ``docs/grpcurl.md``) is parsed, and
each ``# expect:`` block is run with bash in page order, after the page's own set-up block
(PATH and the three credentials). ``OK`` means grpcurl exited 0; any other value is the gRPC
status grpcurl must report. After changing a call in ``flowctl/cookbook_calls.py``,
regenerate ``docs/grpcurl.md``.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from flowctl.cookbook import CALLS, documented_calls, setup_lines
from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName
from services.effect_contract import provider_idempotency_key
from services.proto import common_v1, effect_v1, runtime_v1
from tests.support.procs import wait_until
from tests.support.stack import DemoStack, demo_stack

pytestmark = pytest.mark.e2e

_CONSUMED = common_v1.WakeSignalResolutionState.WAKE_SIGNAL_RESOLUTION_STATE_CONSUMED


def _camel(status: str) -> str:
    """``FAILED_PRECONDITION`` -> ``FailedPrecondition`` (how grpcurl prints codes)."""
    return "".join(part.capitalize() for part in status.split("_"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoStack]:
    with demo_stack(tmp_path_factory.mktemp("cookbook-stack")) as running:
        yield running


def test_every_documented_call_answers_the_documented_status(stack: DemoStack) -> None:
    page = (stack.data_dir / "grpcurl.md").read_text(encoding="utf-8")
    assert "grpcurl.md" in stack.output()  # the banner points at it
    calls = documented_calls(page)
    documented = {c.split()[-1] for _, c in calls}
    for call in CALLS:
        assert f"{call.service}/{call.method}" in documented
    setup = "\n".join(setup_lines(page))
    failures = []
    for expect, command in calls:
        result = subprocess.run(
            ["bash", "-c", f"set -e\n{setup}\n{command}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        codes = re.findall(r"^\s*Code: (\w+)$", result.stderr, re.M)
        got = "OK" if result.returncode == 0 else (codes[0] if codes else result.stderr.strip())
        want = "OK" if expect == "OK" else _camel(expect)
        if got != want:
            failures.append(f"{command.split()[-1]}: expected {want}, got {got}")
    assert not failures, "\n".join(failures)
    assert len(calls) >= len(CALLS) + 5  # plus list, describe and health checks


def test_the_cookbook_leaves_the_demo_with_its_own_active_flows(stack: DemoStack) -> None:
    # The set-up deactivates CookbookPing again, and so does the page's last definition call
    # (the previous test ran the whole page).
    key = load_signing_key(stack.data_dir / "auth" / "dev_signing_key.pem")
    claims = WorkloadClaims(subject="e2e", audiences=(ServiceName.RUNTIME,), org_id="org-demo")
    md = [("authorization", f"Bearer {mint_credential(key, 'dev', claims, ttl_s=300)}")]
    with grpc.insecure_channel(stack.runtime_target) as channel:
        listed = runtime_v1.FlowDefinitionServiceStub(channel).ListFlowVersions(
            runtime_v1.ListFlowVersionsRequest(org_id="org-demo"), metadata=md, timeout=30
        )
    active = {
        a.flow_api_name
        for a in listed.activations
        if a.state == runtime_v1.ActivationState.ACTIVATION_STATE_ACTIVE
    }
    assert active == {"NormalizeContactName", "WelcomeContact", "AwaitApproval"}
    assert "CookbookPing" in {v.flow_api_name for v in listed.flow_versions}


def test_the_page_approved_the_waiting_run_and_the_owner_sent_the_handed_over_mail(
    stack: DemoStack,
) -> None:
    # The first test ran the whole page: its SubmitWakeSignal woke the set-up's
    # AwaitApproval run, and its AcceptHandoff names the command whose e-mail the owner sent.
    page = (stack.data_dir / "grpcurl.md").read_text(encoding="utf-8")
    nonce = re.search(r"\(nonce `([0-9a-f]+)`\)", page)
    handoff = re.search(r'"effect_handoff_key": "(ehk1:[0-9a-f:]+)"', page)
    run_id = re.search(r"AwaitApproval run `([^`]+)`", page)
    assert nonce and handoff and run_id, page[:400]
    demo = stack.demo
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=demo["org_id"],
        app_installation_id=demo["app_installation_id"],
        runtime_capability_id=demo["runtime_capability_id"],
        runtime_work_binding_digest=demo["binding_digest"],
    )
    key = load_signing_key(stack.data_dir / "auth" / "dev_signing_key.pem")
    claims = WorkloadClaims(
        subject="e2e",
        audiences=(ServiceName.RUNTIME, ServiceName.EFFECT_OWNER),
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
    )
    md = [("authorization", f"Bearer {mint_credential(key, 'dev', claims, ttl_s=300)}")]
    with (
        grpc.insecure_channel(stack.runtime_target) as runtime,
        grpc.insecure_channel(stack.effect_target) as owner,
    ):
        signals = runtime_v1.WakeSignalServiceStub(runtime)
        runs = runtime_v1.FlowRunServiceStub(runtime)

        def consumed() -> Any:
            signal = signals.GetWakeSignal(
                runtime_v1.GetWakeSignalRequest(
                    scope=scope,
                    key=runtime_v1.WakeSignalKey(
                        producer_kind="external.signal",
                        producer_key=f"approval:cookbook-{nonce.group(1)}",
                        wake_token=f"approve-cookbook-{nonce.group(1)}",
                    ),
                ),
                metadata=md,
                timeout=30,
            ).signal
            return signal if signal.resolution_state == _CONSUMED else None

        signal = wait_until(consumed, timeout=60, interval=0.3, what="the approval consumed")
        assert signal.dependency_id

        def succeeded() -> bool:
            run = runs.GetRun(
                runtime_v1.GetRunRequest(org_id=scope.org_id, flow_run_id=run_id.group(1)),
                metadata=md,
                timeout=30,
            ).run
            assert run.flow_api_name == "AwaitApproval"
            return run.runtime_state == common_v1.RunState.RUN_STATE_SUCCEEDED

        wait_until(succeeded, timeout=60, interval=0.3, what="the approved run to finish")
        command = (
            effect_v1.EffectOwnerServiceStub(owner)
            .GetCommand(
                effect_v1.GetCommandRequest(scope=scope, effect_handoff_key=handoff.group(1)),
                metadata=md,
                timeout=30,
            )
            .command
        )
    mails = [
        p
        for p in (stack.data_dir / "mail").glob("*.eml")
        if provider_idempotency_key("email.smtp", command.effect_handoff_key) in p.read_text()
    ]
    assert len(mails) == 1 and "To: grace@example.com" in mails[0].read_text()
