"""Pure parts of the effect owner: the command lifecycle decisions, the fence attribute
check, the email message and the webhook status classification, provider configuration."""

from __future__ import annotations

import email.policy
import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from effect_owner_svc.commands.model import (
    CommandPolicy,
    CommandState,
    Complete,
    LookupAgainAt,
    Reconcile,
    Replay,
    RetryAt,
    decide_after_attempt,
    decide_after_lookup,
)
from effect_owner_svc.inbox.fence import HandoffAttributes, MismatchReason, mismatch
from effect_owner_svc.providers.base import ProviderCommand, ProviderOutcome, ProviderOutcomeKind
from effect_owner_svc.providers.email import EmailPayloadError, build_message
from effect_owner_svc.providers.factory import served_kinds
from effect_owner_svc.providers.webhook import classify_status
from services.config import ConfigError, load_effect_owner_settings, parse_kind_map
from services.effect_contract import CompletionOutcomeCode

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = CommandPolicy(max_attempts=3, reconcile_max_attempts=2, base_delay_ms=10, max_delay_ms=50)
RNG = random.Random(4)


def test_attempt_decisions() -> None:
    ok = decide_after_attempt(
        1, ProviderOutcome.succeeded(message_id="<x>"), POLICY, now=NOW, rng=RNG
    )
    assert isinstance(ok, Complete) and ok.state is CommandState.SUCCEEDED and ok.result_digest
    bad = decide_after_attempt(1, ProviderOutcome.terminal("http_422"), POLICY, now=NOW, rng=RNG)
    assert bad == Complete(CommandState.FAILED, CompletionOutcomeCode.FAILED, "http_422")
    retry = decide_after_attempt(1, ProviderOutcome.retryable("http_503"), POLICY, now=NOW, rng=RNG)
    assert isinstance(retry, RetryAt) and retry.when > NOW
    spent = decide_after_attempt(3, ProviderOutcome.retryable("http_503"), POLICY, now=NOW, rng=RNG)
    assert isinstance(spent, Complete) and spent.safe_error_code == "retry_budget_exhausted"
    unknown = decide_after_attempt(1, ProviderOutcome.unknown("timeout"), POLICY, now=NOW, rng=RNG)
    assert unknown == Reconcile("timeout")


def _lookup(
    found: ProviderOutcome | None, *, replay_safe: bool, attempts: int = 1, lookups: int = 0
) -> object:
    return decide_after_lookup(
        found,
        replay_safe=replay_safe,
        attempt_count=attempts,
        reconcile_attempts=lookups,
        policy=POLICY,
        now=NOW,
        rng=RNG,
    )


def test_unknown_outcomes_are_never_retried_blindly() -> None:
    found = ProviderOutcome.succeeded()
    assert isinstance(_lookup(found, replay_safe=False), Complete)
    not_found = ProviderOutcome(ProviderOutcomeKind.NOT_FOUND)
    for evidence in (None, not_found):
        quarantined = _lookup(evidence, replay_safe=False)
        assert isinstance(quarantined, Complete)
        assert quarantined.state is CommandState.QUARANTINED
        assert quarantined.outcome is CompletionOutcomeCode.OUTCOME_UNKNOWN
        assert isinstance(_lookup(evidence, replay_safe=True), Replay)
        assert isinstance(_lookup(evidence, replay_safe=True, attempts=3), Complete)
    failed_lookup = ProviderOutcome.unknown("lookup_unavailable")
    assert isinstance(_lookup(failed_lookup, replay_safe=False), LookupAgainAt)
    last = _lookup(failed_lookup, replay_safe=False, lookups=1)
    assert isinstance(last, Complete) and last.safe_error_code == "reconciliation_exhausted"


ROW = HandoffAttributes("o", "i", "c", "d", "ehk1:x", "rob_1", "effect-payload/v1:sha256:0")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"org_id": "o2"}, MismatchReason.SCOPE),
        ({"app_installation_id": "i2"}, MismatchReason.SCOPE),
        ({"runtime_capability_id": "c2"}, MismatchReason.SCOPE),
        ({"runtime_work_binding_digest": "d2"}, MismatchReason.SCOPE),
        ({"payload_digest": "p2"}, MismatchReason.PAYLOAD_DIGEST),
        ({"runtime_outbox_message_id": "rob_2"}, MismatchReason.OUTBOX_ID),
    ],
)
def test_every_validation_attribute_is_compared(
    change: dict[str, str], reason: MismatchReason
) -> None:
    assert mismatch(ROW, ROW) is None
    assert mismatch(ROW, replace(ROW, **change)) is reason


def _command(payload: dict[str, object]) -> ProviderCommand:
    return ProviderCommand("org", "cmd_1", "email.smtp", "nfx-abc", 1, payload)


def test_the_email_message_carries_the_idempotency_key_as_message_id() -> None:
    msg, to = build_message(
        _command(
            {"to": ["ada@example.com"], "template": "contact_welcome", "params": {"name": "Ada"}}
        ),
        sender="flows@example.org",
        message_id_domain="example.org",
    )
    assert msg["Message-ID"] == "<nfx-abc@example.org>"
    assert msg["Subject"] == "Welcome, Ada!" and to == ["ada@example.com"]
    plain, _ = build_message(
        _command({"to": "bob@example.com", "subject": "Hi", "text": "Body"}),
        sender="a@b",
        message_id_domain="b",
    )
    assert plain.get_content().strip() == "Body"


@pytest.mark.parametrize(
    "params",
    [{"name": "Ada"}, {"name": "Adä Lövelace " * 8}, {"name": "北京 " * 30}],
    ids=["ascii", "folded-latin", "folded-cjk"],
)
def test_the_cached_header_classes_change_nothing_in_the_message(
    params: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provider's policy keeps each header class it made; the bytes it sends are the
    stock ``email.policy.default`` message's, folded and encoded headers included."""
    command = _command(
        {"to": ["a@example.com", "b@example.com"], "template": "contact_welcome", "params": params}
    )
    monkeypatch.setattr(
        "effect_owner_svc.providers.email.formatdate", lambda **_: "Thu, 03 Dec 2026 05:00:00 GMT"
    )
    cached, _ = build_message(command, sender="flows@example.org", message_id_domain="x")
    cached_again, _ = build_message(command, sender="flows@example.org", message_id_domain="x")
    monkeypatch.setattr("effect_owner_svc.providers.email._POLICY", email.policy.default)
    stock, _ = build_message(command, sender="flows@example.org", message_id_domain="x")
    assert cached.as_bytes() == stock.as_bytes() == cached_again.as_bytes()
    assert cached.policy is not email.policy.default


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"to": "not an address", "subject": "x", "text": "y"},
        {"to": "a@b.c", "subject": "x\r\nBcc: eve@evil", "text": "y"},
        {"to": "a@b.c", "template": "unknown"},
        {"to": ["a@b.c"] * 51, "subject": "x", "text": "y"},
        {"to": "a@b.c\r\nBcc: eve@evil", "subject": "x", "text": "y"},
    ],
)
def test_bad_email_payloads_are_refused(payload: dict[str, object]) -> None:
    with pytest.raises(EmailPayloadError):
        build_message(_command(payload), sender="a@b", message_id_domain="b")


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, ProviderOutcomeKind.SUCCEEDED),
        (204, ProviderOutcomeKind.SUCCEEDED),
        (408, ProviderOutcomeKind.FAILED_RETRYABLE),
        (429, ProviderOutcomeKind.FAILED_RETRYABLE),
        (500, ProviderOutcomeKind.FAILED_RETRYABLE),
        (503, ProviderOutcomeKind.FAILED_RETRYABLE),
        (400, ProviderOutcomeKind.FAILED_TERMINAL),
        (404, ProviderOutcomeKind.FAILED_TERMINAL),
        (302, ProviderOutcomeKind.OUTCOME_UNKNOWN),
        (101, ProviderOutcomeKind.OUTCOME_UNKNOWN),
    ],
)
def test_webhook_status_classification(status: int, kind: ProviderOutcomeKind) -> None:
    assert classify_status(status).kind is kind


def test_provider_configuration() -> None:
    default = load_effect_owner_settings({})
    assert served_kinds(default) == {"email.smtp"}  # webhook needs a URL
    with_url = load_effect_owner_settings({"FLOW_EFFECT_WEBHOOK_URL": "http://h/x"})
    assert served_kinds(with_url) == {"email.smtp", "webhook.http"}
    assert parse_kind_map("a=x, b=y,", "V") == {"a": "x", "b": "y"}
    for bad in ("a", "a=", "=x", "a=x,a=y"):
        with pytest.raises(ConfigError):
            parse_kind_map(bad, "V")
    with pytest.raises(ConfigError):
        load_effect_owner_settings({"FLOW_EFFECT_PROVIDERS": "sms=twilio"})
