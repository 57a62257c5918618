"""Client JSON decoded within a nesting bound (issue 10, item 9)."""

from __future__ import annotations

import json

import pytest

from services.json_limits import MAX_JSON_DEPTH, JsonLimitError, json_depth, loads_bounded


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("{}", 1),
        ("1", 0),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[[[[[["}', 1),  # brackets inside strings do not count
        ('["\\"[[[", ["x"]]', 2),  # nor do escaped quotes end a string early
        ("[" * 10_000 + "]" * 10_000, 10_000),
    ],
)
def test_depth_is_measured_outside_strings(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_deep_text_is_refused_before_decoding() -> None:
    for text in ("[" * 200_000 + "]" * 200_000, '{"a":' * 5_000 + "1" + "}" * 5_000):
        with pytest.raises(JsonLimitError):
            loads_bounded(text)
    # Unbalanced: still refused, never a RecursionError.
    with pytest.raises(JsonLimitError):
        loads_bounded("[" * 100_000)


def test_the_bound_itself_decodes() -> None:
    text = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_bounded(text) == json.loads(text)
    with pytest.raises(JsonLimitError):
        loads_bounded("[" + text + "]")


def test_malformed_json_is_a_value_error_and_unclosed_strings_stay_linear() -> None:
    with pytest.raises(ValueError):
        loads_bounded('{"a": ')
    with pytest.raises(ValueError):
        loads_bounded('"' + "\\" * 100_001 + "x" * 1_000_000)
