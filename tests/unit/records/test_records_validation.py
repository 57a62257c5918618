"""Field validation of record writes: every error names ``fields.<name>`` (or the request
field) with a safe code, and never echoes the submitted value."""

from __future__ import annotations

from typing import Any

import pytest

from runtime_svc.compiler.inputs import FieldView, MetadataViewInput, ObjectView, RelationshipView
from runtime_svc.records import (
    FieldRules,
    FieldType,
    MutationKind,
    ParentRef,
    RecordValidationError,
    RecordView,
    prepare_create,
    prepare_delete,
    prepare_update,
)
from runtime_svc.records.model import RECORD_ID_RE
from runtime_svc.records.validation import check_required, parent_refs_of, references_of

T = FieldType


def _view() -> RecordView:
    metadata = MetadataViewInput(
        digest="runtime_metadata_view/v1:sha256:" + "0" * 64,
        objects=(
            ObjectView("Account", (FieldView("Id", "id"), FieldView("Name", "string"))),
            ObjectView("Contact", (FieldView("Id", "id"), FieldView("AccountId", "reference"))),
        ),
        relationships=(
            RelationshipView("Account", "Account", "Contact", "AccountId", lock_parent=True),
            RelationshipView("Owner", "User", "Contact", "OwnerId"),
        ),
    )
    account = [
        FieldRules("Id", T.ID, read_only=True),
        FieldRules("Name", T.STRING, required=True, max_length=10),
        FieldRules("Notes", T.TEXT),
        FieldRules("Employees", T.INTEGER),
        FieldRules("Balance", T.DECIMAL, precision=6, scale=2),
        FieldRules("Active", T.BOOLEAN),
        FieldRules("Founded", T.DATE),
        FieldRules("SeenAt", T.DATETIME),
        FieldRules("Tier", T.PICKLIST, picklist_values=("Gold", "Silver")),
        FieldRules("Tags", T.MULTI_PICKLIST, picklist_values=("a", "b", "c")),
        FieldRules("Email", T.EMAIL),
        FieldRules("Fee", T.CURRENCY),
        FieldRules("Secret", T.STRING, read_only=True),
    ]
    contact = [
        FieldRules("Id", T.ID, read_only=True),
        FieldRules("AccountId", T.REFERENCE, reference_to="Account"),
        FieldRules("OwnerId", T.REFERENCE, reference_to="User"),
        FieldRules("LastName", T.STRING),
    ]
    return RecordView.build(
        metadata, [("Account", r) for r in account] + [("Contact", r) for r in contact]
    )


VIEW = _view()


def _issues(exc: pytest.ExceptionInfo[RecordValidationError]) -> dict[str, str]:
    return dict(exc.value.issues)


def test_valid_create_normalizes_and_generates_an_id() -> None:
    m = prepare_create(
        VIEW,
        "Account",
        "",
        {
            "Name": "Acme",
            "Employees": 12.0,
            "Balance": 1234.5,
            "Active": True,
            "Founded": "2020-02-29",
            "SeenAt": "2024-01-02T03:04:05.5Z",
            "Tier": "Gold",
            "Tags": ["a", "c"],
            "Email": "ops@acme.example",
            "Notes": None,
        },
    )
    assert m.kind is MutationKind.CREATE
    assert RECORD_ID_RE.match(m.record_id)
    assert m.fields["Employees"] == 12 and isinstance(m.fields["Employees"], int)
    assert "Notes" not in m.fields  # a null on create is simply no value


@pytest.mark.parametrize(
    ("fields", "path", "code"),
    [
        ({"Bogus": 1}, "fields.Bogus", "unknown_field"),
        ({"Employees": "12"}, "fields.Employees", "type_mismatch"),
        ({"Employees": 1.5}, "fields.Employees", "type_mismatch"),
        ({"Employees": True}, "fields.Employees", "type_mismatch"),
        ({"Employees": 2.0**60}, "fields.Employees", "out_of_range"),
        ({"Balance": "1"}, "fields.Balance", "type_mismatch"),
        ({"Balance": 1.234}, "fields.Balance", "out_of_precision"),
        ({"Balance": 12345.0}, "fields.Balance", "out_of_precision"),
        ({"Active": "yes"}, "fields.Active", "type_mismatch"),
        ({"Founded": "2021-02-29"}, "fields.Founded", "type_mismatch"),
        ({"Founded": "20210101"}, "fields.Founded", "type_mismatch"),
        ({"SeenAt": "2024-01-02T03:04:05"}, "fields.SeenAt", "type_mismatch"),
        ({"Tier": "Bronze"}, "fields.Tier", "not_in_picklist"),
        ({"Tier": 3}, "fields.Tier", "type_mismatch"),
        ({"Tags": ["a", "z"]}, "fields.Tags", "not_in_picklist"),
        ({"Tags": ["a", "a"]}, "fields.Tags", "duplicate_value"),
        ({"Tags": "a"}, "fields.Tags", "type_mismatch"),
        ({"Email": "not-an-address"}, "fields.Email", "invalid_email"),
        ({"Name": "x" * 11}, "fields.Name", "too_long"),
        ({"Notes": "x" * 131_073}, "fields.Notes", "too_long"),
        ({"Id": "acc-1"}, "fields.Id", "read_only"),
        ({"Secret": "hunter2"}, "fields.Secret", "read_only"),
        ({"Fee": float("inf")}, "fields.Fee", "type_mismatch"),
    ],
)
def test_each_rule_names_the_field(fields: dict[str, Any], path: str, code: str) -> None:
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Account", "a1", {"Name": "Acme", **fields})
    assert _issues(info) == {path: code}
    assert info.value.field_path == path
    assert info.value.code.name == "INVALID_ARGUMENT"
    for value in fields.values():
        if isinstance(value, str) and len(value) > 3:
            assert value not in info.value.safe_message


def test_all_issues_are_reported_at_once_sorted_by_path() -> None:
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Account", "bad id", {"Tier": "X", "Bogus": 1})
    assert _issues(info) == {
        "fields.Bogus": "unknown_field",
        "fields.Tier": "not_in_picklist",
        "record_id": "invalid_record_id",
    }
    assert info.value.field_path == "fields.Bogus"


def test_required_fields_on_create_and_on_clearing() -> None:
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Account", "a1", {"Employees": 3})
    assert _issues(info) == {"fields.Name": "required"}
    with pytest.raises(RecordValidationError) as info:
        prepare_update(VIEW, "Account", "a1", 1, {"Name": None})
    assert _issues(info) == {"fields.Name": "required"}
    with pytest.raises(RecordValidationError):
        check_required(VIEW.objects["Account"], {"Employees": 3})


def test_update_and_delete_requests() -> None:
    m = prepare_update(VIEW, "Account", "a1", 3, {"Notes": None, "Employees": 4})
    assert m.kind is MutationKind.UPDATE and m.expected_version == 3
    assert m.fields == {"Notes": None, "Employees": 4}
    with pytest.raises(RecordValidationError) as info:
        prepare_update(VIEW, "Account", "a1", 0, {})
    assert _issues(info) == {"expected_version": "required", "fields": "empty_update"}
    d = prepare_delete(VIEW, "Account", "a1", 2)
    assert d.kind is MutationKind.DELETE and d.fields == {}
    with pytest.raises(RecordValidationError) as info:
        prepare_delete(VIEW, "Account", "", 0)
    assert set(_issues(info)) == {"record_id", "expected_version"}


def test_unknown_object_names_the_object_field() -> None:
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Opportunity", "", {})
    assert info.value.field_path == "object_api_name"


def test_reference_format_and_parent_refs() -> None:
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Contact", "c1", {"AccountId": "has space"})
    assert _issues(info) == {"fields.AccountId": "invalid_reference"}

    m = prepare_create(VIEW, "Contact", "c1", {}, [ParentRef("Account", "Account", "a1")])
    assert m.fields == {"AccountId": "a1"}
    assert parent_refs_of(VIEW, "Contact", m.fields) == (ParentRef("Account", "Account", "a1"),)
    assert references_of(VIEW, "Contact", {"AccountId": "a1", "LastName": "x"}) == [
        ("AccountId", "a1")
    ]

    with pytest.raises(RecordValidationError) as info:
        prepare_create(
            VIEW,
            "Contact",
            "c1",
            {"AccountId": "a2"},
            [
                ParentRef("Account", "Account", "a1"),
                ParentRef("Nope", "Account", "a1"),
                ParentRef("Owner", "Account", "u1"),
                ParentRef("Owner", "User", "bad id"),
            ],
        )
    assert _issues(info) == {
        "parent_refs[0]": "conflicts_with_field",
        "parent_refs[1].relationship_name": "unknown_relationship",
        "parent_refs[2].parent_object_api_name": "wrong_parent_object",
        "parent_refs[3].parent_record_id": "invalid_reference",
    }


def test_view_from_the_compiler_model_keeps_types_and_references() -> None:
    view = RecordView.from_metadata_view(VIEW.metadata)
    account = view.objects["Account"]
    assert account.fields["Id"].read_only
    assert account.fields["Name"].type is FieldType.STRING
    assert view.objects["Contact"].fields["AccountId"].reference_to is None
    assert view.child_relationships("Contact")[0].name == "Account"
    assert view.relationship("Account", "Account") is None
