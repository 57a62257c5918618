"""The pure decisions behind every legacy mutator (§20.3 7-8): the locked-row recheck of
trusted org, owner, epoch, state version, status and deletion, and the legacy-owned field
set a legacy transition may write."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runtime_svc.kernel.states import CompatibilityStatus, RunState
from runtime_svc.legacy.interpreter import Failed, Finished, Paused, Segment
from runtime_svc.legacy.model import (
    LEGACY_MUTABLE_FIELDS,
    LegacyClaim,
    LegacyInterview,
    Rejected,
    Rejection,
    decide_cancel,
    decide_claim,
    decide_commit,
    decide_delete,
    decide_stale_recovery,
    legacy_runtime_state,
    recheck,
)
from runtime_svc.legacy.state import LegacyState, WaitKind, WaitSpec
from runtime_svc.legacy.store import _check_values
from services.auth import TrustedRuntimeWorkScope

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SCOPE = TrustedRuntimeWorkScope("org-1", "inst", "cap", "binding/v1:sha256:" + "0" * 64)
S = CompatibilityStatus


def row(**overrides: Any) -> LegacyInterview:
    base = LegacyInterview(
        scope=SCOPE,
        flow_run_id="run-1",
        flow_version_id="fv",
        execution_owner="LegacyInterpreter",
        ownership_epoch=0,
        state_version=4,
        status=S.PAUSED,
        runtime_state=RunState.WAITING.code,
        current_element="w",
        paused_at=NOW - timedelta(hours=1),
        run_after=NOW - timedelta(minutes=1),
        context=LegacyState.start("f", 1, "a", {}).dumps(),
        claimed_by=None,
        claim_until=None,
        terminal_cause_code=None,
        is_deleted=False,
        delete_requested_at=None,
        started_at=None,
        completed_at=None,
        idempotency_key=None,
        request_digest=None,
        created_at=NOW,
        updated_at=NOW,
    )
    return dataclasses.replace(base, **overrides)


@pytest.mark.parametrize(
    ("overrides", "expected", "org"),
    [
        ({}, None, "org-1"),
        ({}, Rejection.NOT_FOUND, "org-2"),  # another org answers like a missing row
        (
            {"execution_owner": "FlowRuntimeV2", "ownership_epoch": 1},
            Rejection.NOT_LEGACY_OWNED,
            "org-1",
        ),
        ({"ownership_epoch": 3}, Rejection.EPOCH_MISMATCH, "org-1"),
        ({"state_version": 5}, Rejection.VERSION_MISMATCH, "org-1"),
        ({"is_deleted": True}, Rejection.DELETED, "org-1"),
        ({"status": S.RUNNING}, Rejection.STATUS, "org-1"),
    ],
)
def test_the_locked_row_recheck(
    overrides: dict[str, Any], expected: Rejection | None, org: str
) -> None:
    outcome = recheck(
        row(**overrides), org_id=org, expected_version=4, statuses=frozenset({S.PAUSED})
    )
    assert outcome == (None if expected is None else Rejected(expected))
    assert recheck(None, org_id="org-1", expected_version=None) == Rejected(Rejection.NOT_FOUND)


def test_a_v2_row_projected_as_paused_is_never_claimable() -> None:
    v2 = row(execution_owner="FlowRuntimeV2", ownership_epoch=1, status=S.PAUSED)
    decision = decide_claim(
        v2,
        org_id="org-1",
        expected_version=4,
        token="t",
        now=NOW,
        lease=timedelta(minutes=1),
        require_due=True,
    )
    assert decision == Rejected(Rejection.NOT_LEGACY_OWNED)


def test_a_claim_needs_a_due_row_unless_it_is_a_direct_resume() -> None:
    later = row(run_after=NOW + timedelta(minutes=5))
    kwargs: dict[str, Any] = dict(
        org_id="org-1", expected_version=4, token="tok", now=NOW, lease=timedelta(minutes=1)
    )
    assert decide_claim(later, require_due=True, **kwargs) == Rejected(Rejection.NOT_DUE)
    values = decide_claim(later, require_due=False, **kwargs)
    assert isinstance(values, dict)
    assert values["interview_status"] == "Running" and values["legacy_claimed_by"] == "tok"
    assert values["legacy_claim_until"] == NOW + timedelta(minutes=1)
    assert values["started_at"] == NOW
    assert set(values) <= LEGACY_MUTABLE_FIELDS


def _segment(status: Any) -> Segment:
    return Segment(status, LegacyState.start("f", 1, "a", {}), (), (), ())


def test_a_commit_needs_the_claim_that_ran_the_segment() -> None:
    running = row(status=S.RUNNING, state_version=5, claimed_by="tok")
    claim = LegacyClaim(SCOPE, "run-1", "fv", 5, "tok", "{}")
    wait = WaitSpec(
        "w",
        WaitKind.TIME,
        NOW + timedelta(hours=2),
        "terminal_failure",
        resume_at=NOW + timedelta(hours=1),
    )

    paused = decide_commit(running, claim, _segment(Paused(wait)), NOW)
    assert isinstance(paused, dict)
    assert (paused["interview_status"], paused["run_after"], paused["legacy_claimed_by"]) == (
        "Paused",
        NOW + timedelta(hours=1),
        None,
    )
    finished = decide_commit(running, claim, _segment(Finished({})), NOW)
    assert isinstance(finished, dict) and finished["runtime_state"] == "Succeeded"
    failed = decide_commit(running, claim, _segment(Failed("X", "e", quarantined=True)), NOW)
    assert isinstance(failed, dict) and failed["runtime_state"] == "Quarantined"
    assert set(paused) | set(finished) | set(failed) <= LEGACY_MUTABLE_FIELDS

    stolen = dataclasses.replace(running, claimed_by="other")
    assert decide_commit(stolen, claim, _segment(Finished({})), NOW) == Rejected(
        Rejection.CLAIM_MISMATCH
    )
    moved = dataclasses.replace(running, state_version=6)
    assert decide_commit(moved, claim, _segment(Finished({})), NOW) == Rejected(
        Rejection.VERSION_MISMATCH
    )


def test_stale_recovery_only_takes_an_expired_legacy_claim() -> None:
    live = row(status=S.RUNNING, claimed_by="t", claim_until=NOW + timedelta(seconds=1))
    assert decide_stale_recovery(live, org_id="org-1", now=NOW) == Rejected(Rejection.CLAIM_LIVE)
    stale = dataclasses.replace(live, claim_until=NOW - timedelta(seconds=1))
    values = decide_stale_recovery(stale, org_id="org-1", now=NOW)
    assert isinstance(values, dict) and (values["interview_status"], values["run_after"]) == (
        "Paused",
        NOW,
    )
    v2 = dataclasses.replace(stale, execution_owner="FlowRuntimeV2", ownership_epoch=1)
    assert decide_stale_recovery(v2, org_id="org-1", now=NOW) == Rejected(
        Rejection.NOT_LEGACY_OWNED
    )


def test_delete_tombstones_cancels_and_is_idempotent() -> None:
    values = decide_delete(row(), org_id="org-1", expected_version=None, now=NOW)
    assert isinstance(values, dict)
    assert values["is_deleted"] is True and values["runtime_state"] == RunState.CANCELLED.code
    assert values["interview_status"] == "Error" and values["terminal_cause_code"] == "cancelled"
    done = row(status=S.FINISHED, runtime_state="Succeeded")
    assert decide_delete(done, org_id="org-1", expected_version=None, now=NOW) == {
        "is_deleted": True,
        "delete_requested_at": NOW,
        "updated_at": NOW,
    }
    assert decide_delete(row(is_deleted=True), org_id="org-1", expected_version=9, now=NOW) is None
    assert decide_delete(row(), org_id="org-1", expected_version=9, now=NOW) == Rejected(
        Rejection.VERSION_MISMATCH
    )
    assert decide_cancel(
        row(status=S.FINISHED), org_id="org-1", expected_version=None, now=NOW
    ) == (Rejected(Rejection.STATUS))


def test_a_legacy_transition_may_write_only_the_legacy_owned_field_set() -> None:
    for forbidden in (
        "execution_owner",
        "ownership_epoch",
        "plan_id",
        "org_id",
        "current_step_execution_id",
    ):
        with pytest.raises(ValueError, match="may not write"):
            _check_values({forbidden: "x"})
    _check_values({"interview_status": "Paused"})
    assert legacy_runtime_state(S.ERROR, cause="cancelled") is RunState.CANCELLED
    assert legacy_runtime_state(S.PAUSED) is RunState.WAITING
