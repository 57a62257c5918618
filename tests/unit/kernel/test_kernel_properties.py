"""Property tests over random operation sequences (hypothesis): workers with live and
stale fences, lease expiry, rollbacks, ambiguity, cancellation, deletion and waits are
driven through the pure decisions and an in-memory compare-and-swap applier.

Invariants checked after every step:

* no terminal attempt outcome ever changes (§10.3, §11.3);
* the run never leaves a terminal state, and a terminal step never changes state;
* the root and its current step never diverge (§18.2), and the stored projection is the
  projection of the canonical state;
* at most one ``Started`` attempt per step, and only while the step holds a lease;
* every scheduled retry is due no earlier than ``now + RecoveryBackoffFloor`` and no
  later than ``now + max_delay_ms``;
* a decision made on the current snapshot always applies (revalidation and the CAS
  predicates agree), and a stale fence never writes.
"""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_svc.kernel.decisions import (
    Claimed,
    ClaimRequest,
    EnterWait,
    FailRun,
    FenceLost,
    FinishRun,
    NextStep,
    Recovered,
    RetryExhausted,
    RetryScheduled,
    StepFailure,
)
from runtime_svc.kernel.model import LeaseFence, Transition
from runtime_svc.kernel.states import (
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
    AttemptOutcome,
    FailureClass,
    RunState,
    StepState,
)
from runtime_svc.kernel.tables import compatibility_status, root_step_consistent
from runtime_svc.kernel.transitions import (
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
from tests.unit.kernel.factories import POLICY, Model, fence_for, run, step, token

#: Operations, weighted by repetition so that runs progress as well as get cancelled.
OPS = (
    *("claim", "start", "commit") * 3,
    *("rollback", "tick") * 2,
    "heartbeat",
    "recover",
    "unknown",
    "cancel",
    "delete",
    "cleanup",
    "resolve",
    "expire",
)


class Sim:
    def __init__(self) -> None:
        self.m = Model(root=run(), steps={"step_1": step()})
        self.fences: list[LeaseFence] = []
        self.n = 0
        self.steps_made = 1

    def apply(self, t: Transition) -> None:
        # A decision made on the current snapshot must always pass the CAS predicates.
        self.m.apply(t)

    def fence(self, pick: int) -> LeaseFence | None:
        if not self.fences:
            return None
        # Mostly the newest fence (the live worker), sometimes any older one (a stale worker).
        return self.fences[-1] if pick % 4 else self.fences[pick % len(self.fences)]

    def parts(self, f: LeaseFence) -> tuple[object, object, object] | None:
        a = self.m.attempts.get(f.attempt_id)
        s = self.m.steps.get(f.step_execution_id)
        return None if a is None or s is None else (self.m.root, s, a)

    def run_op(self, op: str, pick: int) -> None:
        m, now = self.m, self.m.now
        current = m.current
        if op == "tick":
            m.now = now + timedelta(milliseconds=(pick + 1) * 3_000)
        elif op == "claim" and current is not None:
            self.n += 1
            raw, digest = token(self.n)
            attempt_id = f"att_{self.n}"
            m.tokens[attempt_id] = raw
            req = ClaimRequest(attempt_id, "w", digest, 1, "p", "l")
            decision = decide_claim(m.root, current, now, POLICY, req)
            if isinstance(decision, Claimed):
                self.apply(decision.transition)
                self.fences.append(fence_for(m, m.attempts[attempt_id]))
            elif isinstance(decision, RetryExhausted):
                self.apply(decision.transition)
        elif op in ("start", "heartbeat", "commit", "rollback", "unknown"):
            f = self.fence(pick)
            found = None if f is None else self.parts(f)
            if f is None or found is None:
                return
            root, s, a = found
            if op == "start":
                d = decide_start_running(root, s, a, f, now)  # type: ignore[arg-type]
                if not isinstance(d, FenceLost):
                    self.apply(d.transition)
                    self.fences.append(fence_for(m, m.attempts[f.attempt_id]))
            elif op == "heartbeat":
                decide_heartbeat(root, s, a, f, now, POLICY)  # type: ignore[arg-type]
            elif op == "commit":
                self.steps_made += 1
                advance = [
                    NextStep(f"step_{self.steps_made}", f"s{self.steps_made}", "PureCompute", "q"),
                    FinishRun(),
                    FailRun("fault"),
                    EnterWait(),
                ][pick % 4]
                d = decide_commit(root, s, a, f, now, advance, f"ckpt_{self.steps_made}")  # type: ignore[arg-type]
                if not isinstance(d, FenceLost):
                    self.apply(d.transition)
            elif op == "rollback":
                cls = FailureClass.RETRYABLE if pick % 3 else FailureClass.TERMINAL
                d = decide_rollback_retry(root, s, a, f, now, POLICY, StepFailure(cls, "e"))  # type: ignore[arg-type]
                if isinstance(d, RetryScheduled):
                    floor = a.recovery_backoff_floor_ms  # type: ignore[attr-defined]
                    assert now + timedelta(milliseconds=floor) <= d.run_after
                    assert d.run_after <= now + timedelta(milliseconds=POLICY.max_delay_ms)
                if hasattr(d, "transition"):
                    self.apply(d.transition)  # type: ignore[union-attr]
            else:
                d = decide_commit_unknown(root, s, a, f, now)  # type: ignore[arg-type]
                if hasattr(d, "transition"):
                    self.apply(d.transition)  # type: ignore[union-attr]
        elif op == "recover" and current is not None:
            expiries = sum(
                1
                for a in m.attempts.values()
                if a.step_execution_id == current.step_execution_id
                and a.outcome is AttemptOutcome.FENCED
            )
            d = decide_recovery(m.root, current, m.latest_attempt(current), now, POLICY, expiries)
            if isinstance(d, Recovered):
                a = m.latest_attempt(current)
                assert a is not None
                assert d.run_after == now + timedelta(milliseconds=a.recovery_backoff_floor_ms)
            if hasattr(d, "transition"):
                self.apply(d.transition)  # type: ignore[union-attr]
        elif op in ("cancel", "delete"):
            attempt = None if current is None else m.latest_attempt(current)
            d = decide_cancel(m.root, current, attempt, now, delete=op == "delete")
            if hasattr(d, "transition"):
                self.apply(d.transition)  # type: ignore[union-attr]
        elif op == "cleanup":
            attempt = None if current is None else m.latest_attempt(current)
            d = decide_cancel_cleanup(m.root, current, attempt, now)
            if hasattr(d, "transition"):
                self.apply(d.transition)  # type: ignore[union-attr]
        elif op in ("resolve", "expire") and current is not None:
            d = (
                decide_resolve_wait(m.root, current, now)
                if op == "resolve"
                else decide_wait_expired(m.root, current, now, quarantine=bool(pick % 2))
            )
            if hasattr(d, "transition"):
                self.apply(d.transition)  # type: ignore[union-attr]


def check_invariants(before: Model, after: Model) -> None:
    for attempt_id, a in before.attempts.items():
        if a.outcome is not AttemptOutcome.STARTED:
            assert after.attempts[attempt_id] == a, "terminal attempt changed"
    if before.root.state in TERMINAL_RUN_STATES:
        assert after.root.state is before.root.state
        assert after.root.state_version - before.root.state_version <= 1
        assert after.root.terminal_cause_code == before.root.terminal_cause_code
    for sid, s in before.steps.items():
        if s.state in TERMINAL_STEP_STATES:
            assert after.steps[sid] == s, "terminal step changed"
    current = after.current
    step_state = None if current is None else current.state
    assert root_step_consistent(after.root.state, step_state), (after.root.state, step_state)
    assert after.root.interview_status == compatibility_status(after.root.state).code
    for sid, s in after.steps.items():
        started = [
            a
            for a in after.attempts.values()
            if a.step_execution_id == sid and a.outcome is AttemptOutcome.STARTED
        ]
        assert len(started) <= 1
        if started:
            assert s.state in (StepState.CLAIMED, StepState.RUNNING)
            assert s.lease_token_digest == started[0].lease_token_digest
        assert s.attempt_count <= POLICY.max_attempts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 50)), max_size=60))
def test_random_operation_sequences_keep_every_invariant(ops: list[tuple[str, int]]) -> None:
    sim = Sim()
    for op, pick in ops:
        before = Model(
            root=sim.m.root,
            steps=dict(sim.m.steps),
            attempts=dict(sim.m.attempts),
            now=sim.m.now,
        )
        sim.run_op(op, pick)
        check_invariants(before, sim.m)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["claim", "start", "tick", "recover"]), max_size=80))
def test_repeated_lease_loss_always_terminates(ops: list[str]) -> None:
    """Lease churn cannot go on forever: every step ends after a bounded number of
    attempts (§12.3 "repeated lease expiry becomes a terminal policy signal")."""
    sim = Sim()
    for op in ops:
        sim.run_op(op, 0 if op != "tick" else 10)
        if sim.m.root.state is RunState.TERMINAL_FAILED:
            break
    attempts = len(sim.m.attempts)
    assert attempts <= min(POLICY.max_attempts, POLICY.max_lease_expiries + 1)
