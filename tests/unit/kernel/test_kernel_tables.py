"""The §11 state machines as data: every arrow allowed, every other pair refused, terminal
states immutable, enum numbers equal to the protos, the §18.2 projection, and the
package's public exports."""

from __future__ import annotations

import itertools
from enum import IntEnum

import pytest

import runtime_svc.kernel as kernel
from runtime_svc.kernel.errors import IllegalTransitionError, TerminalStateError
from runtime_svc.kernel.model import KEEP, AttemptPatch, RunPatch, StepPatch, patch_changes
from runtime_svc.kernel.states import (
    TERMINAL_ATTEMPT_OUTCOMES,
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
    AttemptOutcome,
    CompatibilityStatus,
    ExecutionOwner,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)
from runtime_svc.kernel.tables import (
    ATTEMPT_TRANSITIONS,
    RUN_EXTENSION_ARROWS,
    RUN_TRANSITIONS,
    STEP_EXTENSION_ARROWS,
    STEP_TRANSITIONS,
    check_transition,
    compatibility_status,
    is_allowed,
    root_step_consistent,
)
from services.proto import common_v1

# The arrows of the spec's diagrams, transcribed independently of the tables (§11.1-§11.3).
SPEC_RUN_ARROWS = """
Accepted Runnable; Runnable Running; Running Runnable; Running Waiting; Waiting Runnable;
Waiting TerminalFailed; Waiting Quarantined; Running Succeeded; Running TerminalFailed;
Running Quarantined; Accepted CancelRequested; Runnable CancelRequested;
Running CancelRequested; Waiting CancelRequested; CancelRequested Cancelled
"""
SPEC_STEP_ARROWS = """
Pending Claimed; RetryScheduled Claimed; Claimed Running; Claimed Pending; Running Succeeded;
Running Waiting; Running RetryScheduled; Running Failed; Running Quarantined;
Claimed RetryScheduled; Pending Cancelled; RetryScheduled Cancelled; Claimed CancelRequested;
Running CancelRequested; Waiting CancelRequested; CancelRequested Cancelled; Waiting Pending;
Waiting Failed; Waiting Quarantined
"""
SPEC_ATTEMPT_ARROWS = """
Started Committed; Started RolledBack; Started CommitUnknown; Started RollbackUnknown;
Started PreTransactionFailed; Started Fenced; Started Cancelled; Started Abandoned
"""

MACHINES: dict[str, tuple[type[IntEnum], str]] = {
    "run": (RunState, SPEC_RUN_ARROWS),
    "step": (StepState, SPEC_STEP_ARROWS),
    "attempt": (AttemptOutcome, SPEC_ATTEMPT_ARROWS),
}
TERMINAL = {
    "run": TERMINAL_RUN_STATES,
    "step": TERMINAL_STEP_STATES,
    "attempt": TERMINAL_ATTEMPT_OUTCOMES,
}


def _arrows(kind: str) -> set[tuple[IntEnum, IntEnum]]:
    enum_type, text = MACHINES[kind]
    pairs = [p.split() for p in text.replace("\n", " ").split(";") if p.strip()]
    found = {(enum_type.from_code(a), enum_type.from_code(b)) for a, b in pairs}  # type: ignore[attr-defined]
    if kind == "step":
        found |= set(STEP_EXTENSION_ARROWS)
    if kind == "run":
        found |= set(RUN_EXTENSION_ARROWS)
    return found


def _all_pairs() -> list[tuple[str, IntEnum, IntEnum]]:
    return [
        (kind, a, b)
        for kind, (enum_type, _) in MACHINES.items()
        for a, b in itertools.product(list(enum_type), repeat=2)
    ]


def test_tables_hold_exactly_the_spec_arrows_plus_the_documented_extension() -> None:
    tables = {"run": RUN_TRANSITIONS, "step": STEP_TRANSITIONS, "attempt": ATTEMPT_TRANSITIONS}
    for kind, table in tables.items():
        drawn = {(a, b) for a, targets in table.items() for b in targets}
        assert drawn == _arrows(kind), kind
        assert set(table) == set(MACHINES[kind][0]), kind
    assert {
        (StepState.CLAIMED, StepState.FAILED),
        (StepState.RETRY_SCHEDULED, StepState.FAILED),
        (StepState.CANCEL_REQUESTED, StepState.QUARANTINED),
    } == STEP_EXTENSION_ARROWS
    assert {
        (RunState.RUNNABLE, RunState.TERMINAL_FAILED),
        (RunState.CANCEL_REQUESTED, RunState.QUARANTINED),
    } == RUN_EXTENSION_ARROWS


@pytest.mark.parametrize(
    ("kind", "source", "target"), _all_pairs(), ids=lambda v: getattr(v, "name", v)
)
def test_every_pair_is_allowed_exactly_when_it_is_an_arrow(
    kind: str, source: IntEnum, target: IntEnum
) -> None:
    if (source, target) in _arrows(kind):
        check_transition(kind, source, target)
        assert is_allowed(kind, source, target)
        return
    assert not is_allowed(kind, source, target)
    expected = TerminalStateError if source in TERMINAL[kind] else IllegalTransitionError
    with pytest.raises(expected) as err:
        check_transition(kind, source, target)
    assert err.value.attributes == {"kind": kind, "from": source.name, "to": target.name}


def test_terminal_states_have_no_way_out() -> None:
    for kind, (enum_type, _) in MACHINES.items():
        for state in TERMINAL[kind]:
            for target in enum_type:
                with pytest.raises(TerminalStateError):
                    check_transition(kind, state, target)


def test_mixed_enum_types_are_illegal() -> None:
    with pytest.raises(IllegalTransitionError):
        check_transition("run", RunState.RUNNING, StepState.RUNNING)


@pytest.mark.parametrize(
    ("ours", "proto", "prefix"),
    [
        (RunState, common_v1.RunState, "RUN_STATE_"),
        (StepState, common_v1.StepState, "STEP_STATE_"),
        (AttemptOutcome, common_v1.AttemptOutcome, "ATTEMPT_OUTCOME_"),
        (RetryDecision, common_v1.RetryDecision, "RETRY_DECISION_"),
        (FailureClass, common_v1.FailureClass, "FAILURE_CLASS_"),
        (CompatibilityStatus, common_v1.CompatibilityStatus, "COMPATIBILITY_STATUS_"),
        (ExecutionOwner, common_v1.ExecutionOwner, "EXECUTION_OWNER_"),
    ],
)
def test_enum_numbers_equal_the_proto_numbers(
    ours: type[IntEnum], proto: object, prefix: str
) -> None:
    proto_values = {
        name.removeprefix(prefix): number
        for name, number in proto.items()  # type: ignore[attr-defined]
        if not name.endswith("_UNSPECIFIED")
    }
    assert {m.name: m.value for m in ours} == proto_values


def test_storage_codes_are_the_spec_names_and_round_trip() -> None:
    assert RunState.TERMINAL_FAILED.code == "TerminalFailed"
    assert StepState.RETRY_SCHEDULED.code == "RetryScheduled"
    assert AttemptOutcome.PRE_TRANSACTION_FAILED.code == "PreTransactionFailed"
    assert ExecutionOwner.FLOW_RUNTIME_V2.code == "FlowRuntimeV2"
    for enum_type in (RunState, StepState, AttemptOutcome, RetryDecision, FailureClass):
        for member in enum_type:
            assert enum_type.from_code(member.code) is member
    with pytest.raises(ValueError):
        RunState.from_code("Paused")


@pytest.mark.parametrize(
    ("state", "status"),
    [
        (RunState.ACCEPTED, "Running"),
        (RunState.RUNNABLE, "Running"),
        (RunState.RUNNING, "Running"),
        (RunState.WAITING, "Paused"),
        (RunState.SUCCEEDED, "Finished"),
        (RunState.TERMINAL_FAILED, "Error"),
        (RunState.QUARANTINED, "Error"),
        (RunState.CANCEL_REQUESTED, "Error"),
        (RunState.CANCELLED, "Error"),
    ],
)
def test_compatibility_projection_of_section_18_2(state: RunState, status: str) -> None:
    assert compatibility_status(state).code == status


def test_projection_refuses_a_divergent_root_and_step() -> None:
    assert compatibility_status(RunState.WAITING, StepState.WAITING) is CompatibilityStatus.PAUSED
    assert not root_step_consistent(RunState.RUNNING, StepState.WAITING)
    with pytest.raises(IllegalTransitionError):
        compatibility_status(RunState.RUNNING, StepState.WAITING)
    with pytest.raises(IllegalTransitionError):
        compatibility_status(RunState.SUCCEEDED, StepState.RUNNING)


def test_patches_cannot_be_built_for_illegal_or_terminal_arrows() -> None:
    with pytest.raises(IllegalTransitionError):
        RunPatch("r", 0, RunState.RUNNABLE, RunState.SUCCEEDED, expect_epoch=1)
    with pytest.raises(TerminalStateError):
        StepPatch("s", 0, StepState.SUCCEEDED, StepState.PENDING, expect_epoch=1)
    with pytest.raises(TerminalStateError):
        AttemptPatch(
            "a",
            1,
            AttemptOutcome.FENCED,
            expect_lease_token_digest="d",
            expect_epoch=1,
            from_state=AttemptOutcome.COMMITTED,
        )
    # A terminal root may only gain the soft-delete fact.
    tombstone = RunPatch(
        "r", 3, RunState.SUCCEEDED, RunState.SUCCEEDED, expect_epoch=1, is_deleted=True
    )
    assert patch_changes(tombstone) == {"is_deleted": True}
    with pytest.raises(TerminalStateError):
        RunPatch(
            "r",
            3,
            RunState.SUCCEEDED,
            RunState.SUCCEEDED,
            expect_epoch=1,
            terminal_cause_code="rewritten",
        )
    assert RunPatch("r", 0, RunState.RUNNABLE, RunState.RUNNING, expect_epoch=1).run_after is KEEP


def test_public_exports_are_pinned() -> None:
    assert sorted(kernel.__all__) == sorted(
        [
            "DEFAULT_MAX_CHECKPOINT_BYTES",
            "DEFAULT_RETRY_POLICY",
            "AttemptOutcome",
            "Candidate",
            "CheckpointInput",
            "ClaimedStart",
            "CommitResult",
            "CommitTail",
            "CompatibilityStatus",
            "ContinueAs",
            "EnterWait",
            "ExecutionOwner",
            "FailRun",
            "FailureClass",
            "FinishRun",
            "FirstStep",
            "FlowRunStateStore",
            "IllegalTransitionError",
            "LeaseFence",
            "NextStep",
            "NoChange",
            "NotEligible",
            "RetryDecision",
            "RetryPolicy",
            "RunCursor",
            "RunFilters",
            "RunPage",
            "RunRecord",
            "RunState",
            "StartRunRequest",
            "StartRunResult",
            "StepFailure",
            "StepState",
            "SupportView",
            "TerminalStateError",
            "TransitionInputError",
            "check_transition",
            "compatibility_status",
            "validate_checkpoint_payload",
        ]
    )
    for name in kernel.__all__:
        assert hasattr(kernel, name), name


def test_operator_arrows_are_documented_and_outside_the_automatic_tables() -> None:
    """The operator-only exits of Quarantined (``RetryQuarantinedRun``, the ops CLI)
    extend §11 only through ``check_operator_transition``: never in the tables."""
    import runtime_svc.kernel.tables as tables

    doc = tables.__doc__ or ""
    for kind, arrows, table in (
        ("run", tables.OPERATOR_RUN_ARROWS, RUN_TRANSITIONS),
        ("step", tables.OPERATOR_STEP_ARROWS, STEP_TRANSITIONS),
    ):
        for a, b in arrows:
            assert b not in table[a], (kind, a, b)  # type: ignore[index]
            assert f"``{a.code} -> {b.code}``" in doc, (kind, a, b)  # type: ignore[attr-defined]
