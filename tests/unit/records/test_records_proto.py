"""Proto mapping of the record API: catalog view → RecordView, RecordState → Record."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import json_format

from runtime_svc.api.records import record_proto, record_view_from_proto
from runtime_svc.records import FieldType, ParentRef, RecordState
from services.proto import catalog_v1

F = catalog_v1.FieldType


def _view() -> catalog_v1.MetadataView:
    return catalog_v1.MetadataView(
        runtime_metadata_view_digest="runtime_metadata_view/v1:sha256:" + "1" * 64,
        objects=[
            catalog_v1.ObjectSchema(
                api_name="Account",
                fields=[
                    catalog_v1.FieldSchema(api_name="Id", type=13),  # the catalog's ID type
                    catalog_v1.FieldSchema(
                        api_name="Name", type=F.FIELD_TYPE_STRING, required=True, max_length=9
                    ),
                    catalog_v1.FieldSchema(api_name="Future", type=99),
                    catalog_v1.FieldSchema(
                        api_name="Tags",
                        type=F.FIELD_TYPE_MULTI_PICKLIST,
                        picklist_values=["a", "b"],
                    ),
                ],
            ),
            catalog_v1.ObjectSchema(
                api_name="Contact",
                fields=[
                    catalog_v1.FieldSchema(
                        api_name="AccountId",
                        type=F.FIELD_TYPE_REFERENCE,
                        reference_object_api_name="Account",
                    )
                ],
            ),
        ],
        relationships=[
            catalog_v1.Relationship(
                name="AccountId",
                kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_MASTER_DETAIL,
                parent_object_api_name="Account",
                child_object_api_name="Contact",
                child_field_api_name="AccountId",
            ),
            catalog_v1.Relationship(
                name="Lookup",
                kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_LOOKUP,
                parent_object_api_name="Account",
                child_object_api_name="Contact",
                child_field_api_name="AccountId",
            ),
        ],
    )


def test_catalog_view_maps_to_write_rules() -> None:
    view = record_view_from_proto(_view())
    assert view.digest.endswith("1" * 64)
    account = view.objects["Account"]
    assert account.fields["Id"].type is FieldType.ID and account.fields["Id"].read_only
    assert account.fields["Name"].required and account.fields["Name"].max_length == 9
    assert account.fields["Future"].read_only  # unknown type: fail closed
    assert account.fields["Tags"].picklist_values == ("a", "b")
    contact = view.objects["Contact"]
    assert contact.fields["Id"].read_only  # implicit identity field added
    assert contact.fields["AccountId"].reference_to == "Account"
    rels = {r.name: r.lock_parent for r in view.child_relationships("Contact")}
    assert rels == {"AccountId": True, "Lookup": False}  # master-detail locks the parent
    assert [o.api_name for o in view.metadata.objects] == ["Account", "Contact"]


def test_record_state_maps_to_record() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)
    state = RecordState(
        org_id="org-1",
        object_name="Contact",
        record_id="c1",
        version=4,
        fields={"AccountId": "a1", "Count": 3, "Tags": ["x"], "Ok": True},
        parent_refs=(ParentRef("AccountId", "Account", "a1"),),
        is_deleted=True,
        created_at=at,
        updated_at=at,
    )
    msg = record_proto(state)
    assert (msg.org_id, msg.object_api_name, msg.record_id, msg.version) == (
        "org-1",
        "Contact",
        "c1",
        4,
    )
    assert json_format.MessageToDict(msg.fields) == {
        "AccountId": "a1",
        "Count": 3.0,
        "Tags": ["x"],
        "Ok": True,
    }
    assert msg.parent_refs[0].parent_object_api_name == "Account"
    assert msg.is_deleted
    assert msg.created_at.ToDatetime(tzinfo=UTC) == at
