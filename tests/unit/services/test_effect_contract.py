"""The cross-service effect contract: handoff-key grammar, derived identities, payload
digest and completion evidence (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest

from services.effect_contract import (
    MAX_EVIDENCE_BYTES,
    CompletionEvidence,
    CompletionOutcomeCode,
    EffectContractError,
    completion_wake_token,
    effect_handoff_key,
    effect_payload_digest,
    handoff_key_matches_scope,
    parse_effect_handoff_key,
    parse_wake_token,
    provider_idempotency_key,
    runtime_outbox_message_id,
    wake_evidence_digest,
)


@dataclass(frozen=True)
class S:
    org_id: str = "org-1"
    app_installation_id: str = "inst-1"
    runtime_capability_id: str = "cap-1"
    runtime_work_binding_digest: str = "runtime_work_binding/v1:sha256:" + "a" * 64


def _key(scope: S = S(), run: str = "run-1", step: str = "send", ordinal: int = 0) -> str:
    return effect_handoff_key(
        scope, flow_run_id=run, submit_step_key=step, invocation_ordinal=ordinal
    )


def test_the_key_is_deterministic_bounded_and_well_formed() -> None:
    key = _key()
    assert key == _key()
    assert len(key) == 134 <= 200
    parts = parse_effect_handoff_key(key)
    assert key == f"ehk1:{parts.scope_part}:{parts.lineage_part}"


@pytest.mark.parametrize(
    "change",
    [
        {"org_id": "org-2"},
        {"app_installation_id": "inst-2"},
        {"runtime_capability_id": "cap-2"},
        {"runtime_work_binding_digest": "runtime_work_binding/v1:sha256:" + "b" * 64},
    ],
)
def test_every_scope_component_is_encoded_and_checked(change: dict[str, str]) -> None:
    other = replace(S(), **change)
    assert _key(other) != _key()
    assert handoff_key_matches_scope(_key(), S())
    assert not handoff_key_matches_scope(_key(), other)
    # The lineage part is independent of the scope; the scope part is not.
    assert parse_effect_handoff_key(_key(other)).lineage_part == (
        parse_effect_handoff_key(_key()).lineage_part
    )


def test_every_lineage_component_changes_the_key() -> None:
    keys = {_key(), _key(run="run-2"), _key(step="other"), _key(ordinal=1)}
    assert len(keys) == 4


def test_separators_cannot_alias_components() -> None:
    assert _key(run="a:b", step="c") != _key(run="a", step="b:c")


@pytest.mark.parametrize(
    "bad", ["", "ehk1:abc:def", "ehk2:" + "a" * 64 + ":" + "b" * 64, _key().upper()]
)
def test_malformed_keys_are_refused(bad: str) -> None:
    with pytest.raises(EffectContractError):
        parse_effect_handoff_key(bad)
    assert not handoff_key_matches_scope(bad, S())


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(EffectContractError):
        _key(ordinal=-1)
    with pytest.raises(EffectContractError):
        _key(run="")
    with pytest.raises(EffectContractError):
        _key(replace(S(), org_id=""))


def test_derived_identities_are_deterministic_and_distinct() -> None:
    key = _key()
    assert runtime_outbox_message_id(key) == runtime_outbox_message_id(key)
    assert (
        runtime_outbox_message_id(key).startswith("rob_")
        and len(runtime_outbox_message_id(key)) == 36
    )
    assert runtime_outbox_message_id(key) != runtime_outbox_message_id(_key(ordinal=1))
    pik = provider_idempotency_key("email.smtp", key)
    assert pik == provider_idempotency_key("email.smtp", key)
    assert pik != provider_idempotency_key("webhook.http", key)
    with pytest.raises(EffectContractError):
        provider_idempotency_key("Bad Kind", key)


def test_payload_digest_is_canonical() -> None:
    assert effect_payload_digest({"a": 1, "b": [1, 2]}) == effect_payload_digest(
        {"b": [1, 2], "a": 1}
    )
    assert effect_payload_digest({"a": 1}) != effect_payload_digest({"a": 2})
    with pytest.raises(EffectContractError):
        effect_payload_digest({"x": float("nan")})


def _evidence(**kw: object) -> CompletionEvidence:
    base: dict[str, object] = {
        "command_id": "cmd_1",
        "outcome_version": 1,
        "outcome": CompletionOutcomeCode.SUCCEEDED,
        "effect_owner_kind": "email.smtp",
        "effect_handoff_key": _key(),
        "result_digest": "effect-result/v1:sha256:" + "c" * 64,
    }
    base.update(kw)
    return CompletionEvidence(**base)  # type: ignore[arg-type]


def test_evidence_round_trips_canonically_and_digests() -> None:
    e = _evidence()
    assert CompletionEvidence.from_json(e.to_json()) == e
    assert json.loads(e.to_json()) == e.to_doc()
    assert e.digest() == wake_evidence_digest(e.to_json())
    assert e.wake_token == "cmd_1/1"
    assert wake_evidence_digest(json.dumps(e.to_doc(), indent=2)) == e.digest()


@pytest.mark.parametrize(
    "doc_change",
    [
        {"extra": "x"},
        {"outcome": "MAYBE"},
        {"outcome_version": "1"},
        {"command_id": 5},
    ],
)
def test_evidence_outside_the_contract_is_refused(doc_change: dict[str, object]) -> None:
    doc = _evidence().to_doc() | doc_change
    with pytest.raises(EffectContractError):
        CompletionEvidence.from_json(json.dumps(doc))


def test_evidence_bounds() -> None:
    with pytest.raises(EffectContractError):
        CompletionEvidence.from_json(" " * (MAX_EVIDENCE_BYTES + 1))
    with pytest.raises(EffectContractError):
        _evidence(safe_error_code="boom")  # a success carries no error code
    with pytest.raises(EffectContractError):
        _evidence(outcome_version=0)


def test_wake_tokens() -> None:
    assert parse_wake_token(completion_wake_token("cmd_abc", 3)) == ("cmd_abc", 3)
    for bad in ("cmd", "cmd/0", "cmd/01", "/1", "cmd/x"):
        with pytest.raises(EffectContractError):
            parse_wake_token(bad)
