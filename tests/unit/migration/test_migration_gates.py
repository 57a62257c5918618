"""Pure verdicts of the bridge (§20.3), owner selection (§20.6-§20.9), rollback (§20.9),
the release manifest the binaries carry, and the trusted routing authority (§20.2)."""

from __future__ import annotations

import dataclasses
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.migration.authority import ROUTING_ROLE, AuthorityUnproven, resolve_authority
from runtime_svc.migration.cohorts import CohortFlag, choose_owner
from runtime_svc.migration.control import DeploymentControl, Origin, Phase
from runtime_svc.migration.gates import (
    DrainEvidence,
    admission_enable_refusal,
    bridge_begin_refusal,
    drain_gate_refusals,
    rollback_verdict,
    startup_refusal,
    v2_admission_refusal,
    write_protocol_refusal,
)
from runtime_svc.migration.protocol import BINARY_VERSION, RELEASES, release_generation
from runtime_svc.migration.reconcile import DUAL_OWNERSHIP_KINDS, OwnershipReport, metrics_text
from runtime_svc.migration.shadow_model import Observation, Scenario, compare
from services.auth import (
    CredentialVerifier,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    generate_keypair,
    mint_credential,
)
from services.config import ServiceName

NOW = datetime(2030, 1, 1, tzinfo=UTC)
V2, LEGACY = ExecutionOwner.FLOW_RUNTIME_V2, ExecutionOwner.LEGACY_INTERPRETER


def control(**overrides: Any) -> DeploymentControl:
    base = DeploymentControl(
        generation=1,
        phase=Phase.WRITE_PROTOCOL_ENABLED,
        origin=Origin.CLEAN_INSTALL,
        default_new_run_owner=V2,
        v2_admission_enabled=True,
        isolated_single_org=False,
        deployment_org_id=None,
        quarantine_reason=None,
        drain_started_at=None,
        drained_at=None,
        drain_evidence=None,
        org_backfill_receipt_id=None,
        org_schema_verified_at=None,
        write_protocol_enabled_at=NOW,
        admission_changed_at=None,
        state_version=0,
        updated_at=NOW,
    )
    return dataclasses.replace(base, **overrides)


ADDITIVE = control(
    generation=0,
    phase=Phase.ADDITIVE,
    origin=Origin.LEGACY_ADOPTION,
    default_new_run_owner=LEGACY,
    v2_admission_enabled=False,
    isolated_single_org=True,
)


@pytest.mark.parametrize(
    ("facts", "generation", "refusal"),
    [
        ({}, 1, None),
        ({}, 0, "binary_pre_bridge"),
        ({"quarantine_reason": "org_mismatch"}, 1, "rollout_quarantined"),
        ({"generation": 0, "phase": Phase.ADDITIVE}, 1, "write_protocol_not_enabled"),
        ({"phase": Phase.ORG_SCHEMA_VERIFIED, "generation": 0}, 1, "write_protocol_not_enabled"),
        ({"v2_admission_enabled": False}, 1, "v2_admission_disabled"),
    ],
)
def test_v2_admission_needs_both_gates_a_bridge_binary_and_admission(
    facts: dict[str, Any], generation: int, refusal: str | None
) -> None:
    assert v2_admission_refusal(control(**facts), generation) == refusal


def test_a_pre_bridge_binary_may_start_only_before_the_drain() -> None:
    assert startup_refusal(ADDITIVE, 0) is None
    assert startup_refusal(ADDITIVE, 1) is None
    draining = dataclasses.replace(ADDITIVE, drain_started_at=NOW)
    assert startup_refusal(draining, 0) == "pre_bridge_binary_after_drain"
    assert startup_refusal(control(), 0) == "binary_older_than_write_protocol"
    assert startup_refusal(control(generation=2), 1) == "binary_older_than_write_protocol"


def test_the_drain_gate_lists_every_missing_proof() -> None:
    clean = DrainEvidence([], 0, 0, "innodb_trx")
    draining = dataclasses.replace(ADDITIVE, drain_started_at=NOW)
    assert drain_gate_refusals(draining, clean) == []
    dirty = DrainEvidence([{"process_id": "old"}], None, 2, "innodb_trx_unavailable")
    assert drain_gate_refusals(ADDITIVE, dirty) == [
        "drain_not_started",
        "pre_bridge_writers_live",
        "transaction_evidence_unavailable",
        "pre_bridge_writes_after_drain_start",
    ]
    assert drain_gate_refusals(draining, DrainEvidence([], 3, 0, "innodb_trx")) == [
        "transactions_open_since_before_drain"
    ]


def test_the_write_protocol_and_admission_follow_the_gate_order() -> None:
    assert write_protocol_refusal(ADDITIVE) == "drain_gate_not_passed"
    drained = dataclasses.replace(ADDITIVE, phase=Phase.DRAINED, drained_at=NOW)
    assert write_protocol_refusal(drained) == "org_schema_gate_not_passed"
    verified = dataclasses.replace(
        drained, phase=Phase.ORG_SCHEMA_VERIFIED, org_backfill_receipt_id="obr-1"
    )
    assert write_protocol_refusal(verified) is None
    assert admission_enable_refusal(verified, []) == "write_protocol_not_enabled"
    assert admission_enable_refusal(control(), [1, 0]) == "pre_bridge_writers_live"
    assert admission_enable_refusal(control(), [1, 1]) is None
    assert bridge_begin_refusal(control(), 1) == "v2_owned_runs_exist"
    assert bridge_begin_refusal(control(), 0) is None


def test_owner_selection_for_new_runs() -> None:
    flag = CohortFlag("o", "fv", "bounded_atomic", "pure_autolaunched", LEGACY, None, None, NOW, 0)
    assert choose_owner(control(), None, generation=1).owner is V2
    assert choose_owner(control(), flag, generation=1).owner is LEGACY
    closed = choose_owner(control(v2_admission_enabled=False), None, generation=1)
    # Rollback: new runs return to the compatible legacy cohort (§20.9).
    assert (closed.owner, closed.reason) == (LEGACY, "v2_admission_closed.v2_admission_disabled")
    v2_flag = dataclasses.replace(flag, new_run_owner=V2)
    assert choose_owner(ADDITIVE, v2_flag, generation=1).owner is LEGACY
    assert choose_owner(ADDITIVE, None, generation=1).reason == "deployment_default_legacy"


def test_rollback_targets() -> None:
    assert release_generation("0.1.0") == 0 and release_generation(f"v{BINARY_VERSION}") == 1
    assert release_generation("7.0.0") is None
    rejected = rollback_verdict("0.1.0", 0, control(), v2_rows=0, legacy_rows=0)
    assert not rejected.allowed
    assert "pre_bridge_target_while_v2_ownership_possible" in rejected.reasons
    assert rollback_verdict(BINARY_VERSION, 1, control(), v2_rows=5, legacy_rows=2).allowed
    assert rollback_verdict("0.1.0", 0, ADDITIVE, v2_rows=0, legacy_rows=0).allowed
    stranded = rollback_verdict("0.1.0", 0, ADDITIVE, v2_rows=0, legacy_rows=3)
    assert stranded.reasons == ("pre_bridge_target_cannot_drain_adopted_legacy_runs",)
    assert rollback_verdict("x", None, ADDITIVE, v2_rows=0, legacy_rows=0).reasons == (
        "unknown_release",
    )


def test_the_binary_version_is_the_released_package_version() -> None:
    root = Path(__file__).resolve().parents[3]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["version"] == BINARY_VERSION
    assert RELEASES[BINARY_VERSION] == 1


def _statement(key: Any, scope: TrustedRuntimeWorkScope, roles: tuple[str, ...]) -> str:
    claims = WorkloadClaims(
        "cp",
        (ServiceName.RUNTIME,),
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
        roles,
    )
    return mint_credential(key, "cp", claims, ttl_s=60)


def test_the_routing_authority_demands_exactly_one_signed_org_and_scope() -> None:
    key, public = generate_keypair()
    verifier = CredentialVerifier({"cp": public}, ServiceName.RUNTIME)
    digest = "runtime-work-binding/v1:sha256:" + "a" * 64
    one = TrustedRuntimeWorkScope("org-1", "inst", "cap", digest)
    other = TrustedRuntimeWorkScope("org-2", "inst", "cap", digest)
    proven = resolve_authority([_statement(key, one, (ROUTING_ROLE,))], verifier)
    assert not isinstance(proven, AuthorityUnproven) and proven.org_id == "org-1"
    assert proven.digest.startswith("deployment-org-authority/v1:")
    same_twice = resolve_authority(
        [_statement(key, one, (ROUTING_ROLE,)), _statement(key, one, (ROUTING_ROLE,))], verifier
    )
    assert not isinstance(same_twice, AuthorityUnproven)
    cases = {
        "no_routing_statement": [],
        "ambiguous_orgs": [
            _statement(key, one, (ROUTING_ROLE,)),
            _statement(key, other, (ROUTING_ROLE,)),
        ],
        "routing_statement_not_authorized": [_statement(key, one, ())],
        "routing_statement_invalid.credential_bad_signature": [
            _statement(generate_keypair()[0], one, (ROUTING_ROLE,))
        ],
    }
    for reason, statements in cases.items():
        outcome = resolve_authority(statements, verifier)
        assert isinstance(outcome, AuthorityUnproven) and outcome.reason == reason


def _obs(**overrides: Any) -> Observation:
    base = Observation(
        ("a",), "succeeded", None, None, {}, (), (), frozenset(), (("Finished", None),)
    )
    return dataclasses.replace(base, **overrides)


def test_shadow_divergences_are_classified() -> None:
    scenario = Scenario("s")
    assert compare("f@1", scenario, None, _obs(), _obs(), frozenset()).divergences == ()
    fails_closed = compare(
        "f@1",
        scenario,
        None,
        _obs(),
        _obs(outcome="failed", fault_code="unsupported_element"),
        frozenset(),
    )
    assert [(d.explained, d.blocking, d.reason) for d in fails_closed.divergences] == [
        (True, True, "v2_fails_closed.unsupported_element")
    ]
    boundary = compare(
        "f@1",
        scenario,
        None,
        _obs(effects=(("send", "send_email", "{}"),)),
        _obs(
            effects=(("send", "send_email", "{}"),),
            projections=(("Paused", "send#completion"), ("Finished", None)),
        ),
        frozenset(),
    )
    assert [(d.kind, d.explained, d.blocking) for d in boundary.divergences] == [
        ("projection", True, False)
    ]
    wrong = compare(
        "f@1", scenario, None, _obs(), _obs(trace=("b",), outputs={"x": 1}), frozenset()
    )
    assert {d.kind for d in wrong.unexplained} == {"element_trace", "outputs"}


def test_the_dual_ownership_metric_renders_every_kind() -> None:
    report = OwnershipReport(
        NOW, None, {("LegacyInterpreter", 0): 2}, {"v2_epoch_zero": 1}, (), {}, 2, 0
    )
    text = metrics_text(report)
    for kind in DUAL_OWNERSHIP_KINDS:
        assert f'kind="{kind}"' in text
    assert 'nexus_flow_dual_ownership_runs{kind="v2_epoch_zero"} 1' in text
    assert 'nexus_flow_runs_by_owner{owner="LegacyInterpreter",epoch="0"} 2' in text
    assert report.dual_ownership_total == 1


def test_the_inventory_names_the_legacy_behaviour_each_plan_relies_upon() -> None:
    from runtime_svc.compiler import compile_plan
    from runtime_svc.definitions import inventory_row
    from tests.unit.compiler.compiler_corpus import FLOWS, case_inputs, read_json

    def behaviours(name: str) -> tuple[str, ...]:
        source = read_json(FLOWS / name / "flow.json")
        inputs = case_inputs(name)
        row = inventory_row(name, f"fv-{name}", source, inputs, compile_plan(source, inputs))
        return row.legacy_behaviors

    assert "legacy.inline_external_call" in behaviours("durable_send_email")
    assert "legacy.paused_interview_wait" in behaviours("durable_wait_time_fault_path")
    assert "legacy.subflow_call_frame" in behaviours("atomic_subflow_line_items")
    assert "legacy.all_or_nothing_segment" in behaviours("durable_unbounded_loop")
    assert "legacy.all_or_nothing_segment" not in behaviours("durable_snapshot_verify")
    assert behaviours("autolaunched_pure_compute") == ()
