"""Typed transition input is rejected before any SQL (§10.1 "an internal caller without
the typed transition capability and expected owner/epoch/version is rejected before SQL
execution"): the store here has an engine that fails the test if it is ever touched."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime_svc.kernel import (
    CheckpointInput,
    FailureClass,
    FinishRun,
    FirstStep,
    FlowRunStateStore,
    LeaseFence,
    StartRunRequest,
    StepFailure,
    TransitionInputError,
)
from runtime_svc.kernel.store_reads import Candidate
from services.errors import InvalidArgumentError
from tests.unit.kernel.factories import ORG, T0


class ExplodingEngine:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"SQL was attempted ({name})")


FENCE = LeaseFence(
    org_id=ORG,
    flow_run_id="run_1",
    step_execution_id="step_1",
    attempt_id="att_1",
    attempt_number=1,
    lease_owner="w",
    lease_token="tok",
    ownership_epoch=1,
    root_state_version=1,
    step_state_version=2,
    attempt_state_version=0,
    input_checkpoint_id="ckpt_1",
    lease_until=T0,
)
BAD_FENCES = [
    ("other_org", dataclasses.replace(FENCE, org_id="org_other")),
    ("epoch_zero", dataclasses.replace(FENCE, ownership_epoch=0)),
    ("other_epoch", dataclasses.replace(FENCE, ownership_epoch=2)),
    ("no_token", dataclasses.replace(FENCE, lease_token="")),
    ("negative_version", dataclasses.replace(FENCE, root_state_version=-1)),
]


def store() -> FlowRunStateStore:
    return FlowRunStateStore(ExplodingEngine())  # type: ignore[arg-type]


@pytest.mark.parametrize(("label", "fence"), BAD_FENCES, ids=[b[0] for b in BAD_FENCES])
async def test_every_fenced_transition_rejects_bad_input_before_sql(
    label: str, fence: LeaseFence
) -> None:
    s = store()
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: s.mark_running(ORG, fence),
        lambda: s.extend_lease(ORG, fence),
        lambda: s.commit_step(ORG, fence, output=CheckpointInput({}), advance=FinishRun()),
        lambda: s.record_rollback(ORG, fence, StepFailure(FailureClass.RETRYABLE, "x")),
        lambda: s.quarantine_commit_unknown(ORG, fence),
    ]
    for call in calls:
        with pytest.raises(TransitionInputError):
            await call()


async def test_foreign_candidates_and_credential_checkpoints_never_reach_sql() -> None:
    s = store()
    candidate = Candidate("org_other", "run_1", "step_1", 0, 0, T0, "durable_mutation")
    with pytest.raises(TransitionInputError):
        await s.claim(ORG, candidate, lease_owner="w")
    with pytest.raises(InvalidArgumentError):
        await s.commit_step(ORG, FENCE, output=CheckpointInput({"token": "x"}), advance=FinishRun())
    with pytest.raises(InvalidArgumentError):
        await s.commit_step_txn(
            None,  # type: ignore[arg-type]
            ORG,
            FENCE,
            output=CheckpointInput({"password": "hunter2"}),
            advance=FinishRun(),
        )
    with pytest.raises(InvalidArgumentError):
        await s.create_run(
            None,  # type: ignore[arg-type]
            StartRunRequest(
                "plan",
                FirstStep("s1", "PureCompute", "durable_mutation"),
                CheckpointInput({"session": {"cookie": "abc"}}),
            ),
        )
