"""Pure §17.2 reauthorization rules: every mode, every policy, every failure path."""

from __future__ import annotations

import pytest

from runtime_svc.compiler.identity import (
    ExecutionPrincipalMode,
    ReauthorizationPolicy,
    StepPrincipal,
)
from runtime_svc.compiler.kinds import StepKind
from runtime_svc.identity import (
    Allowed,
    DenialOutcome,
    Denied,
    Handoff,
    PrincipalState,
    PrincipalStatus,
    ReasonCode,
    RunIdentity,
    authorization_context_digest,
    decide,
    permission_digest,
    reauthorizes,
)

INIT = ExecutionPrincipalMode.INITIATING_PRINCIPAL
SYSTEM = ExecutionPrincipalMode.SYSTEM
FAULT = ReauthorizationPolicy.FAULT_PATH
TERMINAL = ReauthorizationPolicy.TERMINAL_FAILURE
HANDOFF = ReauthorizationPolicy.SYSTEM_HANDOFF

GRANTS = ("Case.read", "Case.edit", "Task.create")
ANN = PrincipalState("user-ann", PrincipalStatus.ENABLED, permission_digest(GRANTS))
BOT = PrincipalState("svc-bot", PrincipalStatus.ENABLED, permission_digest(()))


def _run(state: PrincipalState | None = ANN, principal: str = "user-ann") -> RunIdentity:
    return RunIdentity(
        principal, "initiating_principal", authorization_context_digest(principal, state)
    )


def _disabled(s: PrincipalState) -> PrincipalState:
    return PrincipalState(s.principal_id, PrincipalStatus.DISABLED, s.permission_digest)


def test_permission_digest_ignores_order_and_duplicates_but_not_content() -> None:
    assert permission_digest(["b", "a", "a"]) == permission_digest(["a", "b"])
    assert permission_digest(["a"]) != permission_digest(["a", "b"])


def test_context_digest_depends_on_principal_and_permissions_not_status() -> None:
    d = authorization_context_digest("user-ann", ANN)
    assert d == authorization_context_digest("user-ann", _disabled(ANN))
    assert d != authorization_context_digest("user-bob", ANN)
    assert d != authorization_context_digest("user-ann", None)
    assert "Case.read" not in d  # a digest, never the grants


def test_unchanged_enabled_principal_acts_as_itself() -> None:
    v = decide(_run(), StepPrincipal(INIT, TERMINAL), ANN, None)
    assert v == Allowed("user-ann")


@pytest.mark.parametrize(
    ("policy", "outcome"),
    [(FAULT, DenialOutcome.FAULT_PATH), (TERMINAL, DenialOutcome.TERMINAL_FAILURE)],
)
def test_disabled_principal_follows_the_policy(
    policy: ReauthorizationPolicy, outcome: DenialOutcome
) -> None:
    v = decide(_run(), StepPrincipal(INIT, policy), _disabled(ANN), None)
    assert v == Denied(ReasonCode.PRINCIPAL_DISABLED, outcome)


def test_changed_permissions_follow_the_policy() -> None:
    changed = PrincipalState("user-ann", PrincipalStatus.ENABLED, permission_digest(GRANTS[:1]))
    v = decide(_run(), StepPrincipal(INIT, FAULT), changed, None)
    assert v == Denied(ReasonCode.PERMISSION_CHANGED, DenialOutcome.FAULT_PATH)


def test_a_principal_removed_from_or_added_to_the_directory_is_a_material_change() -> None:
    assert decide(_run(), StepPrincipal(INIT, TERMINAL), None, None) == Denied(
        ReasonCode.PERMISSION_CHANGED, DenialOutcome.TERMINAL_FAILURE
    )
    unmanaged = _run(None)
    assert decide(unmanaged, StepPrincipal(INIT, TERMINAL), None, None) == Allowed("user-ann")
    assert decide(unmanaged, StepPrincipal(INIT, TERMINAL), ANN, None) == Denied(
        ReasonCode.PERMISSION_CHANGED, DenialOutcome.TERMINAL_FAILURE
    )


def test_system_handoff_acts_as_the_declared_identity_when_it_may() -> None:
    declared = StepPrincipal(INIT, HANDOFF, "svc-bot")
    assert decide(_run(), declared, _disabled(ANN), BOT) == Handoff(
        ReasonCode.PRINCIPAL_DISABLED, "svc-bot"
    )


@pytest.mark.parametrize("system", [None, _disabled(BOT)])
def test_system_handoff_to_an_identity_that_cannot_act_is_terminal(
    system: PrincipalState | None,
) -> None:
    declared = StepPrincipal(INIT, HANDOFF, "svc-bot")
    assert decide(_run(), declared, _disabled(ANN), system) == Denied(
        ReasonCode.PRINCIPAL_DISABLED, DenialOutcome.TERMINAL_FAILURE
    )


def test_system_mode_acts_as_its_identity_whatever_the_initiator() -> None:
    declared = StepPrincipal(SYSTEM, TERMINAL, "svc-bot")
    assert decide(_run(), declared, _disabled(ANN), BOT) == Allowed("svc-bot")


@pytest.mark.parametrize(
    ("system", "reason"),
    [
        (None, ReasonCode.SYSTEM_IDENTITY_UNKNOWN),
        (_disabled(BOT), ReasonCode.SYSTEM_IDENTITY_DISABLED),
    ],
)
@pytest.mark.parametrize(
    ("policy", "outcome"),
    [
        (FAULT, DenialOutcome.FAULT_PATH),
        (TERMINAL, DenialOutcome.TERMINAL_FAILURE),
        (HANDOFF, DenialOutcome.TERMINAL_FAILURE),  # already system: nowhere to hand off
    ],
)
def test_system_mode_with_an_identity_that_cannot_act_is_denied(
    system: PrincipalState | None,
    reason: ReasonCode,
    policy: ReauthorizationPolicy,
    outcome: DenialOutcome,
) -> None:
    declared = StepPrincipal(SYSTEM, policy, "svc-bot")
    assert decide(_run(), declared, ANN, system) == Denied(reason, outcome)


def test_system_mode_without_a_declared_identity_never_acts() -> None:
    # The compiler rejects it; the runtime fails closed on a plan that carries it anyway.
    assert decide(_run(), StepPrincipal(SYSTEM, FAULT), ANN, BOT) == Denied(
        ReasonCode.SYSTEM_IDENTITY_UNKNOWN, DenialOutcome.FAULT_PATH
    )


def test_a_run_created_before_identity_was_recorded_is_not_reauthorized() -> None:
    legacy = RunIdentity(None, None, None)
    assert decide(legacy, StepPrincipal(INIT, TERMINAL), None, None) == Allowed(None)


@pytest.mark.parametrize("kind", list(StepKind))
def test_which_step_kinds_reauthorize(kind: StepKind) -> None:
    skipped = {
        StepKind.TERMINAL,
        StepKind.EXPLICIT_FAULT,
        StepKind.DEPENDENCY_WAIT,
        StepKind.EFFECT_COMPLETION,
    }
    assert reauthorizes(kind) is (kind not in skipped)
