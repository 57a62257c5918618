"""Field validation of record writes against a :class:`~runtime_svc.records.view.RecordView`
(pure).

Every issue of a request is collected, then one :class:`RecordValidationError` is raised
(``INVALID_ARGUMENT``) whose ``field_path`` names the first offending field in sorted
order (``fields.<name>``, ``parent_refs[<i>]``, ``record_id``, …) and whose attributes map
every offending path to a safe code. Messages never echo submitted values: a field may
hold personal or secret data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from runtime_svc.records.model import (
    RECORD_ID_RE,
    MutationKind,
    ParentRef,
    RecordMutation,
    new_record_id,
)
from runtime_svc.records.view import (
    IMPLICIT_ID_FIELD,
    FieldRules,
    FieldType,
    ObjectRules,
    RecordView,
)
from services.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "MAX_SAFE_INTEGER",
    "RecordValidationError",
    "check_required",
    "parent_refs_of",
    "prepare_create",
    "prepare_delete",
    "prepare_transformed",
    "prepare_update",
    "references_of",
    "require_object",
    "validate_record_id",
]

#: Platform default maximum length (characters) when the view says 0.
DEFAULT_MAX_LENGTH: Mapping[FieldType, int] = {
    FieldType.STRING: 255,
    FieldType.TEXT: 131_072,
    FieldType.EMAIL: 254,
    FieldType.PICKLIST: 255,
    FieldType.MULTI_PICKLIST: 255,
}
#: Largest integer a ``google.protobuf.Value`` number (a double) carries exactly.
MAX_SAFE_INTEGER = 2**53 - 1

_TEXT_TYPES = frozenset({FieldType.STRING, FieldType.TEXT, FieldType.EMAIL})
_NUMBER_TYPES = frozenset({FieldType.DECIMAL, FieldType.CURRENCY})
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DATETIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})$")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


class RecordValidationError(InvalidArgumentError):
    """A record write breaks the rules of its metadata view.

    Attributes:
        issues: ``(path, code)`` pairs, sorted by path.
    """

    reason = "record_validation_failed"

    def __init__(self, issues: Iterable[tuple[str, str]]) -> None:
        self.issues = tuple(sorted(set(issues)))
        first = self.issues[0][0] if self.issues else ""
        message = "; ".join(f"{path}: {code}" for path, code in self.issues)
        super().__init__(
            message or "invalid record", field_path=first, attributes=dict(self.issues)
        )


class _Issues:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, code: str) -> None:
        self.items.append((path, code))

    def raise_any(self) -> None:
        if self.items:
            raise RecordValidationError(self.items)


def validate_record_id(value: str, path: str = "record_id") -> str:
    """``value`` when it is a well-formed record identity.

    Raises:
        RecordValidationError: it is not.
    """
    if not RECORD_ID_RE.match(value):
        raise RecordValidationError([(path, "invalid_record_id")])
    return value


def require_object(view: RecordView, object_name: str) -> ObjectRules:
    """The rules of ``object_name``.

    Raises:
        RecordValidationError: the view has no such object (path ``object_api_name``).
    """
    rules = view.object(object_name) if object_name else None
    if rules is None:
        raise RecordValidationError([("object_api_name", "unknown_object")])
    return rules


def _check_text(rule: FieldRules, value: str, path: str, issues: _Issues) -> None:
    limit = rule.max_length or DEFAULT_MAX_LENGTH.get(rule.type, 0)
    if limit and len(value) > limit:
        issues.add(path, "too_long")


def _check_number(rule: FieldRules, value: float | int, path: str, issues: _Issues) -> None:
    if rule.precision <= 0 or value == 0:
        return
    try:
        exponent = Decimal(repr(value)).normalize().as_tuple()
    except InvalidOperation:  # pragma: no cover - finite numbers always convert
        issues.add(path, "type_mismatch")
        return
    digits, exp = len(exponent.digits), int(exponent.exponent)
    fractional = max(-exp, 0)
    integral = max(digits + exp, 0)
    if fractional > rule.scale or integral > rule.precision - rule.scale:
        issues.add(path, "out_of_precision")


def _valid_date(value: str) -> bool:
    if not _DATE_RE.match(value):
        return False
    try:
        date.fromisoformat(value)
    except ValueError:
        return False
    return True


def _valid_datetime(value: str) -> bool:
    if not _DATETIME_RE.match(value):
        return False
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return parsed.tzinfo is not None


def _value(rule: FieldRules, value: Any, path: str, issues: _Issues) -> Any:
    """The normalized value, or ``None`` after recording an issue."""
    t = rule.type
    if t in _TEXT_TYPES:
        if not isinstance(value, str):
            issues.add(path, "type_mismatch")
            return None
        _check_text(rule, value, path, issues)
        if t is FieldType.EMAIL and not _EMAIL_RE.match(value):
            issues.add(path, "invalid_email")
        return value
    if t is FieldType.INTEGER:
        if isinstance(value, bool) or not isinstance(value, int | float):
            issues.add(path, "type_mismatch")
            return None
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            issues.add(path, "type_mismatch")
            return None
        number = int(value)
        if abs(number) > MAX_SAFE_INTEGER:
            issues.add(path, "out_of_range")
        return number
    if t in _NUMBER_TYPES:
        if isinstance(value, bool) or not isinstance(value, int | float):
            issues.add(path, "type_mismatch")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            issues.add(path, "type_mismatch")
            return None
        _check_number(rule, value, path, issues)
        return value
    if t is FieldType.BOOLEAN:
        if not isinstance(value, bool):
            issues.add(path, "type_mismatch")
        return value
    if t is FieldType.DATE:
        if not isinstance(value, str) or not _valid_date(value):
            issues.add(path, "type_mismatch")
        return value
    if t is FieldType.DATETIME:
        if not isinstance(value, str) or not _valid_datetime(value):
            issues.add(path, "type_mismatch")
        return value
    if t is FieldType.PICKLIST:
        if not isinstance(value, str):
            issues.add(path, "type_mismatch")
        elif value not in rule.picklist_values:
            issues.add(path, "not_in_picklist")
        return value
    if t is FieldType.MULTI_PICKLIST:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            issues.add(path, "type_mismatch")
            return None
        if len(set(value)) != len(value):
            issues.add(path, "duplicate_value")
        if any(v not in rule.picklist_values for v in value):
            issues.add(path, "not_in_picklist")
        return list(value)
    if t is FieldType.REFERENCE:
        if not isinstance(value, str) or not RECORD_ID_RE.match(value):
            issues.add(path, "invalid_reference")
        return value
    # FieldType.ID and anything unknown: never written through ``fields``.
    issues.add(path, "read_only")
    return None


def _fields(
    obj: ObjectRules, fields: Mapping[str, Any], issues: _Issues, *, creating: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted(fields):
        path = f"fields.{name}"
        rule = obj.field(name)
        if rule is None:
            issues.add(path, "unknown_field")
            continue
        if rule.read_only or name == IMPLICIT_ID_FIELD or rule.type is FieldType.ID:
            issues.add(path, "read_only")
            continue
        value = fields[name]
        if value is None:
            if rule.required:
                issues.add(path, "required")
            elif not creating:
                out[name] = None  # clears the field
            continue
        out[name] = _value(rule, value, path, issues)
    return out


def check_required(obj: ObjectRules, fields: Mapping[str, Any]) -> None:
    """Every required field of ``obj`` has a value in the record ``fields``.

    Raises:
        RecordValidationError: naming each missing field.
    """
    missing = [(f"fields.{n}", "required") for n in obj.required_fields() if fields.get(n) is None]
    if missing:
        raise RecordValidationError(missing)


def _merge_parent_refs(
    view: RecordView,
    object_name: str,
    parent_refs: Sequence[ParentRef],
    fields: dict[str, Any],
    issues: _Issues,
) -> None:
    seen: set[str] = set()
    for i, ref in enumerate(parent_refs):
        path = f"parent_refs[{i}]"
        rel = view.relationship(object_name, ref.relationship_name)
        if rel is None:
            issues.add(f"{path}.relationship_name", "unknown_relationship")
            continue
        if ref.parent_object != rel.parent_object:
            issues.add(f"{path}.parent_object_api_name", "wrong_parent_object")
            continue
        if not RECORD_ID_RE.match(ref.parent_record_id):
            issues.add(f"{path}.parent_record_id", "invalid_reference")
            continue
        if rel.name in seen:
            issues.add(path, "duplicate_relationship")
            continue
        seen.add(rel.name)
        given = fields.get(rel.field)
        if given is not None and given != ref.parent_record_id:
            issues.add(path, "conflicts_with_field")
            continue
        fields[rel.field] = ref.parent_record_id


def prepare_create(
    view: RecordView,
    object_name: str,
    record_id: str,
    fields: Mapping[str, Any],
    parent_refs: Sequence[ParentRef] = (),
) -> RecordMutation:
    """A validated CREATE; ``record_id`` empty means server-generated.

    A parent ref is another spelling of its relationship's lookup field on the child.

    Raises:
        RecordValidationError: every issue of the request at once.
    """
    obj = require_object(view, object_name)
    issues = _Issues()
    if record_id and not RECORD_ID_RE.match(record_id):
        issues.add("record_id", "invalid_record_id")
    values = _fields(obj, fields, issues, creating=True)
    _merge_parent_refs(view, object_name, parent_refs, values, issues)
    issues.raise_any()
    check_required(obj, values)
    return RecordMutation(
        MutationKind.CREATE, object_name, record_id or new_record_id(), values, None
    )


def _expected(expected_version: int | None, issues: _Issues) -> None:
    if expected_version is not None and expected_version < 1:
        issues.add("expected_version", "required")


def prepare_update(
    view: RecordView,
    object_name: str,
    record_id: str,
    expected_version: int | None,
    fields: Mapping[str, Any],
) -> RecordMutation:
    """A validated UPDATE (``None`` values clear).

    Raises:
        RecordValidationError: every issue of the request at once.
    """
    obj = require_object(view, object_name)
    issues = _Issues()
    if not RECORD_ID_RE.match(record_id):
        issues.add("record_id", "invalid_record_id")
    _expected(expected_version, issues)
    values = _fields(obj, fields, issues, creating=False)
    if not fields:
        issues.add("fields", "empty_update")
    issues.raise_any()
    return RecordMutation(MutationKind.UPDATE, object_name, record_id, values, expected_version)


#: Value types a validated field keeps unchanged (immutable scalars; a list may have been
#: changed in place, so it is always validated again).
_SCALARS = frozenset({str, int, float, bool, Decimal})


def _kept(validated: Any, value: Any) -> bool:
    """``value`` is the already-validated ``validated``: the same immutable scalar type
    and an equal value (validating it again would return it unchanged)."""
    t = type(value)
    return t is type(validated) and t in _SCALARS and validated == value


def prepare_transformed(
    view: RecordView,
    mutation: RecordMutation,
    start: Mapping[str, Any],
    final: Mapping[str, Any],
) -> RecordMutation:
    """The validated mutation that writes ``final``, the record a before-save transform
    produced from ``start`` (the stored values overlaid with ``mutation``'s; a create's
    ``start`` is ``mutation.fields``): a create writes every non-null value, an update
    the request's changes plus every field the transform changed.

    ``mutation`` must be the :func:`prepare_create` / :func:`prepare_update` result for
    the same ``view``: its values are validated already, so only what the transform
    changed is validated again (same type and equal immutable scalar: kept as is) — the
    same mutation, issues and normalisation as preparing the whole record again.

    Raises:
        RecordValidationError: every issue of the transformed record at once.
    """
    obj = require_object(view, mutation.object_name)
    issues = _Issues()
    base = mutation.fields
    if mutation.kind is MutationKind.CREATE:
        values: dict[str, Any] = {}
        changed: dict[str, Any] = {}
        for name, value in final.items():
            if value is None:
                continue  # a create writes non-null values only
            if name in base and _kept(base[name], value):
                values[name] = base[name]
            else:
                changed[name] = value
        values.update(_fields(obj, changed, issues, creating=True))
        issues.raise_any()
        check_required(obj, values)
        return RecordMutation(
            MutationKind.CREATE, mutation.object_name, mutation.record_id, _sorted(values), None
        )
    if mutation.kind is not MutationKind.UPDATE:
        raise ValueError(f"a {mutation.kind.value} is not transformed")
    # The request's own changes stay as validated; a field the transform changed (from
    # ``start``) is validated again, whether the request named it or not.
    delta = dict(base)
    touched = {
        name: value for name, value in final.items() if name not in start or start[name] != value
    }
    delta.update(_fields(obj, touched, issues, creating=False))
    issues.raise_any()
    return RecordMutation(
        MutationKind.UPDATE,
        mutation.object_name,
        mutation.record_id,
        _sorted(delta),
        mutation.expected_version,
    )


def _sorted(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` in name order (the order :func:`prepare_create` returns them in)."""
    return {name: values[name] for name in sorted(values)}


def prepare_delete(
    view: RecordView, object_name: str, record_id: str, expected_version: int | None
) -> RecordMutation:
    """A validated (soft) DELETE.

    Raises:
        RecordValidationError: the object, identity or version is malformed.
    """
    require_object(view, object_name)
    issues = _Issues()
    if not RECORD_ID_RE.match(record_id):
        issues.add("record_id", "invalid_record_id")
    _expected(expected_version, issues)
    issues.raise_any()
    return RecordMutation(MutationKind.DELETE, object_name, record_id, {}, expected_version)


def references_of(
    view: RecordView, object_name: str, fields: Mapping[str, Any]
) -> list[tuple[str, str | None]]:
    """``(lookup field, value)`` of every child relationship of ``object_name`` present
    in ``fields`` (values may be ``None`` for a cleared lookup)."""
    out: list[tuple[str, str | None]] = []
    for rel in view.child_relationships(object_name):
        if rel.field in fields:
            value = fields[rel.field]
            out.append((rel.field, value if isinstance(value, str) else None))
    return out


def parent_refs_of(
    view: RecordView, object_name: str, fields: Mapping[str, Any]
) -> tuple[ParentRef, ...]:
    """The parent refs a record with ``fields`` has, sorted by relationship name."""
    refs = []
    for rel in view.child_relationships(object_name):
        value = fields.get(rel.field)
        if isinstance(value, str) and value:
            refs.append(ParentRef(rel.name, rel.parent_object, value))
    return tuple(refs)
