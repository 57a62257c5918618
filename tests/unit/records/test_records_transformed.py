"""``prepare_transformed``: a before-save transform's record validated by re-checking only
what the transform changed — the same mutation, issues and normalisation as preparing the
whole record again (``prepare_create`` / ``prepare_update``), which it replaces on the
before-save hot path."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import pytest

from runtime_svc.compiler.inputs import FieldView, MetadataViewInput, ObjectView
from runtime_svc.records import (
    FieldRules,
    FieldType,
    MutationKind,
    RecordMutation,
    RecordValidationError,
    RecordView,
    prepare_create,
    prepare_delete,
    prepare_transformed,
    prepare_update,
)

T = FieldType
_RID = "rec_" + "a" * 26


def _view() -> RecordView:
    metadata = MetadataViewInput(
        digest="runtime_metadata_view/v1:sha256:" + "0" * 64,
        objects=(ObjectView("Deal", (FieldView("Id", "id"), FieldView("Name", "string"))),),
        relationships=(),
    )
    rules = [
        FieldRules("Id", T.ID, read_only=True),
        FieldRules("Name", T.STRING, required=True, max_length=10),
        FieldRules("Employees", T.INTEGER),
        FieldRules("Amount", T.DECIMAL, precision=8, scale=2),
        FieldRules("Active", T.BOOLEAN),
        FieldRules("Stage", T.PICKLIST, picklist_values=("New", "Won")),
        FieldRules("Tags", T.MULTI_PICKLIST, picklist_values=("a", "b", "c")),
        FieldRules("Secret", T.STRING, read_only=True),
    ]
    return RecordView.build(metadata, [("Deal", r) for r in rules])


VIEW = _view()


def _whole(mutation: RecordMutation, start: Mapping[str, Any], final: Mapping[str, Any]) -> Any:
    """What preparing the whole transformed record again returns (or raises)."""
    try:
        if mutation.kind is MutationKind.CREATE:
            values = {k: v for k, v in final.items() if v is not None}
            return prepare_create(VIEW, "Deal", mutation.record_id, values)
        delta = dict(mutation.fields)
        for name, value in final.items():
            if name not in start or start[name] != value:
                delta[name] = value
        return prepare_update(VIEW, "Deal", mutation.record_id, mutation.expected_version, delta)
    except RecordValidationError as exc:
        return exc.issues


def _subset(mutation: RecordMutation, start: Mapping[str, Any], final: Mapping[str, Any]) -> Any:
    try:
        return prepare_transformed(VIEW, mutation, start, final)
    except RecordValidationError as exc:
        return exc.issues


_CREATE = {"Name": "Acme", "Employees": 12, "Amount": 10.5, "Stage": "New", "Tags": ["a"]}

#: Transform results of the create above: unchanged, changed, added, cleared, retyped and
#: broken fields.
_CREATE_FINALS: list[dict[str, Any]] = [
    dict(_CREATE),
    {**_CREATE, "Amount": 9.45, "Stage": "Won"},
    {**_CREATE, "Active": True},
    {**_CREATE, "Employees": 12.0},  # equal, other type: normalised to 12 again
    {**_CREATE, "Employees": True},  # equal to 1? no — a bool is no integer
    {**_CREATE, "Amount": Decimal("10.5")},
    {**_CREATE, "Stage": None},  # cleared: a create writes only non-null values
    {**_CREATE, "Name": None},  # a required field cleared
    {**_CREATE, "Name": "far too long a name"},
    {**_CREATE, "Stage": "Lost"},
    {**_CREATE, "Tags": ["a", "z"]},
    {**_CREATE, "Secret": "x"},  # read-only
    {**_CREATE, "Unknown": 1},
    {**_CREATE, "Amount": float("nan")},
]


@pytest.mark.parametrize("final", _CREATE_FINALS)
def test_a_transformed_create_equals_the_whole_record_prepared_again(
    final: dict[str, Any],
) -> None:
    mutation = prepare_create(VIEW, "Deal", _RID, _CREATE)
    start = dict(mutation.fields)
    expected, got = _whole(mutation, start, final), _subset(mutation, start, final)
    assert got == expected
    if isinstance(got, RecordMutation):
        assert list(got.fields) == sorted(got.fields)  # prepare_create's order


_STORED = {"Name": "Acme", "Employees": 12, "Amount": 10.5, "Stage": "New", "Active": False}
_UPDATE = {"Employees": 13, "Stage": "Won"}

_UPDATE_FINALS: list[dict[str, Any]] = [
    {**_STORED, **_UPDATE},
    {**_STORED, **_UPDATE, "Amount": 1.25},  # a field the request did not name
    {**_STORED, **_UPDATE, "Employees": 14},  # a request field changed again
    {**_STORED, **_UPDATE, "Employees": 13.0},  # equal: the request's value stays
    {**_STORED, **_UPDATE, "Active": None},  # clears an optional field
    {**_STORED, **_UPDATE, "Name": None},  # clears a required one
    {**_STORED, **_UPDATE, "Stage": "Lost"},
    {**_STORED, **_UPDATE, "Secret": "x"},
    {**_STORED, **_UPDATE, "Tags": ["b", "b"]},
]


@pytest.mark.parametrize("final", _UPDATE_FINALS)
def test_a_transformed_update_equals_the_whole_record_prepared_again(
    final: dict[str, Any],
) -> None:
    mutation = prepare_update(VIEW, "Deal", _RID, 4, _UPDATE)
    start = {**_STORED, **mutation.fields}
    expected, got = _whole(mutation, start, final), _subset(mutation, start, final)
    assert got == expected
    if isinstance(got, RecordMutation):
        assert got.expected_version == 4 and got.record_id == _RID


def test_a_list_changed_in_place_is_validated_again() -> None:
    """A multi-picklist is a list: a transform may have changed the request's own list
    object, so equality with the validated value proves nothing — it is re-checked."""
    mutation = prepare_create(VIEW, "Deal", _RID, {"Name": "Acme", "Tags": ["a"]})
    start = dict(mutation.fields)
    final = dict(start)
    final["Tags"].append("z")  # the same list object the mutation holds
    with pytest.raises(RecordValidationError) as exc:
        prepare_transformed(VIEW, mutation, start, final)
    assert dict(exc.value.issues) == {"fields.Tags": "not_in_picklist"}


def test_a_delete_is_never_transformed() -> None:
    mutation = prepare_delete(VIEW, "Deal", _RID, 3)
    with pytest.raises(ValueError, match="delete"):
        prepare_transformed(VIEW, mutation, {}, {})
