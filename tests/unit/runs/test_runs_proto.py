"""FlowRun proto mapping (§18.2 projection, §19 no payload/raw token) and pinned exports."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

import runtime_svc.runs as runs
from runtime_svc.api.runs_proto import run_proto
from runtime_svc.kernel import ExecutionOwner, RunRecord, RunState
from runtime_svc.kernel.states import StepState
from runtime_svc.kernel.tables import compatibility_status
from runtime_svc.runs import RunView, start_key
from services.auth import TrustedRuntimeWorkScope
from services.proto import common_v1

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _run(state: RunState, status: str) -> RunRecord:
    return RunRecord(
        org_id="org",
        flow_run_id="run_1",
        app_installation_id="inst",
        runtime_capability_id="cap",
        runtime_work_binding_digest="bd",
        flow_version_id="fv",
        plan_id="plan",
        execution_profile="bounded_atomic",
        execution_owner=ExecutionOwner.FLOW_RUNTIME_V2,
        state=state,
        state_version=3,
        ownership_epoch=1,
        current_step_execution_id="step",
        current_checkpoint_id="ckpt",
        run_after=NOW,
        queue_class="bounded_atomic_foreground",
        priority=0,
        terminal_cause_code=None,
        is_deleted=False,
        delete_requested_at=None,
        started_at=None,
        completed_at=None,
        idempotency_key=start_key(TrustedRuntimeWorkScope("o", "i", "c", "b"), "f", "client-key"),
        request_digest="d",
        interview_status=status,
        current_element="make",
        paused_at=None,
        created_at=NOW,
        updated_at=NOW,
    )


@pytest.mark.parametrize(
    ("state", "step", "expected"),
    [
        (RunState.ACCEPTED, StepState.PENDING, "COMPATIBILITY_STATUS_RUNNING"),
        (RunState.RUNNABLE, StepState.PENDING, "COMPATIBILITY_STATUS_RUNNING"),
        (RunState.RUNNING, StepState.RUNNING, "COMPATIBILITY_STATUS_RUNNING"),
        (RunState.WAITING, StepState.WAITING, "COMPATIBILITY_STATUS_PAUSED"),
        (RunState.SUCCEEDED, StepState.SUCCEEDED, "COMPATIBILITY_STATUS_FINISHED"),
        (RunState.TERMINAL_FAILED, StepState.FAILED, "COMPATIBILITY_STATUS_ERROR"),
        (RunState.QUARANTINED, StepState.QUARANTINED, "COMPATIBILITY_STATUS_ERROR"),
        (RunState.CANCELLED, StepState.CANCELLED, "COMPATIBILITY_STATUS_ERROR"),
    ],
)
def test_run_proto_carries_the_section_18_2_projection(
    state: RunState, step: StepState, expected: str
) -> None:
    status = compatibility_status(state, step).code
    msg = run_proto(RunView(_run(state, status), "f", "pd"))
    assert msg.runtime_state == int(state)
    assert common_v1.CompatibilityStatus.Name(msg.compatibility.status) == expected
    assert msg.compatibility.current_element == "make"
    assert msg.idempotency_key == "client-key"
    assert msg.flow_api_name == "f" and msg.plan_digest == "pd"
    assert not msg.HasField("output_variables")


def test_outputs_are_set_only_when_given() -> None:
    msg = run_proto(RunView(_run(RunState.SUCCEEDED, "Finished"), "f", "pd", {"result": "x"}))
    assert dict(msg.output_variables) == {"result": "x"}


def test_public_exports_are_pinned() -> None:
    assert runs.__all__ == [
        "AFTER_SAVE",
        "CANCEL_ROLE",
        "DELETE_ROLE",
        "DeclaredVariable",
        "FlowTarget",
        "PageCursor",
        "PageTokenCodec",
        "ResolvedPlan",
        "RunService",
        "RunSupport",
        "RunView",
        "StartOutcome",
        "admit_after_save_runs_txn",
        "after_save_key",
        "caller_key",
        "select_after_save_plans",
        "start_key",
        "validate_input_variables",
    ]
