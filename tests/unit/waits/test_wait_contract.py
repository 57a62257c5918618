"""The producer registry and the notification contract, pure (§14.1, §10.6): what each
producer kind publishes, the activation check, the explain annotation, and the
validation of a submission before anything is written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime_svc.compiler import ExecutionPlan
from runtime_svc.compiler.explain import explain
from runtime_svc.waits.evidence import (
    MAX_EVIDENCE_BYTES,
    SignalSubmission,
    evidence_digest,
    parse_evidence,
    validate_submission,
)
from runtime_svc.waits.registry import ProducerFamily, ProducerRegistry
from services.errors import InvalidArgumentError
from tests.unit.compiler.compiler_corpus import FLOWS, case_inputs, read_json, render_case

REGISTRY = ProducerRegistry(("external.signal", "approval.decision"))


def _plan(name: str) -> ExecutionPlan:
    return ExecutionPlan.from_dict(read_json(FLOWS / name / "plan.json"))


def test_every_registered_kind_publishes_the_full_contract() -> None:
    for kind in REGISTRY.kinds:
        spec = REGISTRY.spec(kind)
        assert spec is not None and spec.resolvable
        assert spec.identity and spec.existence_check and spec.wake_identity
        assert spec.receipt and spec.expiry
    families = {REGISTRY.spec(k).family for k in REGISTRY.kinds}  # type: ignore[union-attr]
    assert families == set(ProducerFamily)


def test_effect_completion_names_of_any_owner_resolve_to_the_one_producer() -> None:
    spec = REGISTRY.for_declaration("effect.completion:runtime_delivery/email-gateway")
    assert spec is not None and spec.kind == "effect.completion" and spec.api_submittable
    assert REGISTRY.for_declaration("action:await_approval") is None


@pytest.mark.parametrize("kind", ["", "runtime.timer", "a:b", "x" * 65])
def test_an_external_kind_cannot_shadow_a_builtin_or_be_malformed(kind: str) -> None:
    with pytest.raises(ValueError):
        ProducerRegistry((kind,))


def test_activation_check_names_the_step_of_an_unregistered_producer() -> None:
    assert REGISTRY.check_plan(_plan("durable_wait_event_terminal")) == []
    assert REGISTRY.check_plan(_plan("durable_send_email")) == []
    [issue] = REGISTRY.check_plan(_plan("durable_wait_action"))
    assert issue.step_key == "ask" and issue.code == "wait.producer_not_registered"
    [issue] = ProducerRegistry().check_plan(_plan("durable_wait_event_terminal"))
    assert issue.producer_kind == "approval.decision"


def test_explain_shows_the_producer_its_contract_and_the_policy_bounds() -> None:
    inputs = case_inputs("durable_wait_record_condition")
    text = explain(_plan("durable_wait_record_condition"), REGISTRY.explainer(inputs.policy))
    assert "producer: record.change (record_change)" in text
    assert "watches: Case records" in text
    assert "bounds: max wait age 2592000s (policy v3); ≤ 12 probes" in text
    assert "expiry=fault_path → never_closed" in text
    unregistered = explain(_plan("durable_wait_action"), REGISTRY.explainer(None))
    assert "NOT REGISTERED (activation fails)" in unregistered
    # The golden explain files are rendered exactly this way.
    assert render_case("durable_wait_record_condition")["explain.txt"] == (
        FLOWS / "durable_wait_record_condition" / "explain.txt"
    ).read_text(encoding="utf-8")


def _submission(**kw: Any) -> SignalSubmission:
    evidence = kw.pop("evidence", {"status": "approved"})
    values: dict[str, Any] = {
        "producer_kind": "external.signal",
        "producer_key": "approval:1",
        "wake_token": "t1",
        "wake_version": 0,
        "evidence_digest": evidence_digest(evidence) if evidence is not None else "",
        "evidence_json": json.dumps(evidence) if evidence is not None else "",
    }
    values.update(kw)
    return SignalSubmission(**values)


def test_valid_submission_stores_canonical_evidence() -> None:
    new = validate_submission(_submission(evidence_json='{ "status" : "approved" }'), REGISTRY)
    assert new.evidence_json == '{"status":"approved"}'
    assert new.wake_version is None and new.wake_signal_id.startswith("sig_")


@pytest.mark.parametrize(
    ("kw", "path", "reason"),
    [
        ({"producer_kind": "nope"}, "producer_kind", "unknown_producer_kind"),
        ({"producer_kind": "record.change"}, "producer_kind", "producer_kind_internal"),
        ({"producer_key": ""}, "producer_key", "invalid_wake_signal"),
        ({"producer_key": " padded"}, "producer_key", "invalid_wake_signal"),
        ({"wake_token": "x" * 129}, "wake_token", "invalid_wake_signal"),
        ({"wake_version": -1}, "wake_version", "invalid_wake_signal"),
        ({"evidence_digest": "nope"}, "evidence_digest", "invalid_wake_signal"),
        ({"evidence_json": "{"}, "evidence_json", "invalid_wake_signal"),
        ({"evidence_json": '{"a": 2}'}, "evidence_digest", "evidence_digest_mismatch"),
        (
            {"evidence": {"api_key": "AKIAXXXXXXXXXXXXXXXX"}},
            "evidence_json",
            "evidence_credential_rejected",
        ),
        ({"evidence": {"x": "y" * MAX_EVIDENCE_BYTES}}, "evidence_json", "evidence_too_large"),
        ({"evidence_reference": "r" * 201}, "evidence_reference", "invalid_wake_signal"),
    ],
)
def test_invalid_submissions_are_refused_before_anything_is_written(
    kw: dict[str, Any], path: str, reason: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        validate_submission(_submission(**kw), REGISTRY)
    assert err.value.field_path == path
    assert err.value.reason == reason


def test_evidence_must_be_a_bounded_object() -> None:
    assert parse_evidence('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    for text in ("[]", '"x"', "1", "null", "NaN"):
        with pytest.raises(InvalidArgumentError):
            parse_evidence(text)
