"""Row snapshots for the pure kernel tests, and an in-memory applier of decisions that
mirrors the store's compare-and-swap semantics (expected version/state/fence, then bump)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from runtime_svc.kernel.model import (
    AttemptPatch,
    AttemptRecord,
    LeaseFence,
    RunPatch,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
    patch_changes,
)
from runtime_svc.kernel.policy import RetryPolicy, lease_token_digest
from runtime_svc.kernel.states import (
    AttemptOutcome,
    ExecutionOwner,
    RunState,
    StepState,
)
from runtime_svc.kernel.tables import compatibility_status

T0 = datetime(2030, 1, 1, tzinfo=UTC)
ORG = "org_unit"
POLICY = RetryPolicy(
    max_attempts=4,
    base_delay_ms=1_000,
    max_delay_ms=30_000,
    jitter_ratio=0.3,
    lease_duration_ms=10_000,
    max_lease_expiries=2,
)


def run(**overrides: Any) -> RunRecord:
    values: dict[str, Any] = {
        "org_id": ORG,
        "flow_run_id": "run_1",
        "app_installation_id": "inst",
        "runtime_capability_id": "cap",
        "runtime_work_binding_digest": "binding",
        "flow_version_id": "fv",
        "plan_id": "plan",
        "execution_profile": "durable_orchestration",
        "execution_owner": ExecutionOwner.FLOW_RUNTIME_V2,
        "state": RunState.RUNNABLE,
        "state_version": 0,
        "ownership_epoch": 1,
        "current_step_execution_id": "step_1",
        "current_checkpoint_id": "ckpt_1",
        "run_after": T0,
        "queue_class": "durable_mutation",
        "priority": 0,
        "terminal_cause_code": None,
        "is_deleted": False,
        "delete_requested_at": None,
        "started_at": None,
        "completed_at": None,
        "idempotency_key": None,
        "request_digest": None,
        "interview_status": "Running",
        "current_element": "s1",
        "paused_at": None,
        "created_at": T0,
        "updated_at": T0,
    }
    values.update(overrides)
    return RunRecord(**values)


def step(**overrides: Any) -> StepRecord:
    values: dict[str, Any] = {
        "org_id": ORG,
        "step_execution_id": "step_1",
        "flow_run_id": "run_1",
        "plan_step_key": "s1",
        "invocation_ordinal": 0,
        "step_kind": "PureCompute",
        "state": StepState.PENDING,
        "input_checkpoint_id": "ckpt_1",
        "output_checkpoint_id": None,
        "state_version": 0,
        "attempt_count": 0,
        "lease_owner": None,
        "lease_token_digest": None,
        "lease_until": None,
        "ownership_epoch": 1,
        "run_after": T0,
        "queue_class": "durable_mutation",
        "failure_class": None,
        "created_at": T0,
        "updated_at": T0,
    }
    values.update(overrides)
    return StepRecord(**values)


@dataclass
class Model:
    """One run with its steps and attempts, held in memory; ``apply`` behaves like the
    store's conditional UPDATEs (a mismatch raises ``Mismatch``, nothing is applied)."""

    root: RunRecord
    steps: dict[str, StepRecord]
    attempts: dict[str, AttemptRecord] = field(default_factory=dict)
    now: datetime = T0
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def current(self) -> StepRecord | None:
        sid = self.root.current_step_execution_id
        return None if sid is None else self.steps.get(sid)

    def latest_attempt(self, s: StepRecord) -> AttemptRecord | None:
        found = [a for a in self.attempts.values() if a.step_execution_id == s.step_execution_id]
        return max(found, key=lambda a: a.attempt_number, default=None)

    def apply(self, t: Transition) -> None:
        root, steps, attempts = self.root, dict(self.steps), dict(self.attempts)
        projected = (
            StepState.PENDING if t.new_step else (t.step.to_state if t.step is not None else None)
        )
        if t.run is not None:
            root = _apply_run(root, t.run, projected)
        if t.step is not None:
            steps[t.step.step_execution_id] = _apply_step(steps[t.step.step_execution_id], t.step)
        if t.attempt is not None:
            attempts[t.attempt.attempt_id] = _apply_attempt(
                attempts[t.attempt.attempt_id], t.attempt
            )
        if t.new_attempt is not None:
            a = t.new_attempt
            if a.attempt_id in attempts:
                raise Mismatch("attempt exists")
            attempts[a.attempt_id] = AttemptRecord(
                org_id=ORG,
                attempt_id=a.attempt_id,
                step_execution_id=a.step_execution_id,
                attempt_number=a.attempt_number,
                lease_token_digest=a.lease_token_digest,
                ownership_epoch=a.ownership_epoch,
                root_state_version_at_claim=a.root_state_version_at_claim,
                started_at=a.started_at,
                finished_at=None,
                outcome=AttemptOutcome.STARTED,
                failure_class=None,
                safe_error_code=None,
                retry_decision=None,
                retry_policy_digest=a.retry_policy_digest,
                recovery_backoff_floor_ms=a.recovery_backoff_floor_ms,
                attempt_state_version=0,
                plan_digest=a.plan_digest,
                lock_plan_digest=a.lock_plan_digest,
                trace_id=a.trace_id,
            )
        if t.new_step is not None:
            n = t.new_step
            steps[n.step_execution_id] = step(
                step_execution_id=n.step_execution_id,
                plan_step_key=n.plan_step_key,
                input_checkpoint_id=n.input_checkpoint_id,
                run_after=n.run_after,
                created_at=self.now,
            )
        self.root, self.steps, self.attempts = root, steps, attempts


class Mismatch(Exception):
    """The in-memory equivalent of a zero row count."""


def _apply_run(r: RunRecord, p: RunPatch, projected: StepState | None) -> RunRecord:
    if (
        r.state_version != p.expected_version
        or r.state is not p.from_state
        or r.ownership_epoch != p.expect_epoch
        or (p.require_live and (r.is_deleted or r.delete_requested_at is not None))
        or (
            p.expect_current_step is not None
            and r.current_step_execution_id != p.expect_current_step
        )
    ):
        raise Mismatch("run")
    changes = patch_changes(p)
    return dataclasses.replace(
        r,
        **changes,
        state=p.to_state,
        state_version=r.state_version + 1,
        interview_status=compatibility_status(p.to_state, projected).code,
    )


def _apply_step(s: StepRecord, p: StepPatch) -> StepRecord:
    if (
        s.state_version != p.expected_version
        or s.state is not p.from_state
        or s.ownership_epoch != p.expect_epoch
        or s.lease_token_digest != p.expect_lease_token_digest
        or (
            p.expect_input_checkpoint_id is not None
            and s.input_checkpoint_id != p.expect_input_checkpoint_id
        )
    ):
        raise Mismatch("step")
    return dataclasses.replace(
        s, **patch_changes(p), state=p.to_state, state_version=s.state_version + 1
    )


def _apply_attempt(a: AttemptRecord, p: AttemptPatch) -> AttemptRecord:
    if (
        a.attempt_state_version != p.expected_version
        or a.outcome is not p.from_state
        or a.lease_token_digest != p.expect_lease_token_digest
        or a.ownership_epoch != p.expect_epoch
        or (
            p.expect_root_state_version_at_claim is not None
            and a.root_state_version_at_claim != p.expect_root_state_version_at_claim
        )
    ):
        raise Mismatch("attempt")
    changes = patch_changes(p)
    return dataclasses.replace(
        a, **changes, outcome=p.to_state, attempt_state_version=a.attempt_state_version + 1
    )


def fence_for(m: Model, attempt: AttemptRecord) -> LeaseFence:
    """The fence a worker holding ``attempt`` would carry (current versions)."""
    s = m.steps[attempt.step_execution_id]
    return LeaseFence(
        org_id=ORG,
        flow_run_id=m.root.flow_run_id,
        step_execution_id=s.step_execution_id,
        attempt_id=attempt.attempt_id,
        attempt_number=attempt.attempt_number,
        lease_owner="w",
        lease_token=m.tokens[attempt.attempt_id],
        ownership_epoch=attempt.ownership_epoch,
        root_state_version=attempt.root_state_version_at_claim,
        step_state_version=s.state_version,
        attempt_state_version=attempt.attempt_state_version,
        input_checkpoint_id=s.input_checkpoint_id,
        lease_until=s.lease_until or T0,
    )


def token(n: int) -> tuple[str, str]:
    raw = f"token-{n}"
    return raw, lease_token_digest(raw)


def later(m: Model, **delta: float) -> None:
    m.now = m.now + timedelta(**delta)
