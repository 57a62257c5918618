"""The record engine's view of one immutable RuntimeMetadataView.

:class:`RecordView` is the runtime's metadata-view model
(:class:`~runtime_svc.compiler.inputs.MetadataViewInput`: objects, fields, parent/child
relationships) plus the per-field write rules the record engine enforces (required, max
length, picklist values, precision/scale, read-only) that the compiler's model does not
carry. The API layer builds it from the catalog's ``MetadataView`` proto; code that only
has a :class:`MetadataViewInput` (tests, the compiler's JSON inputs) uses
:meth:`RecordView.from_metadata_view`, which knows types and references but no other
constraints.

Views are content-addressed (``digest``), hence immutable and safe to cache by digest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from runtime_svc.compiler.inputs import MetadataViewInput, ObjectView, RelationshipView

__all__ = [
    "IMPLICIT_ID_FIELD",
    "FieldRules",
    "FieldType",
    "ObjectRules",
    "RecordView",
]

#: The record identity field every object exposes; it is never written through ``fields``.
IMPLICIT_ID_FIELD = "Id"


class FieldType(StrEnum):
    """Value types of record fields (the catalog's ``FieldType``)."""

    STRING = "string"
    TEXT = "text"
    INTEGER = "integer"
    DECIMAL = "decimal"
    CURRENCY = "currency"
    BOOLEAN = "boolean"
    DATE = "date"
    DATETIME = "datetime"
    PICKLIST = "picklist"
    MULTI_PICKLIST = "multi_picklist"
    REFERENCE = "reference"
    EMAIL = "email"
    #: The implicit record identity (read-only).
    ID = "id"


#: The compiler's value types (``FieldView.type``) → record field types.
_FROM_COMPILER_TYPE: Mapping[str, FieldType] = {
    "string": FieldType.STRING,
    "number": FieldType.DECIMAL,
    "boolean": FieldType.BOOLEAN,
    "date": FieldType.DATE,
    "datetime": FieldType.DATETIME,
    "reference": FieldType.REFERENCE,
    "id": FieldType.ID,
}


@dataclass(frozen=True)
class FieldRules:
    """What a record write must satisfy for one field.

    Attributes:
        name: field API name.
        type: value type.
        required: a record cannot be saved without a value.
        max_length: maximum characters of a text value; 0 means the platform default.
        precision: total digits of a DECIMAL/CURRENCY value (0 = unchecked).
        scale: fractional digits of a DECIMAL/CURRENCY value.
        picklist_values: allowed values of PICKLIST/MULTI_PICKLIST.
        reference_to: target object of a REFERENCE.
        read_only: generic record writes may not set it.
    """

    name: str
    type: FieldType
    required: bool = False
    max_length: int = 0
    precision: int = 0
    scale: int = 0
    picklist_values: tuple[str, ...] = ()
    reference_to: str | None = None
    read_only: bool = False


@dataclass(frozen=True)
class ObjectRules:
    """The write rules of one object's fields."""

    api_name: str
    fields: Mapping[str, FieldRules]
    #: Derived answers, computed once per instance (the rules are immutable; every
    #: record write asks them).
    _memo: dict[str, tuple[str, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def field(self, name: str) -> FieldRules | None:
        """The named field's rules, or ``None``."""
        return self.fields.get(name)

    def required_fields(self) -> tuple[str, ...]:
        """Names of required fields, sorted."""
        names = self._memo.get("required")
        if names is None:
            names = tuple(sorted(n for n, f in self.fields.items() if f.required))
            self._memo["required"] = names
        return names


@dataclass(frozen=True)
class RecordView:
    """One metadata view as the record engine uses it.

    Attributes:
        metadata: the runtime's metadata-view model (objects, relationships, digest).
        objects: write rules per object API name.
    """

    metadata: MetadataViewInput
    objects: Mapping[str, ObjectRules] = field(default_factory=dict)
    #: :meth:`child_relationships` per object, computed once (the view is immutable and
    #: every record write asks it several times).
    _children: dict[str, tuple[RelationshipView, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: :meth:`lock_relevant` per object, computed once.
    _lock_relevant: dict[str, frozenset[str]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def digest(self) -> str:
        """Content digest of the view."""
        return self.metadata.digest

    def object(self, name: str) -> ObjectRules | None:
        """The named object's rules, or ``None``."""
        return self.objects.get(name)

    def child_relationships(self, object_name: str) -> tuple[RelationshipView, ...]:
        """Relationships in which ``object_name`` is the child, sorted by name."""
        rels = self._children.get(object_name)
        if rels is None:
            rels = tuple(
                sorted(
                    (r for r in self.metadata.relationships if r.child_object == object_name),
                    key=lambda r: r.name,
                )
            )
            self._children[object_name] = rels
        return rels

    def lock_relevant(self, object_name: str) -> frozenset[str]:
        """Names of the relationships whose parent a write of ``object_name`` locks."""
        names = self._lock_relevant.get(object_name)
        if names is None:
            names = frozenset(
                r.name for r in self.child_relationships(object_name) if r.lock_parent
            )
            self._lock_relevant[object_name] = names
        return names

    def relationship(self, object_name: str, name: str) -> RelationshipView | None:
        """The relationship ``name`` of child object ``object_name``, or ``None``."""
        return next((r for r in self.child_relationships(object_name) if r.name == name), None)

    def indexed_relationship(self, object_name: str) -> RelationshipView | None:
        """The relationship a record of ``object_name`` indexes its parent by whenever it
        has a value for it: the first lock-relevant one by name, else — when the object
        has no lock-relevant relationship — the first one (the rule of the record store's
        parent columns)."""
        rels = self.child_relationships(object_name)
        return next((r for r in rels if r.lock_parent), rels[0] if rels else None)

    @classmethod
    def build(
        cls, metadata: MetadataViewInput, rules: Iterable[tuple[str, FieldRules]]
    ) -> RecordView:
        """A view from the metadata model and ``(object, field rules)`` pairs."""
        objects: dict[str, dict[str, FieldRules]] = {o.api_name: {} for o in metadata.objects}
        for object_name, rule in rules:
            objects.setdefault(object_name, {})[rule.name] = rule
        return cls(
            metadata=metadata,
            objects={name: ObjectRules(name, fields) for name, fields in objects.items()},
        )

    @classmethod
    def from_metadata_view(cls, metadata: MetadataViewInput) -> RecordView:
        """A view from the compiler's model alone: types and references, no constraints."""
        return cls.build(metadata, _rules_of(metadata.objects))


def _rules_of(objects: Iterable[ObjectView]) -> Iterable[tuple[str, FieldRules]]:
    for o in objects:
        for f in o.fields:
            ftype = _FROM_COMPILER_TYPE.get(f.type, FieldType.STRING)
            read_only = ftype is FieldType.ID
            yield (
                o.api_name,
                FieldRules(
                    name=f.name, type=ftype, reference_to=f.reference_to, read_only=read_only
                ),
            )
