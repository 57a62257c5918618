"""ListRuns page tokens and stored idempotency keys: pure."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from runtime_svc.runs import PageCursor, PageTokenCodec, after_save_key, caller_key, start_key
from services.auth import TrustedRuntimeWorkScope
from services.errors import InvalidArgumentError

CURSOR = PageCursor(datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC), "run_1")


def test_token_round_trips() -> None:
    codec = PageTokenCodec(b"s")
    token = codec.encode("org-a", "f1", CURSOR)
    assert codec.decode("org-a", "f1", token) == CURSOR
    assert codec.decode("org-a", "f1", "") is None


@pytest.mark.parametrize(
    ("org", "filters", "secret"),
    [("org-b", "f1", b"s"), ("org-a", "f2", b"s"), ("org-a", "f1", b"other")],
)
def test_token_is_bound_to_org_filters_and_secret(org: str, filters: str, secret: bytes) -> None:
    token = PageTokenCodec(b"s").encode("org-a", "f1", CURSOR)
    with pytest.raises(InvalidArgumentError) as err:
        PageTokenCodec(secret).decode(org, filters, token)
    assert err.value.field_path == "page_token"


@pytest.mark.parametrize("token", ["x", "a.b", "....", "eyJ9.AAAA"])
def test_malformed_or_edited_tokens_are_rejected(token: str) -> None:
    with pytest.raises(InvalidArgumentError):
        PageTokenCodec(b"s").decode("org-a", "f1", token)


def test_edited_cursor_is_rejected() -> None:
    codec = PageTokenCodec(b"s")
    _body, mac = codec.encode("org-a", "f1", CURSOR).split(".")
    other_body = codec.encode("org-a", "f1", PageCursor(CURSOR.created_at, "run_2")).split(".")[0]
    with pytest.raises(InvalidArgumentError):
        codec.decode("org-a", "f1", f"{other_body}.{mac}")


SCOPE = TrustedRuntimeWorkScope("org", "inst", "cap", "b" * 100)


def test_start_keys_are_scoped_by_flow_and_work_scope_and_round_trip() -> None:
    a, b = start_key(SCOPE, "flow_a", "k/1"), start_key(SCOPE, "flow_b", "k/1")
    assert a != b and len(start_key(SCOPE, "f" * 255, "k" * 100)) <= 200
    assert caller_key(a) == caller_key(b) == "k/1"
    assert caller_key(None) == ""
    # Every component of the complete work scope keys it (issue 10, item 6).
    for other in (
        replace(SCOPE, org_id="org2"),
        replace(SCOPE, app_installation_id="inst2"),
        replace(SCOPE, runtime_capability_id="cap2"),
        replace(SCOPE, runtime_work_binding_digest="c"),
    ):
        assert start_key(other, "flow_a", "k/1") != a
    with pytest.raises(InvalidArgumentError) as err:
        start_key(SCOPE, "flow_a", "k" * 101)
    assert err.value.field_path == "idempotency_key"


def test_after_save_keys_follow_the_mutation_and_the_scope() -> None:
    base = after_save_key(SCOPE, "Contact", "003", 1, "welcome")
    assert base == after_save_key(SCOPE, "Contact", "003", 1, "welcome")
    assert base != after_save_key(SCOPE, "Contact", "003", 2, "welcome")
    assert base != after_save_key(replace(SCOPE, org_id="org2"), "Contact", "003", 1, "welcome")
    assert base != after_save_key(
        replace(SCOPE, app_installation_id="i2"), "Contact", "003", 1, "welcome"
    )
    assert base != after_save_key(SCOPE, "Contact", "003", 1, "other")
    assert caller_key(base) == "" and len(base) <= 200
