"""Immutable, content-addressed ``RuntimeMetadataView`` (§7.1, §7.4).

The view is the only source of object/field schema, lock-relevant parent/child
relationships, trigger subscriptions and action metadata for compilation and V2 trigger
dispatch. Its digest (kind ``runtime_metadata_view``) is its identity: publishing the
same content twice yields the same digest.

Normalization (what "same content" means): every collection whose order carries no
meaning is sorted before digesting — objects and their fields by API name, picklist
values (a validity domain, not a display order), relationships, trigger subscriptions
and their events, actions and their parameters. Display labels of objects/fields are
deliberately not part of the view, so cosmetic relabelling does not recompile plans.

JSON shape (also what :meth:`RuntimeMetadataView.to_dict` emits, normalized; the optional
``read_only`` of a field, ``history_tracked`` of an object and ``max_children`` of a
relationship appear only when set, so views that do not use them keep their digest)::

    {"objects": [{"api_name": "Account", "fields": [
        {"api_name": "Name", "type": "string", "required": true, "max_length": 255,
         "precision": null, "scale": null, "reference_object_api_name": null,
         "picklist_values": []}]}],
     "relationships": [{"child_object_api_name": "Contact", "child_field_api_name": "AccountId",
                        "parent_object_api_name": "Account"}],
     "trigger_subscriptions": [{"flow_api_name": "Welcome", "object_api_name": "Contact",
                                "timing": "after_save", "events": ["create"],
                                "entry_condition": null}],
     "actions": [{"action_type": "core.send_email", "label": "Send e-mail", "description": "",
                  "inputs": [{"name": "to", "type": "string", "required": true,
                              "is_collection": false}], "outputs": []}]}

Enum values are the lower-case member names (the proto number is also accepted on input).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from services.digest import versioned_digest

from . import _parse as p
from ._checks import check_enum, check_text, check_unique
from .diagnostics import Diagnostic, DiagnosticCode, DomainValidationError
from .ids import (
    METADATA_VIEW_DIGEST_KIND,
    RuntimeMetadataViewDigest,
    check_action_type,
    normalize_action_type,
)
from .metadata_schema import (
    ActionMetadata,
    ActionParameter,
    FieldSchema,
    FieldType,
    LockRelationship,
    ObjectSchema,
    TriggerEvent,
    TriggerSubscription,
    TriggerTiming,
    object_to_dict,
    parameter_to_dict,
    read_action,
    read_object_schema,
    read_relationship,
    read_trigger,
    relationship_to_dict,
)

__all__ = ["MAX_TEXT_LENGTH", "RuntimeMetadataView"]

MAX_TEXT_LENGTH = 1 << 20
_MAX_DECIMAL_PRECISION = 38
_MAX_LABEL = 255
_MAX_DESCRIPTION = 4000
_MAX_CONDITION = 10_000
_MAX_DISPATCH_ORDER = 1_000_000
_MAX_CHILDREN = 1_000_000
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_NAME_MAX = 128
_FIXED_POINT = (FieldType.DECIMAL, FieldType.CURRENCY)
_PICKLISTS = (FieldType.PICKLIST, FieldType.MULTI_PICKLIST)


def _sort_key_trigger(t: TriggerSubscription) -> tuple[str, int, str, tuple[int, ...], str]:
    return (
        t.object_api_name,
        int(t.timing),
        t.flow_api_name,
        tuple(sorted(int(e) for e in t.events)),
        t.entry_condition or "",
    )


def _check_name(value: object, path: str, what: str, issues: list[Diagnostic]) -> None:
    if value is None or value == "":
        issues.append(Diagnostic(path, DiagnosticCode.MISSING_FIELD, f"{what} is required"))
    elif not isinstance(value, str):
        issues.append(Diagnostic(path, DiagnosticCode.INVALID_TYPE, f"{what} must be a string"))
    elif len(value) > _NAME_MAX or not _NAME_RE.match(value):
        issues.append(
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                f"{what} {value!r} must match [A-Za-z][A-Za-z0-9_]* "
                f"(at most {_NAME_MAX} characters)",
            )
        )


def _validate_field(
    f: FieldSchema, path: str, object_names: frozenset[str], issues: list[Diagnostic]
) -> None:
    _check_name(f.api_name, p.at(path, "api_name"), "field api_name", issues)
    if not check_enum(f.type, FieldType, p.at(path, "type"), issues):
        return
    t = f.type

    def only_for(attr: str, allowed: tuple[FieldType, ...]) -> bool:
        present = getattr(f, attr) not in (None, ())
        if present and t not in allowed:
            names = "/".join(a.name.lower() for a in allowed)
            issues.append(
                Diagnostic(
                    p.at(path, attr),
                    DiagnosticCode.INCONSISTENT,
                    f"{attr} is only allowed for {names} fields",
                )
            )
            return False
        return present

    if only_for("max_length", (FieldType.STRING, FieldType.TEXT, FieldType.EMAIL)):
        ml = f.max_length
        if isinstance(ml, bool) or not isinstance(ml, int) or not 1 <= ml <= MAX_TEXT_LENGTH:
            issues.append(
                Diagnostic(
                    p.at(path, "max_length"),
                    DiagnosticCode.OUT_OF_RANGE,
                    f"must be in [1, {MAX_TEXT_LENGTH}]",
                )
            )
    has_precision = only_for("precision", _FIXED_POINT)
    if has_precision and not (
        isinstance(f.precision, int)
        and not isinstance(f.precision, bool)
        and 1 <= f.precision <= _MAX_DECIMAL_PRECISION
    ):
        issues.append(
            Diagnostic(
                p.at(path, "precision"),
                DiagnosticCode.OUT_OF_RANGE,
                f"must be in [1, {_MAX_DECIMAL_PRECISION}]",
            )
        )
    if only_for("scale", _FIXED_POINT):
        if not has_precision:
            issues.append(
                Diagnostic(
                    p.at(path, "scale"), DiagnosticCode.INCONSISTENT, "scale needs precision"
                )
            )
        elif not (
            isinstance(f.scale, int)
            and not isinstance(f.scale, bool)
            and 0 <= f.scale <= (f.precision or 0)
        ):
            issues.append(
                Diagnostic(
                    p.at(path, "scale"), DiagnosticCode.OUT_OF_RANGE, "must be in [0, precision]"
                )
            )
    ref_path = p.at(path, "reference_object_api_name")
    if only_for("reference_object_api_name", (FieldType.REFERENCE,)):
        if f.reference_object_api_name not in object_names:
            issues.append(
                Diagnostic(
                    ref_path,
                    DiagnosticCode.DANGLING_REFERENCE,
                    f"reference target {f.reference_object_api_name!r} "
                    "is not an object of the view",
                )
            )
    elif t is FieldType.REFERENCE:
        issues.append(
            Diagnostic(
                ref_path, DiagnosticCode.MISSING_FIELD, "reference fields need a target object"
            )
        )
    pl_path = p.at(path, "picklist_values")
    if only_for("picklist_values", _PICKLISTS):
        values = []
        for i, v in enumerate(f.picklist_values):
            vp = p.index(pl_path, i)
            if not isinstance(v, str) or not v.strip():
                issues.append(
                    Diagnostic(
                        vp,
                        DiagnosticCode.INVALID_FORMAT,
                        "picklist values must be non-blank strings",
                    )
                )
            else:
                check_text(v, vp, _MAX_LABEL, issues)
                values.append((vp, v))
        check_unique(values, "picklist value", issues, fold=False)
    elif t in _PICKLISTS:
        issues.append(
            Diagnostic(
                pl_path, DiagnosticCode.MISSING_FIELD, "picklist fields need at least one value"
            )
        )
    if f.read_only is not False and not isinstance(f.read_only, bool):
        issues.append(
            Diagnostic(p.at(path, "read_only"), DiagnosticCode.INVALID_TYPE, "must be a boolean")
        )
    elif f.read_only and f.required:
        # A generic write can never supply it, so no record could ever be created.
        issues.append(
            Diagnostic(
                p.at(path, "read_only"),
                DiagnosticCode.INCONSISTENT,
                "a read_only field cannot be required",
            )
        )


def _validate_parameter(prm: ActionParameter, path: str, issues: list[Diagnostic]) -> None:
    _check_name(prm.name, p.at(path, "name"), "parameter name", issues)
    check_enum(prm.type, FieldType, p.at(path, "type"), issues)


@dataclass(frozen=True, slots=True)
class RuntimeMetadataView:
    """Objects, lock-relevant relationships, trigger subscriptions and action metadata.

    Construct through :meth:`from_dict` (validated and normalized) or directly followed
    by :meth:`validate`. The digest is computed over the normalized content, so two
    views that differ only in the order of unordered collections have the same digest.
    """

    objects: tuple[ObjectSchema, ...] = ()
    relationships: tuple[LockRelationship, ...] = ()
    trigger_subscriptions: tuple[TriggerSubscription, ...] = ()
    actions: tuple[ActionMetadata, ...] = ()

    # -- lookups -------------------------------------------------------------------------

    def get_object(self, api_name: str) -> ObjectSchema | None:
        """The object named exactly ``api_name``."""
        return next((o for o in self.objects if o.api_name == api_name), None)

    def get_action(self, action_type: str) -> ActionMetadata | None:
        """Metadata of the (normalized) action type."""
        wanted = normalize_action_type(action_type)
        return next((a for a in self.actions if a.action_type == wanted), None)

    # -- validation ----------------------------------------------------------------------

    def validate(self) -> list[Diagnostic]:
        """Every issue; paths index the collections in their current order."""
        issues: list[Diagnostic] = []
        object_names = frozenset(o.api_name for o in self.objects if isinstance(o.api_name, str))
        check_unique(
            [(p.index("objects", i), o.api_name) for i, o in enumerate(self.objects)],
            "object",
            issues,
        )
        for i, obj in enumerate(self.objects):
            path = p.index("objects", i)
            _check_name(obj.api_name, p.at(path, "api_name"), "object api_name", issues)
            fields_path = p.at(path, "fields")
            check_unique(
                [(p.index(fields_path, j), f.api_name) for j, f in enumerate(obj.fields)],
                "field",
                issues,
            )
            for j, f in enumerate(obj.fields):
                _validate_field(f, p.index(fields_path, j), object_names, issues)
        self._validate_relationships(issues)
        self._validate_triggers(object_names, issues)
        self._validate_actions(issues)
        return issues

    def _validate_relationships(self, issues: list[Diagnostic]) -> None:
        check_unique(
            [
                (
                    p.index("relationships", i),
                    (r.child_object_api_name, r.child_field_api_name, r.parent_object_api_name),
                )
                for i, r in enumerate(self.relationships)
            ],
            "relationship",
            issues,
            fold=False,
        )
        for i, rel in enumerate(self.relationships):
            path = p.index("relationships", i)
            bound = rel.max_children
            if bound is not None and (
                isinstance(bound, bool)
                or not isinstance(bound, int)
                or not 1 <= bound <= _MAX_CHILDREN
            ):
                issues.append(
                    Diagnostic(
                        p.at(path, "max_children"),
                        DiagnosticCode.OUT_OF_RANGE,
                        f"max_children must be within 1..{_MAX_CHILDREN} (or absent)",
                    )
                )
            child = self.get_object(rel.child_object_api_name)
            if child is None:
                issues.append(
                    Diagnostic(
                        p.at(path, "child_object_api_name"),
                        DiagnosticCode.DANGLING_REFERENCE,
                        f"child object {rel.child_object_api_name!r} is not an object of the view",
                    )
                )
            if self.get_object(rel.parent_object_api_name) is None:
                issues.append(
                    Diagnostic(
                        p.at(path, "parent_object_api_name"),
                        DiagnosticCode.DANGLING_REFERENCE,
                        f"parent object {rel.parent_object_api_name!r} "
                        "is not an object of the view",
                    )
                )
            if child is None:
                continue
            field = child.field(rel.child_field_api_name)
            field_path = p.at(path, "child_field_api_name")
            if field is None:
                issues.append(
                    Diagnostic(
                        field_path,
                        DiagnosticCode.DANGLING_REFERENCE,
                        f"field {rel.child_field_api_name!r} "
                        f"is not a field of {rel.child_object_api_name!r}",
                    )
                )
            elif (
                field.type is not FieldType.REFERENCE
                or field.reference_object_api_name != rel.parent_object_api_name
            ):
                issues.append(
                    Diagnostic(
                        field_path,
                        DiagnosticCode.INCONSISTENT,
                        f"field {rel.child_field_api_name!r} "
                        f"must be a reference to {rel.parent_object_api_name!r}",
                    )
                )

    def _validate_triggers(self, object_names: frozenset[str], issues: list[Diagnostic]) -> None:
        keys: list[tuple[str, object]] = []
        for i, trig in enumerate(self.trigger_subscriptions):
            path = p.index("trigger_subscriptions", i)
            _check_name(trig.flow_api_name, p.at(path, "flow_api_name"), "flow_api_name", issues)
            obj_path = p.at(path, "object_api_name")
            if trig.object_api_name not in object_names:
                issues.append(
                    Diagnostic(
                        obj_path,
                        DiagnosticCode.DANGLING_REFERENCE,
                        f"trigger on unknown object {trig.object_api_name!r}",
                    )
                )
            check_enum(trig.timing, TriggerTiming, p.at(path, "timing"), issues)
            events_path = p.at(path, "events")
            if not trig.events:
                issues.append(
                    Diagnostic(
                        events_path, DiagnosticCode.MISSING_FIELD, "at least one event is required"
                    )
                )
            ok_events: list[tuple[str, object]] = []
            for j, ev in enumerate(trig.events):
                if check_enum(ev, TriggerEvent, p.index(events_path, j), issues):
                    ok_events.append((p.index(events_path, j), ev))
            check_unique(ok_events, "event", issues, fold=False)
            cond = trig.entry_condition
            if cond is not None:
                cond_path = p.at(path, "entry_condition")
                if not isinstance(cond, str) or not cond.strip():
                    issues.append(
                        Diagnostic(
                            cond_path,
                            DiagnosticCode.INVALID_FORMAT,
                            "entry condition must be non-blank or absent",
                        )
                    )
                else:
                    check_text(cond, cond_path, _MAX_CONDITION, issues)
            order = trig.dispatch_order
            if isinstance(order, bool) or not isinstance(order, int):
                issues.append(
                    Diagnostic(
                        p.at(path, "dispatch_order"),
                        DiagnosticCode.INVALID_TYPE,
                        "dispatch_order must be an integer",
                    )
                )
            elif not 0 <= order <= _MAX_DISPATCH_ORDER:
                issues.append(
                    Diagnostic(
                        p.at(path, "dispatch_order"),
                        DiagnosticCode.OUT_OF_RANGE,
                        f"dispatch_order must be within 0..{_MAX_DISPATCH_ORDER}",
                    )
                )
            keys.append((path, (trig.flow_api_name, trig.object_api_name, trig.timing)))
        check_unique(keys, "trigger subscription (flow, object, timing)", issues, fold=False)

    def _validate_actions(self, issues: list[Diagnostic]) -> None:
        check_unique(
            [(p.index("actions", i), a.action_type) for i, a in enumerate(self.actions)],
            "action type",
            issues,
        )
        for i, act in enumerate(self.actions):
            path = p.index("actions", i)
            issues += check_action_type(act.action_type, p.at(path, "action_type"))
            if isinstance(act.action_type, str) and act.action_type != normalize_action_type(
                act.action_type
            ):
                issues.append(
                    Diagnostic(
                        p.at(path, "action_type"),
                        DiagnosticCode.INVALID_FORMAT,
                        "action type is not normalized",
                    )
                )
            check_text(act.label, p.at(path, "label"), _MAX_LABEL, issues)
            check_text(act.description, p.at(path, "description"), _MAX_DESCRIPTION, issues)
            for direction, params in (("inputs", act.inputs), ("outputs", act.outputs)):
                dpath = p.at(path, direction)
                check_unique(
                    [(p.index(dpath, j), x.name) for j, x in enumerate(params)], "parameter", issues
                )
                for j, prm in enumerate(params):
                    _validate_parameter(prm, p.index(dpath, j), issues)

    # -- normalization, JSON, digest -----------------------------------------------------

    def normalized(self) -> RuntimeMetadataView:
        """The same content with every unordered collection sorted."""

        def norm_field(f: FieldSchema) -> FieldSchema:
            return replace(f, picklist_values=tuple(sorted(f.picklist_values)))

        def norm_action(a: ActionMetadata) -> ActionMetadata:
            return replace(
                a,
                inputs=tuple(sorted(a.inputs, key=lambda x: x.name)),
                outputs=tuple(sorted(a.outputs, key=lambda x: x.name)),
            )

        return RuntimeMetadataView(
            objects=tuple(
                sorted(
                    (
                        replace(
                            o,
                            fields=tuple(
                                sorted((norm_field(f) for f in o.fields), key=lambda f: f.api_name)
                            ),
                        )
                        for o in self.objects
                    ),
                    key=lambda o: o.api_name,
                )
            ),
            relationships=tuple(
                sorted(
                    self.relationships,
                    key=lambda r: (
                        r.child_object_api_name,
                        r.child_field_api_name,
                        r.parent_object_api_name,
                    ),
                )
            ),
            trigger_subscriptions=tuple(
                sorted(
                    (
                        replace(t, events=tuple(sorted(t.events)))
                        for t in self.trigger_subscriptions
                    ),
                    key=_sort_key_trigger,
                )
            ),
            actions=tuple(
                sorted((norm_action(a) for a in self.actions), key=lambda a: a.action_type)
            ),
        )

    def to_dict(self) -> dict[str, object]:
        """Normalized JSON shape; also the canonical form that is digested."""
        v = self.normalized()
        return {
            "objects": [object_to_dict(o) for o in v.objects],
            "relationships": [relationship_to_dict(r) for r in v.relationships],
            "trigger_subscriptions": [
                {
                    "flow_api_name": t.flow_api_name,
                    "object_api_name": t.object_api_name,
                    "timing": p.enum_to_json(t.timing),
                    "events": [p.enum_to_json(e) for e in t.events],
                    "entry_condition": t.entry_condition,
                    **({"dispatch_order": t.dispatch_order} if t.dispatch_order else {}),
                }
                for t in v.trigger_subscriptions
            ],
            "actions": [
                {
                    "action_type": a.action_type,
                    "label": a.label,
                    "description": a.description,
                    "inputs": [parameter_to_dict(x) for x in a.inputs],
                    "outputs": [parameter_to_dict(x) for x in a.outputs],
                }
                for a in v.actions
            ],
        }

    def digest(self) -> RuntimeMetadataViewDigest:
        """Content digest over the normalized content (does not validate)."""
        return RuntimeMetadataViewDigest(
            versioned_digest(METADATA_VIEW_DIGEST_KIND, self.to_dict())
        )

    @classmethod
    def from_dict(cls, raw: object) -> RuntimeMetadataView:
        """Parse, validate and normalize the JSON shape.

        Raises:
            DomainValidationError: every shape and content issue, with paths indexing the
                input document.
        """
        issues: list[Diagnostic] = []
        m = p.expect_mapping(raw, "", issues)
        if m is None:
            raise DomainValidationError("runtime metadata view", tuple(issues))
        p.reject_unknown_keys(m, _VIEW_KEYS, "", issues)
        view = cls(
            objects=p.read_items(m, "objects", "", issues, read_object_schema),
            relationships=p.read_items(m, "relationships", "", issues, read_relationship),
            trigger_subscriptions=p.read_items(
                m, "trigger_subscriptions", "", issues, read_trigger
            ),
            actions=p.read_items(m, "actions", "", issues, read_action),
        )
        if not issues:
            issues = view.validate()
        if issues:
            raise DomainValidationError("runtime metadata view", tuple(issues))
        return view.normalized()


_VIEW_KEYS = frozenset({"objects", "relationships", "trigger_subscriptions", "actions"})
