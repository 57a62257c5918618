"""Pure transition decisions (§11, §12): each ``decide_*`` function's arrows, its
refusals, and the fence revalidation, driven through an in-memory model that applies
decisions with the store's compare-and-swap semantics."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from runtime_svc.kernel.decisions import (
    AlreadyCommitted,
    CancelCompleted,
    CancelRecorded,
    CancelWon,
    Claimed,
    ClaimRequest,
    Committed,
    EnterWait,
    FailRun,
    FenceLost,
    FinishRun,
    LeaseExtended,
    NextStep,
    NoChange,
    NotEligible,
    Quarantined,
    Recovered,
    RecoveryTerminal,
    RetryExhausted,
    RetryScheduled,
    Started,
    StepFailure,
    Tombstoned,
    WaitExpired,
    WaitResolved,
    validate_fence_input,
)
from runtime_svc.kernel.errors import TransitionInputError
from runtime_svc.kernel.model import AttemptRecord, LeaseFence, RunRecord, StepRecord
from runtime_svc.kernel.states import (
    AttemptOutcome,
    ExecutionOwner,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)
from runtime_svc.kernel.transitions import (
    CAUSE_RETRY_EXHAUSTED,
    decide_cancel,
    decide_cancel_cleanup,
    decide_claim,
    decide_commit,
    decide_commit_unknown,
    decide_heartbeat,
    decide_recovery,
    decide_resolve_wait,
    decide_rollback_retry,
    decide_start_running,
    decide_wait_expired,
)
from tests.unit.kernel.factories import (
    ORG,
    POLICY,
    T0,
    Mismatch,
    Model,
    fence_for,
    later,
    run,
    step,
    token,
)


def new_model(**root: object) -> Model:
    return Model(root=run(**root), steps={"step_1": step()})


def request(m: Model, n: int = 1, **overrides: object) -> ClaimRequest:
    raw, digest = token(n)
    values: dict[str, object] = {
        "attempt_id": f"att_{n}",
        "lease_owner": f"w{n}",
        "lease_token_digest": digest,
        "ownership_epoch": 1,
        "plan_digest": "plan/v1:sha256:" + "0" * 64,
        "lock_plan_digest": "lock-plan/v1:sha256:" + "0" * 64,
    }
    values.update(overrides)
    m.tokens[f"att_{n}"] = raw
    return ClaimRequest(**values)


def do_claim(m: Model, n: int = 1) -> Claimed:
    current = m.current
    assert current is not None
    decision = decide_claim(m.root, current, m.now, POLICY, request(m, n))
    assert isinstance(decision, Claimed), decision
    m.apply(decision.transition)
    return decision


def do_start(m: Model, n: int = 1) -> None:
    do_claim(m, n)
    s = m.current
    assert s is not None
    a = m.attempts[f"att_{n}"]
    decision = decide_start_running(m.root, s, a, fence_for(m, a), m.now)
    assert isinstance(decision, Started), decision
    m.apply(decision.transition)


def parts(m: Model, n: int = 1) -> tuple[RunRecord, StepRecord, AttemptRecord, LeaseFence]:
    a = m.attempts[f"att_{n}"]
    s = m.steps[a.step_execution_id]
    return m.root, s, a, fence_for(m, a)


# --- claim -------------------------------------------------------------------------------


def test_claim_moves_root_step_and_inserts_a_started_attempt() -> None:
    m = new_model()
    claimed = do_claim(m)

    assert (m.root.state, m.root.state_version, m.root.started_at) == (RunState.RUNNING, 1, T0)
    s = m.steps["step_1"]
    assert (s.state, s.attempt_count, s.lease_owner) == (StepState.CLAIMED, 1, "w1")
    assert s.lease_until == T0 + timedelta(milliseconds=POLICY.lease_duration_ms)
    a = m.attempts["att_1"]
    assert a.outcome is AttemptOutcome.STARTED and a.root_state_version_at_claim == 1
    assert a.retry_policy_digest == POLICY.digest()
    assert a.recovery_backoff_floor_ms == claimed.recovery_backoff_floor_ms
    assert POLICY.floor_ms(1) <= a.recovery_backoff_floor_ms <= POLICY.exponential_ms(1)


@pytest.mark.parametrize(
    ("root", "step_overrides", "req", "reason"),
    [
        ({"execution_owner": ExecutionOwner.LEGACY_INTERPRETER}, {}, {}, "not_v2_owned"),
        ({"ownership_epoch": 2}, {}, {}, "epoch_mismatch"),
        ({"is_deleted": True}, {}, {}, "deleted"),
        ({"delete_requested_at": T0}, {}, {}, "deleted"),
        ({"state": RunState.WAITING}, {}, {}, "root_not_runnable"),
        ({"state": RunState.CANCEL_REQUESTED}, {}, {}, "root_not_runnable"),
        ({"current_step_execution_id": "step_2"}, {}, {}, "not_current_step"),
        ({}, {}, {"expected_root_version": 7}, "superseded"),
        ({}, {}, {"expected_step_version": 7}, "superseded"),
        ({}, {"state": StepState.WAITING}, {}, "step_not_claimable"),
        ({}, {"run_after": T0 + timedelta(seconds=1)}, {}, "not_due"),
        (
            {},
            {"state": StepState.RETRY_SCHEDULED, "run_after": T0 + timedelta(seconds=1)},
            {},
            "not_due",
        ),
    ],
)
def test_claim_refusals(
    root: dict[str, object], step_overrides: dict[str, object], req: dict[str, object], reason: str
) -> None:
    m = Model(root=run(**root), steps={"step_1": step(**step_overrides)})
    decision = decide_claim(m.root, m.steps["step_1"], T0, POLICY, request(m, **req))
    assert decision == NotEligible(reason)


def test_due_retry_scheduled_step_is_claimable() -> None:
    m = Model(root=run(), steps={"step_1": step(state=StepState.RETRY_SCHEDULED, run_after=T0)})
    assert isinstance(decide_claim(m.root, m.steps["step_1"], T0, POLICY, request(m)), Claimed)


def test_a_pending_step_is_claimed_whatever_its_attempt_count() -> None:
    """Issue 10, item 4: a step resumed after its wait (``Waiting -> Pending``) is no
    retry — entering the wait on the last attempt must not strand or fail the run."""
    m = Model(
        root=run(),
        steps={
            "step_1": step(state=StepState.PENDING, run_after=T0, attempt_count=POLICY.max_attempts)
        },
    )
    decision = decide_claim(m.root, m.steps["step_1"], T0, POLICY, request(m))
    assert isinstance(decision, Claimed)
    assert decision.transition.new_attempt is not None
    assert decision.transition.new_attempt.attempt_number == POLICY.max_attempts + 1


@pytest.mark.parametrize("state", [StepState.RETRY_SCHEDULED])
def test_a_due_step_with_a_spent_attempt_budget_ends_its_run(state: StepState) -> None:
    """Issue 10, item 4: a policy lowered after the retry was scheduled must not leave
    the run Runnable and unclaimable for ever; the claim ends step and run terminally."""
    m = Model(
        root=run(),
        steps={"step_1": step(state=state, run_after=T0, attempt_count=POLICY.max_attempts)},
    )
    decision = decide_claim(m.root, m.steps["step_1"], T0, POLICY, request(m))
    assert isinstance(decision, RetryExhausted) and decision.cause_code == CAUSE_RETRY_EXHAUSTED
    assert decision.transition.new_attempt is None
    m.apply(decision.transition)
    assert (m.root.state, m.steps["step_1"].state) == (
        RunState.TERMINAL_FAILED,
        StepState.FAILED,
    )
    assert m.root.terminal_cause_code == CAUSE_RETRY_EXHAUSTED and m.root.completed_at == T0
    # Not yet due: nothing happens before its time.
    early = Model(
        root=run(),
        steps={"step_1": step(state=state, run_after=T0 + timedelta(seconds=1), attempt_count=9)},
    )
    assert decide_claim(
        early.root, early.steps["step_1"], T0, POLICY, request(early)
    ) == NotEligible("not_due")


# --- start, heartbeat -------------------------------------------------------------------


def test_start_running_heartbeat_and_expired_lease() -> None:
    m = new_model()
    do_start(m)
    root, s, a, f = parts(m)
    assert m.steps["step_1"].state is StepState.RUNNING
    hb = decide_heartbeat(root, s, a, f, T0 + timedelta(seconds=5), POLICY)
    assert hb == LeaseExtended(T0 + timedelta(seconds=5, milliseconds=POLICY.lease_duration_ms))
    late = T0 + timedelta(milliseconds=POLICY.lease_duration_ms)
    assert isinstance(decide_heartbeat(root, s, a, f, late, POLICY), FenceLost)

    m2 = new_model()
    do_claim(m2)
    root, s, a, f = parts(m2)
    lost = decide_start_running(root, s, a, f, late)
    assert isinstance(lost, FenceLost) and lost.reason == "lease_expired"


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda m: m.root.__class__, None),
        (lambda m: setattr(m, "root", dataclasses.replace(m.root, ownership_epoch=9)), "epoch"),
        (lambda m: setattr(m, "root", dataclasses.replace(m.root, is_deleted=True)), "deleted"),
        (
            lambda m: setattr(m, "root", dataclasses.replace(m.root, state_version=9)),
            "root_version",
        ),
        (
            lambda m: setattr(
                m, "root", dataclasses.replace(m.root, current_step_execution_id="x")
            ),
            "current_step",
        ),
        (
            lambda m: setattr(
                m,
                "root",
                dataclasses.replace(m.root, execution_owner=ExecutionOwner.LEGACY_INTERPRETER),
            ),
            "owner",
        ),
        (
            lambda m: setattr(
                m, "root", dataclasses.replace(m.root, state=RunState.CANCEL_REQUESTED)
            ),
            "cancel_requested",
        ),
        (
            lambda m: m.steps.update(
                step_1=dataclasses.replace(m.steps["step_1"], state_version=9)
            ),
            "step_version",
        ),
        (
            lambda m: m.steps.update(
                step_1=dataclasses.replace(m.steps["step_1"], lease_token_digest="other")
            ),
            "lease_token",
        ),
        (
            lambda m: m.attempts.update(
                att_1=dataclasses.replace(m.attempts["att_1"], outcome=AttemptOutcome.FENCED)
            ),
            "attempt_terminal",
        ),
        (
            lambda m: m.attempts.update(
                att_1=dataclasses.replace(m.attempts["att_1"], root_state_version_at_claim=0)
            ),
            "root_version_at_claim",
        ),
    ],
)
def test_commit_revalidates_every_fence_component(tamper: object, reason: str | None) -> None:
    m = new_model()
    do_start(m)
    fence = fence_for(m, m.attempts["att_1"])
    tamper(m)
    a = m.attempts["att_1"]
    decision = decide_commit(m.root, m.steps["step_1"], a, fence, T0, FinishRun(), "ckpt_2")
    if reason is None:
        assert isinstance(decision, Committed)
    else:
        assert isinstance(decision, FenceLost) and decision.reason == reason


def test_a_lost_fence_names_the_first_mismatched_row_with_its_versions() -> None:
    """The first failing check wins, root before step before attempt, and its FenceLost
    carries that row's table, key and expected/found versions."""
    m = new_model()
    do_start(m)
    fence = fence_for(m, m.attempts["att_1"])
    step, attempt = m.steps["step_1"], m.attempts["att_1"]

    def commit(root: RunRecord, s: StepRecord, a: AttemptRecord) -> object:
        return decide_commit(root, s, a, fence, T0, FinishRun(), "ckpt_2")

    moved_step = dataclasses.replace(step, state_version=step.state_version + 5)
    moved_attempt = dataclasses.replace(attempt, attempt_state_version=7)
    moved_root = dataclasses.replace(m.root, state_version=m.root.state_version + 3)
    assert commit(moved_root, moved_step, moved_attempt) == FenceLost(
        "flow_runs",
        m.root.flow_run_id,
        "root_version",
        fence.root_state_version,
        m.root.state_version + 3,
    )
    assert commit(m.root, moved_step, moved_attempt) == FenceLost(
        "flow_step_executions",
        step.step_execution_id,
        "step_version",
        fence.step_state_version,
        step.state_version + 5,
    )
    assert commit(m.root, step, moved_attempt) == FenceLost(
        "flow_step_attempts", attempt.attempt_id, "version", fence.attempt_state_version, 7
    )


# --- commit ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("advance", "run_state", "step_state", "status"),
    [
        (
            NextStep("step_2", "s2", "BoundedMutation", "durable_mutation"),
            RunState.RUNNABLE,
            StepState.SUCCEEDED,
            "Running",
        ),
        (FinishRun(), RunState.SUCCEEDED, StepState.SUCCEEDED, "Finished"),
        (FailRun("explicit_fault"), RunState.TERMINAL_FAILED, StepState.SUCCEEDED, "Error"),
        (EnterWait(), RunState.WAITING, StepState.WAITING, "Paused"),
    ],
)
def test_commit_advances_the_root(
    advance: object, run_state: RunState, step_state: StepState, status: str
) -> None:
    m = new_model()
    do_start(m)
    decision = decide_commit(*parts(m), T0, advance, "ckpt_2")
    assert isinstance(decision, Committed)
    m.apply(decision.transition)
    assert (m.root.state, m.steps["step_1"].state, m.root.interview_status) == (
        run_state,
        step_state,
        status,
    )
    assert m.attempts["att_1"].outcome is AttemptOutcome.COMMITTED
    assert m.root.current_checkpoint_id == "ckpt_2"
    assert m.steps["step_1"].output_checkpoint_id == "ckpt_2"
    if isinstance(advance, NextStep):
        assert m.root.current_step_execution_id == "step_2"
        assert m.steps["step_2"].input_checkpoint_id == "ckpt_2"


# --- rollback ----------------------------------------------------------------------------


def test_rollback_schedules_retry_no_earlier_than_the_floor() -> None:
    m = new_model()
    do_start(m)
    floor = m.attempts["att_1"].recovery_backoff_floor_ms
    now = T0 + timedelta(seconds=3)
    decision = decide_rollback_retry(
        *parts(m),
        now,
        POLICY,
        StepFailure(FailureClass.RETRYABLE, "deadlock"),
    )
    assert isinstance(decision, RetryScheduled)
    assert decision.run_after == now + timedelta(milliseconds=floor)
    m.apply(decision.transition)
    assert (m.root.state, m.root.run_after) == (RunState.RUNNABLE, decision.run_after)
    assert m.root.current_step_execution_id == "step_1"
    s = m.steps["step_1"]
    assert (s.state, s.run_after, s.lease_token_digest) == (
        StepState.RETRY_SCHEDULED,
        decision.run_after,
        None,
    )
    a = m.attempts["att_1"]
    assert (a.outcome, a.retry_decision) == (AttemptOutcome.ROLLED_BACK, RetryDecision.SCHEDULED)


def test_a_longer_classified_delay_is_honoured_but_capped() -> None:
    m = new_model()
    do_start(m)
    decision = decide_rollback_retry(
        *parts(m),
        T0,
        POLICY,
        StepFailure(FailureClass.RETRYABLE, "throttled", min_delay_ms=10 * POLICY.max_delay_ms),
    )
    assert isinstance(decision, RetryScheduled) and decision.delay_ms == POLICY.max_delay_ms


def test_rollback_terminal_class_and_pre_transaction_failure() -> None:
    m = new_model()
    do_start(m)
    decision = decide_rollback_retry(
        *parts(m),
        T0,
        POLICY,
        StepFailure(FailureClass.TERMINAL, "bad", outcome=AttemptOutcome.PRE_TRANSACTION_FAILED),
    )
    # A terminal failure names its own safe code as the run's cause.
    assert isinstance(decision, RetryExhausted) and decision.cause_code == "bad"
    m.apply(decision.transition)
    assert (m.root.state, m.steps["step_1"].state) == (RunState.TERMINAL_FAILED, StepState.FAILED)
    assert m.attempts["att_1"].outcome is AttemptOutcome.PRE_TRANSACTION_FAILED


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"failure_class": FailureClass.AMBIGUOUS}, "failure_class"),
        ({"failure_class": FailureClass.RETRYABLE, "outcome": AttemptOutcome.FENCED}, "outcome"),
        ({"failure_class": FailureClass.RETRYABLE, "min_delay_ms": -1}, "min_delay_ms"),
    ],
)
def test_step_failure_input_is_typed(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(TransitionInputError) as err:
        StepFailure(safe_error_code="x", **kwargs)
    assert err.value.field_path == field


def test_retry_elapsed_budget() -> None:
    policy = dataclasses.replace(POLICY, max_retry_elapsed_ms=1_500)
    m = new_model()
    do_start(m)
    decision = decide_rollback_retry(
        *parts(m),
        T0 + timedelta(seconds=1),
        policy,
        StepFailure(FailureClass.RETRYABLE, "slow"),
    )
    assert isinstance(decision, RetryExhausted)


# --- recovery ----------------------------------------------------------------------------


def test_recovery_fences_the_expired_attempt_with_its_floor() -> None:
    m = new_model()
    do_start(m)
    s, a = m.steps["step_1"], m.attempts["att_1"]
    assert decide_recovery(m.root, s, a, T0, POLICY, 0) == NoChange("lease_live")
    now = T0 + timedelta(milliseconds=POLICY.lease_duration_ms + 1)
    decision = decide_recovery(m.root, s, a, now, POLICY, 0)
    assert isinstance(decision, Recovered)
    assert decision.run_after == now + timedelta(milliseconds=a.recovery_backoff_floor_ms)
    m.apply(decision.transition)
    assert m.attempts["att_1"].outcome is AttemptOutcome.FENCED
    assert (m.root.state, m.steps["step_1"].state) == (RunState.RUNNABLE, StepState.RETRY_SCHEDULED)


@pytest.mark.parametrize("stage", ["claimed", "running"])
def test_lease_expiry_limit_is_terminal(stage: str) -> None:
    m = new_model()
    (do_claim if stage == "claimed" else do_start)(m)
    now = T0 + timedelta(milliseconds=POLICY.lease_duration_ms + 1)
    decision = decide_recovery(
        m.root, m.steps["step_1"], m.attempts["att_1"], now, POLICY, POLICY.max_lease_expiries
    )
    assert isinstance(decision, RecoveryTerminal) and decision.cause_code == "lease_expiry_limit"
    m.apply(decision.transition)
    assert (m.root.state, m.steps["step_1"].state) == (RunState.TERMINAL_FAILED, StepState.FAILED)


def test_recovery_leaves_committed_and_cancelled_work_alone() -> None:
    m = new_model()
    do_start(m)
    now = T0 + timedelta(days=1)
    committed = decide_commit(*parts(m), T0, FinishRun(), "ckpt_2")
    assert isinstance(committed, Committed)
    m.apply(committed.transition)
    assert decide_recovery(m.root, m.steps["step_1"], m.attempts["att_1"], now, POLICY, 0) == (
        NoChange("not_recoverable")
    )

    c = new_model()
    do_start(c)
    cancel = decide_cancel(c.root, c.steps["step_1"], c.attempts["att_1"], T0, delete=True)
    assert isinstance(cancel, CancelRecorded)
    c.apply(cancel.transition)
    assert decide_recovery(c.root, c.steps["step_1"], c.attempts["att_1"], now, POLICY, 0) == (
        NoChange("not_recoverable")
    )


# --- ambiguity ---------------------------------------------------------------------------


def test_commit_unknown_quarantines_or_reads_the_marker() -> None:
    m = new_model()
    do_start(m)
    decision = decide_commit_unknown(*parts(m), T0)
    assert isinstance(decision, Quarantined)
    m.apply(decision.transition)
    assert (m.root.state, m.steps["step_1"].state) == (RunState.QUARANTINED, StepState.QUARANTINED)
    a = m.attempts["att_1"]
    assert (a.outcome, a.retry_decision) == (
        AttemptOutcome.COMMIT_UNKNOWN,
        RetryDecision.QUARANTINED,
    )

    done = new_model()
    do_start(done)
    fence = fence_for(done, done.attempts["att_1"])
    done.apply(decide_commit(*parts(done), T0, FinishRun(), "c").transition)
    assert (
        decide_commit_unknown(done.root, done.steps["step_1"], done.attempts["att_1"], fence, T0)
        == AlreadyCommitted()
    )
    with pytest.raises(TransitionInputError):
        decide_commit_unknown(*parts(m), T0, AttemptOutcome.ROLLED_BACK)


# --- cancellation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "step_after", "attempt_after"),
    [
        ("pending", StepState.CANCELLED, None),
        ("claimed", StepState.CANCEL_REQUESTED, AttemptOutcome.CANCELLED),
        ("running", StepState.CANCEL_REQUESTED, AttemptOutcome.CANCELLED),
        ("waiting", StepState.CANCEL_REQUESTED, AttemptOutcome.COMMITTED),
    ],
)
def test_cancel_per_step_state(
    stage: str, step_after: StepState, attempt_after: AttemptOutcome | None
) -> None:
    m = new_model()
    if stage != "pending":
        (do_claim if stage == "claimed" else do_start)(m)
    if stage == "waiting":
        m.apply(decide_commit(*parts(m), T0, EnterWait(), "c2").transition)
    attempt = m.attempts.get("att_1")
    decision = decide_cancel(m.root, m.steps["step_1"], attempt, T0, delete=True)
    assert isinstance(decision, CancelRecorded)
    m.apply(decision.transition)
    assert (m.root.state, m.root.is_deleted, m.root.delete_requested_at) == (
        RunState.CANCEL_REQUESTED,
        True,
        T0,
    )
    assert m.steps["step_1"].state is step_after
    if attempt_after is not None:
        assert m.attempts["att_1"].outcome is attempt_after
    cleanup = decide_cancel_cleanup(m.root, m.steps["step_1"], m.attempts.get("att_1"), T0)
    assert isinstance(cleanup, CancelCompleted)
    m.apply(cleanup.transition)
    assert (m.root.state, m.steps["step_1"].state) == (RunState.CANCELLED, StepState.CANCELLED)
    assert decide_cancel_cleanup(m.root, m.steps["step_1"], None, T0) == NoChange(
        "already_cancelled"
    )
    assert decide_cancel(m.root, m.steps["step_1"], None, T0, delete=True) == NoChange(
        "already_cancelled"
    )


def test_cancel_of_terminal_runs_only_tombstones() -> None:
    m = new_model(state=RunState.SUCCEEDED)
    assert decide_cancel(m.root, None, None, T0, delete=False) == NoChange("terminal")
    decision = decide_cancel(m.root, None, None, T0, delete=True)
    assert isinstance(decision, Tombstoned)
    m.apply(decision.transition)
    assert (m.root.state, m.root.is_deleted) == (RunState.SUCCEEDED, True)
    assert decide_cancel(m.root, None, None, T0, delete=True) == NoChange("terminal")
    assert decide_cancel_cleanup(m.root, None, None, T0) == NoChange("not_cancel_requested")


def test_stale_worker_after_cancel_gets_cancel_won_or_fence_lost() -> None:
    m = new_model()
    do_start(m)
    fence = fence_for(m, m.attempts["att_1"])
    m.apply(
        decide_cancel(
            m.root,
            m.steps["step_1"],
            m.attempts["att_1"],
            T0,
            delete=False,
        ).transition
    )
    a = m.attempts["att_1"]
    assert (
        decide_rollback_retry(
            m.root,
            m.steps["step_1"],
            a,
            fence,
            T0,
            POLICY,
            StepFailure(FailureClass.RETRYABLE, "x"),
        )
        == CancelWon()
    )
    assert decide_commit_unknown(m.root, m.steps["step_1"], a, fence, T0) == CancelWon()
    lost = decide_commit(m.root, m.steps["step_1"], a, fence, T0, FinishRun(), "c")
    assert isinstance(lost, FenceLost) and lost.reason == "cancel_requested"


# --- waits -------------------------------------------------------------------------------


def test_wait_resolution_and_expiry() -> None:
    for quarantine in (None, False, True):
        m = new_model()
        do_start(m)
        m.apply(decide_commit(*parts(m), T0, EnterWait(), "c").transition)
        s = m.steps["step_1"]
        if quarantine is None:
            decision = decide_resolve_wait(m.root, s, T0)
            assert isinstance(decision, WaitResolved)
            m.apply(decision.transition)
            assert (m.root.state, s.state, m.root.interview_status) == (
                RunState.RUNNABLE,
                StepState.WAITING,
                "Running",
            )
            assert m.steps["step_1"].state is StepState.PENDING
        else:
            expired = decide_wait_expired(m.root, s, T0, quarantine=quarantine)
            assert isinstance(expired, WaitExpired)
            m.apply(expired.transition)
            expected = RunState.QUARANTINED if quarantine else RunState.TERMINAL_FAILED
            assert m.root.state is expected
    assert decide_resolve_wait(run(), step(), T0) == NoChange("root_not_waiting")


# --- typed input -------------------------------------------------------------------------


def test_fence_input_validation_happens_before_sql() -> None:
    m = new_model()
    do_claim(m)
    fence = fence_for(m, m.attempts["att_1"])
    validate_fence_input(ORG, fence)
    for bad, field in (
        (dataclasses.replace(fence, org_id="other"), "org_id"),
        (dataclasses.replace(fence, ownership_epoch=0), "epoch"),
        (dataclasses.replace(fence, lease_token=""), "lease_token"),
        (dataclasses.replace(fence, attempt_state_version=-1), "state_version"),
    ):
        with pytest.raises(TransitionInputError) as err:
            validate_fence_input(ORG, bad)
        assert err.value.field_path == field


def test_applying_a_stale_decision_is_a_mismatch() -> None:
    m = new_model()
    first = decide_claim(m.root, m.steps["step_1"], T0, POLICY, request(m, 1))
    second = decide_claim(m.root, m.steps["step_1"], T0, POLICY, request(m, 2))
    assert isinstance(first, Claimed) and isinstance(second, Claimed)
    m.apply(first.transition)
    with pytest.raises(Mismatch):
        m.apply(second.transition)
    later(m, seconds=1)
