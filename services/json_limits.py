"""JSON text from clients, decoded within documented limits.

``json.loads`` recurses once per nesting level: text nested a few thousand levels deep
raises ``RecursionError`` (which would surface as ``INTERNAL``), and text nested just
below the interpreter's limit decodes into a value every later walk (digests,
validation, checkpoint guards) would fail on. :func:`loads_bounded` measures the nesting
in linear time *before* decoding and refuses more than :data:`MAX_JSON_DEPTH` levels, so
Flow sources (``RegisterFlowVersion.source_json``) and run inputs
(``StartRun.input_json``) are either decoded into a value every part of the runtime can
walk, or refused ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "JsonLimitError", "json_depth", "loads_bounded"]

#: Deepest array/object nesting accepted in client JSON.
MAX_JSON_DEPTH = 64

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = str.maketrans({"[": "+", "{": "+", "]": "-", "}": "-"})


class JsonLimitError(ValueError):
    """The text nests deeper than allowed (a ``ValueError``, like a syntax error)."""


def json_depth(text: str) -> int:
    """The deepest array/object nesting of ``text`` (brackets inside strings ignored).

    Linear in the length of ``text``; for malformed text the result is an upper bound
    of what a decoder would see before failing.
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub('""', text))
    if not brackets:
        return 0
    steps = brackets.translate(_STEPS)
    return max(accumulate(1 if c == "+" else -1 for c in steps))


def loads_bounded(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` after checking its nesting.

    Raises:
        JsonLimitError: nested deeper than ``max_depth``.
        ValueError: not JSON (``json.JSONDecodeError``).
    """
    as_text = text.decode("utf-8") if isinstance(text, bytes) else text
    depth = json_depth(as_text)
    if depth > max_depth:
        raise JsonLimitError(f"JSON nests {depth} levels deep; at most {max_depth} are allowed")
    return json.loads(as_text)
