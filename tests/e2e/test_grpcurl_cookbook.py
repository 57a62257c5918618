"""Every call of the grpcurl cookbook ``make run`` writes answers what the page says.

The page (``./.data/grpcurl.md``, the filled-in twin of ``docs/grpcurl.md``) is parsed, and
each ``# expect:`` block is run with bash in page order, after the page's own set-up block
(PATH and the two credentials). ``OK`` means grpcurl exited 0; any other value is the gRPC
status grpcurl must report. When an RPC lands, flip its ``expect`` in
``flowctl/cookbook_calls.py`` and regenerate ``docs/grpcurl.md``.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from flowctl.cookbook import CALLS, documented_calls, setup_lines
from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName
from services.proto import runtime_v1
from tests.support.stack import DemoStack, demo_stack

pytestmark = pytest.mark.e2e


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
    assert active == {"NormalizeContactName", "WelcomeContact"}
    assert "CookbookPing" in {v.flow_api_name for v in listed.flow_versions}
