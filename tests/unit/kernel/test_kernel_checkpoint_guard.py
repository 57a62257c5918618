"""Checkpoint payload validation (§5.4.6, §17.3; §22.6 "checkpoint rejects credential
material"): credential field names and value patterns at any depth, the size bound, and
errors that name the JSON path but never echo the value."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_svc.kernel.checkpoint_guard import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    _clean,
    _walk,
    find_credential_material,
    validate_checkpoint_payload,
)
from runtime_svc.kernel.model import CheckpointInput
from runtime_svc.kernel.store_rows import prepare_checkpoint
from services.digest import versioned_digest
from services.errors import InvalidArgumentError

FIELD_NAMES = [
    "password",
    "Password",
    "PASSWD",
    "db_password",
    "userPassword",
    "secret",
    "client_secret",
    "clientSecret",
    "token",
    "access_token",
    "refreshToken",
    "github_token",
    "x-auth-token",
    "api_key",
    "apiKey",
    "APIKey",
    "api-key",
    "apikey",
    "authorization",
    "Authorization",
    "private_key",
    "privateKey",
    "session_id",
    "sessionId",
    "cookie",
    "session_cookie",
    "Set-Cookie",
    "passphrase",
    "credentials",
    "aws_secret_access_key",
    "signing_key",
]

VALUES = {
    "bearer_token": "Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345",
    "basic_credentials": "Basic dXNlcm5hbWU6cGFzc3dvcmQ=",
    "workload_credential": "nfw1.eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl",
    "jwt": "token was eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA ...",
    "aws_access_key": "key AKIAIOSFODNN7EXAMPLE in use",
    "credential_parameter": "https://example.com/login?user=a&password=hunter2",
    "url_credentials": "postgres://admin:s3cr3t@db.internal:5432/app",
}


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_credential_field_names_are_rejected_case_insensitively_and_nested(name: str) -> None:
    payload = {"customer": {"profile": [{"ok": 1}, {name: "value-123"}]}}
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload(payload)
    assert err.value.reason == "checkpoint_credential_rejected"
    assert "value-123" not in err.value.safe_message
    assert "value-123" not in repr(err.value.attributes)
    assert err.value.attributes["rules"] == "credential_field"
    assert err.value.field_path.startswith("context_payload.customer.profile[1]")


@pytest.mark.parametrize(("rule", "value"), sorted(VALUES.items()))
def test_credential_value_patterns_are_rejected_without_echoing_them(rule: str, value: str) -> None:
    payload = {"notes": ["fine", {"text": value}]}
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload(payload)
    assert err.value.field_path == "context_payload.notes[1].text"
    assert err.value.attributes["rules"] == rule
    for fragment in ("hunter2", "s3cr3t", "AKIAIOSFODNN7EXAMPLE", "abcdefghijklmnop", "MIIE"):
        assert fragment not in err.value.safe_message
        assert fragment not in repr(err.value.attributes)


def test_a_key_that_is_itself_a_credential_is_redacted_in_the_path() -> None:
    payload = {"index": {"Bearer abcdefghijklmnopqrstuv": 1}}
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload(payload)
    assert err.value.field_path == "context_payload.index[<redacted key>]"
    assert "abcdefgh" not in err.value.safe_message


@pytest.mark.parametrize(
    "payload",
    [
        {"token_count": 12, "max_tokens": 4096, "primary_key": "id", "sort_key": "name"},
        {"cookie_consent": True, "secretary": "Ann", "passport_no": "X1"},
        {"has_password": True, "password": None, "api_key": "", "secret": {}},
        {"description": "the bearer of this letter", "basis": "Basic idea"},
        {"url": "https://example.com/path?page=2&sort=asc"},
        ["eyJ is a prefix", "AKIA too short", 1, 2.5, None],
    ],
)
def test_ordinary_business_data_is_accepted(payload: Any) -> None:
    assert validate_checkpoint_payload(payload)
    assert find_credential_material(payload) == []


def test_every_offender_is_reported_up_to_a_bound() -> None:
    payload = {"a": {"password": "x1"}, "b": [f"Bearer {'z' * 20}{i}" for i in range(20)]}
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload(payload)
    assert err.value.attributes["count"] == "21"
    assert len(err.value.attributes["paths"].split(",")) == 10


def test_size_bound_is_enforced_on_the_canonical_form() -> None:
    small = {"blob": "x" * 100}
    assert len(validate_checkpoint_payload(small, max_bytes=200)) <= 200
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload({"blob": "x" * 300}, max_bytes=200)
    assert err.value.reason == "checkpoint_too_large"
    assert err.value.attributes["max_bytes"] == "200"
    assert DEFAULT_MAX_CHECKPOINT_BYTES == 256 * 1024
    with pytest.raises(InvalidArgumentError):
        validate_checkpoint_payload({"blob": "x" * DEFAULT_MAX_CHECKPOINT_BYTES})


def test_values_without_a_json_form_and_absurd_nesting_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload({"when": object()})
    assert err.value.reason == "checkpoint_not_json"
    deep: Any = "leaf"
    for _ in range(100):
        deep = [deep]
    with pytest.raises(InvalidArgumentError):
        validate_checkpoint_payload(deep)


def test_the_field_name_prefixes_the_path() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        validate_checkpoint_payload({"password": "x"}, field="plan_cursor")
    assert err.value.field_path == "plan_cursor.password"


@pytest.mark.parametrize(
    "context",
    [
        {},
        {"b": 1, "a": {"z": [1, 2.5, -0.0, None, True], "é": "ünïcode ✓"}},
        {"variables": {"acct": {"Id": "rec_1", "Name": "n"}, "n": 10**20}},
    ],
)
def test_a_prepared_checkpoint_digests_the_context_as_versioned_digest_does(
    context: dict[str, Any],
) -> None:
    """``prepare_checkpoint`` digests the canonical bytes it already has; the digest is
    the one ``versioned_digest`` gives the context (what every reader recomputes)."""
    prepared = prepare_checkpoint(CheckpointInput(context=context), max_bytes=10_000)
    assert prepared.context_digest == versioned_digest("flow-context", context)
    assert prepared.context_json.encode() == validate_checkpoint_payload(context)


def test_a_repeated_field_name_is_judged_the_same_every_time() -> None:
    """The per-key rules are memoized (the same names recur in every step's context):
    a name is rejected or accepted the same on every walk, at any depth."""
    for _ in range(3):
        assert find_credential_material({"a": {"password": "x"}, "Name": "ok"}) != []
        assert [v.path for v in find_credential_material({"x": [{"apiKey": "v"}]})] == [
            "$.x[0].apiKey"
        ]
        assert find_credential_material({"Name": "ok", "Id": "rec_1"}) == []


_KEYS = st.sampled_from(["Name", "amount", "items", "note", "Id", *FIELD_NAMES[:8], "label"])
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(["", "Deal 5", "ok", *VALUES.values()]),
    st.text(max_size=12),
)
_PAYLOADS = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(_KEYS, children, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(payload=_PAYLOADS)
def test_the_fast_check_answers_as_the_full_walk(payload: Any) -> None:
    """``find_credential_material`` first asks a walk that builds no paths (issue 13);
    it must find something exactly when the reporting walk does."""
    assert _clean(payload, 0) == (list(_walk(payload, "$", 0)) == [])


def test_the_fast_check_refuses_what_is_too_deep() -> None:
    deep: Any = "x"
    for _ in range(200):
        deep = [deep]
    assert not _clean(deep, 0)
    assert [v.rule for v in find_credential_material(deep)] == ["too_deep"]
