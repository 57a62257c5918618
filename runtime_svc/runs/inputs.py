"""Input-variable validation of ``StartRun`` against a plan's declared inputs (§18.3).

Pure: no SQL, no protos. Every issue is collected, then one ``InvalidArgumentError``
names the first offending ``input_variables.<name>`` path (the message lists all), so a
client sees every mistake of its request at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime_svc.kernel.checkpoint_guard import validate_checkpoint_payload
from services.errors import InvalidArgumentError

__all__ = ["DeclaredVariable", "validate_input_variables"]

INPUT_FIELD = "input_variables"

_TEXT = frozenset({"string", "text", "id", "picklist", "date", "datetime", "time", "email"})
_NUMBER = frozenset({"number", "currency", "decimal", "double", "percent"})
_INTEGER = frozenset({"integer", "int", "long"})


@dataclass(frozen=True)
class DeclaredVariable:
    """A plan variable as ``StartRun`` sees it."""

    name: str
    type: str
    input: bool
    output: bool
    required: bool = False


def _type_ok(declared: str, value: Any) -> bool:
    t = declared.lower()
    if value is None:
        return True
    if t.endswith("[]") or t.startswith("collection"):
        return isinstance(value, list)
    if t in _TEXT:
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t in _INTEGER:
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if t in _NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool)
    # Records, apex-like types and anything the compiler adds later: any JSON value.
    return True


def validate_input_variables(
    variables: Sequence[DeclaredVariable],
    supplied: Mapping[str, Any],
    *,
    max_bytes: int,
) -> dict[str, Any]:
    """The validated input variables of a run.

    Args:
        variables: the plan's declared variables.
        supplied: the caller's input variables (decoded JSON).
        max_bytes: bound of the serialized inputs (the input checkpoint bound).

    Returns:
        A plain dict of the supplied inputs.

    Raises:
        InvalidArgumentError: an unknown or non-input name, a missing required input, a
            value of the wrong type (``field_path`` ``input_variables.<name>``), or
            credential material / oversize (checkpoint guard; path inside the value).
    """
    declared = {v.name: v for v in variables}
    issues: list[tuple[str, str]] = []
    for name in sorted(supplied):
        var = declared.get(name)
        if var is None or not var.input:
            issues.append((name, f"{name} is not a declared input variable"))
        elif not _type_ok(var.type, supplied[name]):
            issues.append((name, f"{name} must be of type {var.type}"))
    for var in sorted(variables, key=lambda v: v.name):
        if var.input and var.required and var.name not in supplied:
            issues.append((var.name, f"{var.name} is a required input variable"))
    if issues:
        raise InvalidArgumentError(
            "invalid input variables: " + "; ".join(m for _, m in issues),
            reason="invalid_input_variable",
            field_path=f"{INPUT_FIELD}.{issues[0][0]}",
        )
    # Credential material never reaches a checkpoint (§17.3); checked before any SQL.
    validate_checkpoint_payload(dict(supplied), max_bytes=max_bytes, field=INPUT_FIELD)
    return dict(supplied)
