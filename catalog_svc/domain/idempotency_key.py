"""Grammar of the idempotency key shape (§8.4 IdempotencyPolicy "required key shape").

A key shape is a template the runtime expands into the idempotency key of one action
invocation. Grammar (ABNF, RFC 5234)::

    key-shape   = 1*( literal / placeholder )        ; at most 512 characters
    literal     = 1*lchar
    lchar       = %x21-23 / %x25-7A / %x7C / %x7E    ; printable ASCII except SP $ { }
    placeholder = "${" ref "}"
    ref         = "input." name                      ; a declared input parameter
                / "run.id"                           ; the FlowRun id
                / "step.key"                         ; the stable plan step key
                / "step.invocation"                  ; invocation ordinal within the step
    name        = ALPHA *( ALPHA / DIGIT / "_" )

Rules on top of the grammar (checked by :func:`check_key_shape`):

- at least one placeholder: a constant key would collapse every invocation into one;
- for scopes wider than one run (``RUNTIME_WORK_SCOPE``, ``ORG``) at least one
  placeholder that differs between runs (``run.id`` or an ``input.*``), otherwise every
  run of the Flow would collide on the same key;
- ``input.*`` names must be declared inputs of the action when the bound metadata view
  is available (checked by the generation builder, code ``undeclared_input``).

Example: ``invoice:${input.invoice_id}:${step.invocation}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "CONTEXT_REFS",
    "MAX_KEY_SHAPE_LENGTH",
    "KeyShapeError",
    "KeyShapeSegment",
    "parse_key_shape",
    "shape_input_names",
]

MAX_KEY_SHAPE_LENGTH = 512
#: Placeholders that do not name an input parameter.
CONTEXT_REFS: frozenset[str] = frozenset({"run.id", "step.key", "step.invocation"})

_LITERAL_RE = re.compile(r"[!-#%-z|~]+")
_INPUT_REF_RE = re.compile(r"^input\.([A-Za-z][A-Za-z0-9_]*)$")


class KeyShapeError(ValueError):
    """The key shape does not match the grammar; the message names the offset."""


@dataclass(frozen=True, slots=True)
class KeyShapeSegment:
    """One parsed segment: exactly one of ``literal`` and ``ref`` is set."""

    literal: str | None = None
    ref: str | None = None


def parse_key_shape(shape: str) -> tuple[KeyShapeSegment, ...]:
    """Parse a key shape into literal and placeholder segments.

    Raises:
        KeyShapeError: the shape is empty, too long or not in the grammar.
    """
    if not shape:
        raise KeyShapeError("key shape is empty")
    if len(shape) > MAX_KEY_SHAPE_LENGTH:
        raise KeyShapeError(f"key shape is longer than {MAX_KEY_SHAPE_LENGTH} characters")
    segments: list[KeyShapeSegment] = []
    pos = 0
    while pos < len(shape):
        if shape.startswith("${", pos):
            end = shape.find("}", pos + 2)
            if end < 0:
                raise KeyShapeError(f"unterminated placeholder at offset {pos}")
            ref = shape[pos + 2 : end]
            if ref not in CONTEXT_REFS and not _INPUT_REF_RE.match(ref):
                raise KeyShapeError(
                    f"unknown placeholder ${{{ref}}} at offset {pos}; expected input.<name>, "
                    + ", ".join(sorted(CONTEXT_REFS))
                )
            segments.append(KeyShapeSegment(ref=ref))
            pos = end + 1
            continue
        m = _LITERAL_RE.match(shape, pos)
        if m is None:
            raise KeyShapeError(
                f"character {shape[pos]!r} at offset {pos} is not allowed "
                "(literals are printable ASCII without space, '$', '{', '}')"
            )
        segments.append(KeyShapeSegment(literal=m.group(0)))
        pos = m.end()
    return tuple(segments)


def shape_input_names(shape: str) -> frozenset[str]:
    """Input parameter names referenced by a (valid) key shape."""
    names: set[str] = set()
    for seg in parse_key_shape(shape):
        if seg.ref is not None:
            m = _INPUT_REF_RE.match(seg.ref)
            if m:
                names.add(m.group(1))
    return frozenset(names)
