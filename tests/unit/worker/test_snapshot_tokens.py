"""Pure parts of snapshot verification tokens (``runtime_svc.worker.snapshots``)."""

from __future__ import annotations

from runtime_svc.worker.snapshots import (
    SNAPSHOT_CHANGED,
    ReadToken,
    SnapshotChangedError,
    merge_tokens,
    parse_set,
    refresh_tokens,
    tokens_for,
)

A1 = ReadToken("Account", "a1", 3)
A2 = ReadToken("Account", "a2", None)


def test_merge_carries_previous_snapshots_and_dedupes_by_record() -> None:
    first = merge_tokens({}, "load", [A1, ReadToken("Account", "a1", 4), A2])
    assert first == {
        "format": 1,
        "snapshots": {
            "load": [
                {"object": "Account", "id": "a1", "version": 3},
                {"object": "Account", "id": "a2", "version": None},
            ]
        },
    }
    second = merge_tokens(parse_set(first), "other", [])
    assert parse_set(second) == {"load": (A1, A2), "other": ()}


def test_parse_ignores_absent_or_unknown_sets() -> None:
    assert parse_set(None) == {}
    assert parse_set({"format": 99, "snapshots": {"x": []}}) == {}
    assert parse_set("junk") == {}


def test_tokens_for_selects_verified_steps_in_canonical_order() -> None:
    snapshots = {"b": (A2,), "a": (A1,), "c": (ReadToken("Contact", "c1", 1),)}
    assert tokens_for(snapshots, ("b", "a")) == (A1, A2)
    assert tokens_for(snapshots, ("missing",)) == ()


def test_refresh_moves_own_writes_to_their_new_versions() -> None:
    out = refresh_tokens({"load": (A1, A2)}, {("Account", "a1"): 4})
    assert parse_set(out) == {"load": (ReadToken("Account", "a1", 4), A2)}
    assert refresh_tokens({}, {}) is None


def test_snapshot_changed_is_a_classified_step_fault() -> None:
    err = SnapshotChangedError(A1, None)
    assert err.code == SNAPSHOT_CHANGED
    assert "absent" in str(err)
