"""Value types of the ``RuntimeMetadataView`` and their JSON readers/writers.

Enum numbers mirror the proto; ``UNSPECIFIED = 0`` means "missing" and is never valid.
Validation of these values lives on :class:`~catalog_svc.domain.metadata_view.RuntimeMetadataView`
because most rules (references, duplicates) need the whole view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum

from . import _parse as p
from .diagnostics import Diagnostic, DiagnosticCode
from .ids import normalize_action_type

__all__ = [
    "ActionMetadata",
    "ActionParameter",
    "FieldSchema",
    "FieldType",
    "LockRelationship",
    "ObjectSchema",
    "TriggerEvent",
    "TriggerSubscription",
    "TriggerTiming",
    "field_to_dict",
    "object_to_dict",
    "parameter_to_dict",
    "read_action",
    "read_object_schema",
    "read_relationship",
    "read_trigger",
    "relationship_to_dict",
]


class FieldType(IntEnum):
    """Closed set of field/parameter data types (numbers mirror the proto ``FieldType``)."""

    UNSPECIFIED = 0
    STRING = 1
    TEXT = 2
    INTEGER = 3
    DECIMAL = 4
    BOOLEAN = 5
    DATE = 6
    DATETIME = 7
    PICKLIST = 8
    MULTI_PICKLIST = 9
    REFERENCE = 10
    EMAIL = 11
    CURRENCY = 12
    ID = 13


class TriggerTiming(IntEnum):
    """When a record trigger fires relative to the save."""

    UNSPECIFIED = 0
    BEFORE_SAVE = 1
    AFTER_SAVE = 2


class TriggerEvent(IntEnum):
    """Record events a subscription listens to."""

    UNSPECIFIED = 0
    CREATE = 1
    UPDATE = 2
    DELETE = 3


@dataclass(frozen=True, slots=True)
class FieldSchema:
    """One field of an object.

    Attributes:
        api_name: unique (case-insensitively) within its object.
        type: data type.
        required: a record cannot be saved without a value.
        max_length: STRING/TEXT/EMAIL only; ``None`` = platform default.
        precision: DECIMAL/CURRENCY only, total digits (1..38).
        scale: DECIMAL/CURRENCY only, fractional digits (0..precision); needs ``precision``.
        reference_object_api_name: REFERENCE only (required there); an object of the view.
        picklist_values: PICKLIST/MULTI_PICKLIST only (required there); unique, non-blank.
        read_only: generic record writes may not set the field (non-createable and
            non-updateable); never together with ``required``. False is left out of the
            canonical form, so views without read-only fields keep their digest.
    """

    api_name: str
    type: FieldType
    required: bool = False
    max_length: int | None = None
    precision: int | None = None
    scale: int | None = None
    reference_object_api_name: str | None = None
    picklist_values: tuple[str, ...] = ()
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class ObjectSchema:
    """One object and its fields.

    ``history_tracked`` objects keep field history, so a write also locks and reserves
    the record's history sequence in the compiled lock plan. False is left out of the
    canonical form (existing digests hold).
    """

    api_name: str
    fields: tuple[FieldSchema, ...] = ()
    history_tracked: bool = False

    def field(self, api_name: str) -> FieldSchema | None:
        """The field named exactly ``api_name``."""
        return next((f for f in self.fields if f.api_name == api_name), None)


@dataclass(frozen=True, slots=True)
class LockRelationship:
    """A lock-relevant parent/child relationship: mutating a child locks the parent first.

    ``child_field_api_name`` must be a REFERENCE field of the child targeting the parent.
    ``max_children`` is the largest number of children one parent has through it (the
    metadata-declared fan-out bound, 1..1000000); ``None`` means undeclared (fan-out over
    the relationship is unknown) and is left out of the canonical form.
    """

    child_object_api_name: str
    child_field_api_name: str
    parent_object_api_name: str
    max_children: int | None = None


@dataclass(frozen=True, slots=True)
class TriggerSubscription:
    """One record-trigger subscription of a Flow.

    ``(flow_api_name, object_api_name, timing)`` is unique within a view.
    ``entry_condition`` is kept verbatim (its language belongs to the Flow metadata);
    ``None`` means "always". ``dispatch_order`` orders the Flows of one object and timing
    (ascending, ties by Flow API name); 0 is the default and is left out of the
    canonical form, so views without an order keep their digest.
    """

    flow_api_name: str
    object_api_name: str
    timing: TriggerTiming
    events: tuple[TriggerEvent, ...]
    entry_condition: str | None = None
    dispatch_order: int = 0


@dataclass(frozen=True, slots=True)
class ActionParameter:
    """A typed input or output parameter of an action."""

    name: str
    type: FieldType
    required: bool = False
    is_collection: bool = False


@dataclass(frozen=True, slots=True)
class ActionMetadata:
    """Metadata the compiler resolves action elements against."""

    action_type: str
    label: str = ""
    description: str = ""
    inputs: tuple[ActionParameter, ...] = ()
    outputs: tuple[ActionParameter, ...] = ()

    def input_names(self) -> frozenset[str]:
        """Names of the declared input parameters."""
        return frozenset(i.name for i in self.inputs)


# -- JSON ----------------------------------------------------------------------------------

_OBJECT_KEYS = frozenset({"api_name", "fields", "history_tracked"})
_FIELD_KEYS = frozenset(
    {
        "api_name",
        "type",
        "required",
        "max_length",
        "precision",
        "scale",
        "reference_object_api_name",
        "picklist_values",
        "read_only",
    }
)
_REL_KEYS = frozenset(
    {"child_object_api_name", "child_field_api_name", "parent_object_api_name", "max_children"}
)
_TRIGGER_KEYS = frozenset(
    {"flow_api_name", "object_api_name", "timing", "events", "entry_condition", "dispatch_order"}
)
_ACTION_KEYS = frozenset({"action_type", "label", "description", "inputs", "outputs"})
_PARAM_KEYS = frozenset({"name", "type", "required", "is_collection"})


def field_to_dict(f: FieldSchema) -> dict[str, object]:
    return {
        "api_name": f.api_name,
        "type": p.enum_to_json(f.type),
        "required": f.required,
        "max_length": f.max_length,
        "precision": f.precision,
        "scale": f.scale,
        "reference_object_api_name": f.reference_object_api_name,
        "picklist_values": list(f.picklist_values),
        # Only when set: views published before the key existed keep their digest.
        **({"read_only": True} if f.read_only else {}),
    }


def object_to_dict(o: ObjectSchema) -> dict[str, object]:
    return {
        "api_name": o.api_name,
        "fields": [field_to_dict(f) for f in o.fields],
        **({"history_tracked": True} if o.history_tracked else {}),
    }


def relationship_to_dict(r: LockRelationship) -> dict[str, object]:
    return {
        "child_object_api_name": r.child_object_api_name,
        "child_field_api_name": r.child_field_api_name,
        "parent_object_api_name": r.parent_object_api_name,
        **({"max_children": r.max_children} if r.max_children is not None else {}),
    }


def parameter_to_dict(x: ActionParameter) -> dict[str, object]:
    return {
        "name": x.name,
        "type": p.enum_to_json(x.type),
        "required": x.required,
        "is_collection": x.is_collection,
    }


def read_object_schema(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> ObjectSchema | None:
    p.reject_unknown_keys(m, _OBJECT_KEYS, path, issues)
    name = p.get_str(m, "api_name", path, issues, required=True)
    fields = p.read_items(m, "fields", path, issues, _read_field)
    history = p.get_bool(m, "history_tracked", path, issues)
    return None if name is None else ObjectSchema(name, fields, history)


def _read_field(m: Mapping[str, object], path: str, issues: list[Diagnostic]) -> FieldSchema | None:
    p.reject_unknown_keys(m, _FIELD_KEYS, path, issues)
    name = p.get_str(m, "api_name", path, issues, required=True)
    ftype = p.get_enum(m, "type", FieldType, path, issues)
    required = p.get_bool(m, "required", path, issues)
    max_length = p.get_int(m, "max_length", path, issues, required=False)
    precision = p.get_int(m, "precision", path, issues, required=False)
    scale = p.get_int(m, "scale", path, issues, required=False)
    target = p.get_str(m, "reference_object_api_name", path, issues, required=False)
    values: list[str] = []
    pl_path = p.at(path, "picklist_values")
    for i, v in enumerate(p.get_list(m, "picklist_values", path, issues)):
        if isinstance(v, str):
            values.append(v)
        else:
            issues.append(
                Diagnostic(
                    p.index(pl_path, i),
                    DiagnosticCode.INVALID_TYPE,
                    "picklist value must be a string",
                )
            )
    read_only = p.get_bool(m, "read_only", path, issues)
    if name is None or ftype is None:
        return None
    return FieldSchema(
        name, ftype, required, max_length, precision, scale, target, tuple(values), read_only
    )


def read_relationship(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> LockRelationship | None:
    p.reject_unknown_keys(m, _REL_KEYS, path, issues)
    child = p.get_str(m, "child_object_api_name", path, issues, required=True)
    field = p.get_str(m, "child_field_api_name", path, issues, required=True)
    parent = p.get_str(m, "parent_object_api_name", path, issues, required=True)
    max_children = p.get_int(m, "max_children", path, issues, required=False)
    if child is None or field is None or parent is None:
        return None
    return LockRelationship(child, field, parent, max_children)


def read_trigger(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> TriggerSubscription | None:
    p.reject_unknown_keys(m, _TRIGGER_KEYS, path, issues)
    flow = p.get_str(m, "flow_api_name", path, issues, required=True)
    obj = p.get_str(m, "object_api_name", path, issues, required=True)
    timing = p.get_enum(m, "timing", TriggerTiming, path, issues)
    events: list[TriggerEvent] = []
    for i, raw in enumerate(p.get_list(m, "events", path, issues)):
        ev = p.enum_from_json(TriggerEvent, raw, p.index(p.at(path, "events"), i), issues)
        if ev is not None:
            events.append(ev)
    cond = p.get_str(m, "entry_condition", path, issues, required=False)
    order = p.get_int(m, "dispatch_order", path, issues, required=False)
    if flow is None or obj is None or timing is None:
        return None
    return TriggerSubscription(flow, obj, timing, tuple(events), cond, order or 0)


def _read_parameter(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> ActionParameter | None:
    p.reject_unknown_keys(m, _PARAM_KEYS, path, issues)
    name = p.get_str(m, "name", path, issues, required=True)
    ptype = p.get_enum(m, "type", FieldType, path, issues)
    required = p.get_bool(m, "required", path, issues)
    coll = p.get_bool(m, "is_collection", path, issues)
    if name is None or ptype is None:
        return None
    return ActionParameter(name, ptype, required, coll)


def read_action(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> ActionMetadata | None:
    p.reject_unknown_keys(m, _ACTION_KEYS, path, issues)
    action_type = p.get_str(m, "action_type", path, issues, required=True)
    label = p.get_str(m, "label", path, issues, required=False) or ""
    description = p.get_str(m, "description", path, issues, required=False) or ""
    inputs = p.read_items(m, "inputs", path, issues, _read_parameter)
    outputs = p.read_items(m, "outputs", path, issues, _read_parameter)
    if action_type is None:
        return None
    return ActionMetadata(normalize_action_type(action_type), label, description, inputs, outputs)
