"""Canonical JSON and versioned digests."""

from __future__ import annotations

import math
from enum import IntEnum, StrEnum
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.digest import (
    _ENCODER,
    CanonicalJsonError,
    _normalize,
    canonical_json,
    is_digest,
    parse_digest,
    versioned_digest,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_identical_inputs_in_any_key_order_give_identical_digests(value: Any) -> None:
    assert versioned_digest("t", value) == versioned_digest("t", _reverse_keys(value))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), json_scalars, min_size=1, max_size=6), st.data())
def test_any_changed_field_changes_the_digest(value: dict[str, Any], data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(value)))
    changed = dict(value)
    changed[key] = [value[key]]  # a different JSON value for that one field
    assert versioned_digest("t", value) != versioned_digest("t", changed)
    renamed = {(k + "_" if k == key else k): v for k, v in value.items()}
    assert versioned_digest("t", value) != versioned_digest("t", renamed)


def test_kind_and_version_separate_domains() -> None:
    v = {"a": 1}
    assert versioned_digest("plan", v) != versioned_digest("binding", v)
    assert versioned_digest("plan", v, version=1) != versioned_digest("plan", v, version=2)
    d = versioned_digest("plan", v, version=2)
    assert is_digest(d, "plan") and not is_digest(d, "binding")
    assert parse_digest(d)[:2] == ("plan", 2)


def test_canonical_form_is_compact_sorted_utf8() -> None:
    assert canonical_json({"b": [1, "é"], "a": None}) == '{"a":null,"b":[1,"é"]}'.encode()


@pytest.mark.parametrize("bad", [{"x": math.nan}, {"x": b"raw"}, {1: "int key"}, {"x": {1, 2}}])
def test_values_without_canonical_form_are_rejected(bad: Any) -> None:
    with pytest.raises(CanonicalJsonError):
        canonical_json(bad)


def _general(value: Any) -> bytes:
    """The canonical form by the general walk alone (the reference of the fast path)."""
    return _ENCODER.encode(_normalize(value, "$")).encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(json_values | st.tuples(json_values, json_values))
def test_the_plain_fast_path_encodes_exactly_as_the_general_walk(value: Any) -> None:
    assert canonical_json(value) == _general(value)


class _Color(StrEnum):
    RED = "red"


class _Size(IntEnum):
    BIG = 3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"x": -0.0, "y": [0.0, -0.0]}, b'{"x":0.0,"y":[0.0,0.0]}'),
        ({"c": _Color.RED, "s": _Size.BIG}, b'{"c":"red","s":3}'),
        ({_Color.RED: 1}, b'{"red":1}'),
        (MappingProxyType({"b": (1, 2), "a": True}), b'{"a":true,"b":[1,2]}'),
        ([{"k": MappingProxyType({"z": None})}], b'[{"k":{"z":null}}]'),
    ],
)
def test_values_the_fast_path_leaves_to_the_general_walk_encode_as_before(
    value: Any, expected: bytes
) -> None:
    assert canonical_json(value) == expected == _general(value)


def test_a_rejected_value_nested_in_plain_ones_is_named_by_its_path() -> None:
    with pytest.raises(CanonicalJsonError, match=r"\$\.a\[1\]\.b: non-finite float"):
        canonical_json({"a": [1, {"b": math.inf}]})
