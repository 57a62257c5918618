"""Built-in pure-compute action handlers (§7.2 ``execution_class: pure_compute``).

A pure action reads only its evaluated inputs (``read_contract: checkpoint_only``), has no
effect, takes no lock and replays deterministically, so the interpreter may run it inline
in any profile — inside the caller's record transaction (Embedded Before-Save), inside the
one owned transaction (Bounded Atomic) or in a durable PureCompute step. The handlers are
platform code shipped with the runtime and keyed by the catalog ``action_type`` the
compiled plan names; an ``ActionCall`` of any other action type fails closed
(``unsupported_action``): effectful and transactional actions belong to later issues and
never run here. Every handler is total over its documented inputs and raises
:class:`PureActionError` (a classified, non-retryable step fault) otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["PURE_ACTIONS", "PureActionError", "run_pure_action"]


class PureActionError(Exception):
    """Bad input to a pure action (a deterministic, non-retryable failure)."""


def _text(inputs: Mapping[str, Any], name: str) -> str:
    value = inputs.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise PureActionError(f"input {name!r} must be text")
    return value


def _format_text(inputs: Mapping[str, Any]) -> str:
    """``format_text(text, style)``: ``upper`` | ``lower`` | ``title`` | ``trim`` | none."""
    text = _text(inputs, "text")
    style = _text(inputs, "style") or "none"
    styles: dict[str, Callable[[str], str]] = {
        "upper": str.upper,
        "lower": str.lower,
        "title": str.title,
        "trim": str.strip,
        "none": lambda s: s,
    }
    if style not in styles:
        raise PureActionError(f"unknown style {style!r}")
    return styles[style](text)


def _format_name(inputs: Mapping[str, Any]) -> str:
    """``core.format_name(first_name, last_name)``: trimmed, single-spaced full name."""
    parts = [_text(inputs, "first_name").strip(), _text(inputs, "last_name").strip()]
    return " ".join(p for p in parts if p)


def _score_opportunity(inputs: Mapping[str, Any]) -> int:
    """``score_opportunity(amount)``: 0-100, one point per 1,000 of amount (capped)."""
    raw = inputs.get("amount")
    if raw is None:
        return 0
    if isinstance(raw, bool):
        raise PureActionError("input 'amount' must be a number")
    try:
        amount = Decimal(str(raw))
    except InvalidOperation:
        raise PureActionError("input 'amount' must be a number") from None
    if amount <= 0:
        return 0
    return int(min(Decimal(100), amount // Decimal(1000)))


#: action_type -> handler over evaluated inputs.
PURE_ACTIONS: Mapping[str, Callable[[Mapping[str, Any]], Any]] = {
    "format_text": _format_text,
    "core.format_name": _format_name,
    "score_opportunity": _score_opportunity,
}


def run_pure_action(action_type: str, inputs: Mapping[str, Any]) -> Any:
    """Run the built-in pure handler of ``action_type``.

    Raises:
        KeyError: no built-in pure handler has that action type.
        PureActionError: the inputs are invalid.
    """
    return PURE_ACTIONS[action_type](inputs)
