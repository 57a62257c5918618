"""Pure tests of the catalog API layer: proto <-> domain mapping, request decoding, error
translation and the flowctl document parser (no database, no network)."""

from __future__ import annotations

import datetime as dt
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from catalog_svc.api import capability_mapping, mapping, requests, view_mapping
from catalog_svc.api.issues import catalog_error
from catalog_svc.domain import (
    CapabilityDescriptor,
    CatalogDiagnostic,
    DiagnosticCode,
    RuntimeMetadataView,
)
from catalog_svc.service import EntrySource, _entry_field
from flowctl.catalog import parse_build_document
from flowctl.common import CliError
from services.auth import TrustedIdentity, TrustedOrgContext, TrustedRuntimeWorkScope
from services.digest import versioned_digest
from services.errors import FailedPreconditionError, InvalidArgumentError
from services.proto import catalog_v1, common_v1
from services.request_dedupe import DedupeScope

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "catalog" / "demo.yaml"


def _demo() -> dict[str, object]:
    doc: dict[str, object] = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    return doc


def _descriptors() -> list[CapabilityDescriptor]:
    entries = _demo()["entries"]
    assert isinstance(entries, list)
    return [CapabilityDescriptor.from_dict(e["descriptor"]) for e in entries]


@pytest.mark.parametrize("index", range(5))
def test_descriptor_round_trips_through_the_proto(index: int) -> None:
    d = _descriptors()[index]
    back = capability_mapping.descriptor_from_proto(
        capability_mapping.descriptor_to_proto(d), "descriptor"
    )
    assert back.normalized() == d.normalized()
    assert back.digest() == d.digest()


def test_unknown_enum_number_names_the_field_and_lists_every_issue() -> None:
    proto = capability_mapping.descriptor_to_proto(_descriptors()[0])
    proto.read_contract = 42  # type: ignore[assignment]
    proto.minimum_capability_version = 0
    with pytest.raises(InvalidArgumentError) as err:
        capability_mapping.descriptor_from_proto(proto, "descriptor")
    assert err.value.field_path == "descriptor.read_contract"
    assert err.value.reason == "unknown_enum_value"
    assert "descriptor.minimum_capability_version:out_of_range" in err.value.attributes["issues"]
    assert "descriptor.read_contract:missing_field" not in err.value.attributes["issues"]


def test_view_round_trips_with_the_same_digest() -> None:
    raw = _demo()["metadata_view"]
    assert isinstance(raw, dict)
    view = RuntimeMetadataView.from_dict({k: v for k, v in raw.items() if k != "schema_generation"})
    proto = view_mapping.view_to_proto(
        view,
        org_id="o",
        app_installation_id="i",
        digest=view.digest(),
        schema_generation=3,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    back = view_mapping.view_from_proto(proto)
    assert back.digest() == view.digest()
    decimal = next(f for f in proto.objects[0].fields if f.api_name == "AnnualRevenue")
    assert (decimal.precision, decimal.scale) == (18, 2)


def test_view_keeps_a_decimal_scale_of_zero() -> None:
    proto = catalog_v1.MetadataView(
        objects=[
            catalog_v1.ObjectSchema(
                api_name="Order",
                fields=[
                    catalog_v1.FieldSchema(
                        api_name="Units",
                        type=catalog_v1.FieldType.FIELD_TYPE_DECIMAL,
                        precision=10,
                        scale=0,
                    )
                ],
            )
        ]
    )
    view = view_mapping.view_from_proto(proto)
    assert view.objects[0].fields[0].scale == 0


def test_view_ignores_labels() -> None:
    f = catalog_v1.FieldSchema(
        api_name="Name", type=catalog_v1.FieldType.FIELD_TYPE_STRING, label="Display name"
    )
    proto = catalog_v1.MetadataView(objects=[catalog_v1.ObjectSchema(api_name="A", fields=[f])])
    assert view_mapping.view_from_proto(proto).objects[0].fields[0].api_name == "Name"


def _gaps_view() -> catalog_v1.MetadataView:
    """Every contract-gap fact (issue 10 item 8) set once."""
    F = catalog_v1.FieldType
    return catalog_v1.MetadataView(
        objects=[
            catalog_v1.ObjectSchema(
                api_name="Account",
                history_tracked=True,
                fields=[
                    catalog_v1.FieldSchema(
                        api_name="Revenue", type=F.FIELD_TYPE_CURRENCY, precision=12, scale=2
                    ),
                    catalog_v1.FieldSchema(
                        api_name="ExternalKey", type=F.FIELD_TYPE_STRING, read_only=True
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
                    ),
                    catalog_v1.FieldSchema(api_name="Email", type=F.FIELD_TYPE_EMAIL),
                    catalog_v1.FieldSchema(
                        api_name="Tags",
                        type=F.FIELD_TYPE_MULTI_PICKLIST,
                        picklist_values=["vip", "press"],
                    ),
                ],
            ),
        ],
        relationships=[
            catalog_v1.Relationship(
                name="AccountId",
                parent_object_api_name="Account",
                child_object_api_name="Contact",
                child_field_api_name="AccountId",
                lock_relevant=True,
                max_children=50,
            )
        ],
    )


def test_contract_gap_facts_round_trip_through_the_domain() -> None:
    view = view_mapping.view_from_proto(_gaps_view())
    account = view.objects[0]
    assert account.history_tracked
    assert {f.api_name: f.read_only for f in account.fields} == {
        "ExternalKey": True,
        "Revenue": False,
    }
    assert view.relationships[0].max_children == 50
    back = view_mapping.view_to_proto(
        view,
        org_id="o",
        app_installation_id="i",
        digest=str(view.digest()),
        schema_generation=1,
        created_at=dt.datetime.now(dt.UTC),
    )
    assert back.objects[0].history_tracked
    assert back.relationships[0].max_children == 50
    fields = {f.api_name: f for o in back.objects for f in o.fields}
    assert fields["ExternalKey"].read_only
    assert fields["Email"].type == catalog_v1.FieldType.FIELD_TYPE_EMAIL
    assert fields["Revenue"].type == catalog_v1.FieldType.FIELD_TYPE_CURRENCY
    assert list(fields["Tags"].picklist_values) == ["press", "vip"]
    # The read-back publishes the same content: the same digest.
    assert view_mapping.view_from_proto(back).digest() == view.digest()


def test_each_contract_gap_fact_is_content() -> None:
    base = view_mapping.view_from_proto(_gaps_view()).digest()
    variants = []
    for mutate in (
        lambda v: setattr(v.objects[0], "history_tracked", False),
        lambda v: setattr(v.objects[0].fields[1], "read_only", False),
        lambda v: setattr(v.relationships[0], "max_children", 51),
        lambda v: setattr(v.relationships[0], "max_children", 0),
    ):
        proto = _gaps_view()
        mutate(proto)
        variants.append(view_mapping.view_from_proto(proto).digest())
    assert base not in variants
    assert len(set(variants)) == len(variants)


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (
            lambda v: setattr(v.relationships[0], "max_children", -1),
            "relationships[0].max_children",
        ),
        (
            lambda v: setattr(v.relationships[0], "max_children", 1_000_001),
            "relationships[0].max_children",
        ),
        (
            lambda v: setattr(v.objects[0].fields[1], "required", True),
            "objects[0].fields[1].read_only",
        ),
        (lambda v: v.objects[1].fields[2].ClearField("picklist_values"), "objects[1].fields[2]"),
        (lambda v: setattr(v.objects[1].fields[1], "precision", 5), "objects[1].fields[1]"),
        (lambda v: setattr(v.objects[0].fields[0], "type", 77), "objects[0].fields[0].type"),
    ],
)
def test_contract_gap_facts_are_validated(mutate: Any, path: str) -> None:
    proto = _gaps_view()
    mutate(proto)
    with pytest.raises(InvalidArgumentError) as err:
        view_mapping.view_from_proto(proto)
    assert f"view.{path}" in err.value.attributes["issues"]


def test_page_token_round_trips_and_is_bound_to_its_filters() -> None:
    digest = versioned_digest("catalog", {"a": 1})
    token = mapping.encode_page_token("gen-1", digest, "core.x")
    assert mapping.decode_page_token(token, "gen-1", digest) == "core.x"
    assert mapping.decode_page_token("", "gen-1", digest) is None
    for gid, d, t in (("gen-2", digest, token), ("gen-1", digest, "%%%"), ("gen-1", "x", token)):
        with pytest.raises(InvalidArgumentError) as err:
            mapping.decode_page_token(t, gid, d)
        assert err.value.field_path == "page_token"


def _submit(**fields: object) -> catalog_v1.SubmitEntryRequest:
    descriptor = capability_mapping.descriptor_to_proto(_descriptors()[0])
    req = catalog_v1.SubmitEntryRequest(
        action_type="core.format_name",
        source=catalog_v1.EntrySource.ENTRY_SOURCE_PLATFORM,
        descriptor=descriptor,
        handler_binding=common_v1.HandlerBinding(
            owner_registration_id="platform:core",
            handler_ref="python:x:y",
            handler_implementation_version="1",
        ),
    )
    for name, value in fields.items():
        setattr(req, name, value)
    return req


def test_entry_request_decodes_owner_handler_and_contract() -> None:
    decoded = requests.entry_request(_submit())
    assert decoded.source is EntrySource.PLATFORM
    assert decoded.owner_registration_id == "platform:core"
    assert decoded.handler is not None and decoded.handler.handler_ref == "python:x:y"

    contract = _submit(contract_only=True)
    contract.handler_binding.ClearField("handler_ref")
    contract.handler_binding.ClearField("handler_implementation_version")
    assert requests.entry_request(contract).handler is None


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"contract_only": True}, "handler_binding.handler_ref"),
        ({"source": 9}, "source"),
        ({"source": 0}, "source"),
        ({"action_type": ""}, "action_type"),
        ({"action_type": "x" * 300}, "action_type"),
    ],
)
def test_entry_request_refuses_inconsistent_fields(fields: dict[str, object], path: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        requests.entry_request(_submit(**fields))
    assert err.value.field_path == path


def test_distribution_entries_cannot_be_contract_only() -> None:
    req = _submit(source=catalog_v1.EntrySource.ENTRY_SOURCE_DISTRIBUTION, contract_only=True)
    with pytest.raises(InvalidArgumentError) as err:
        requests.entry_request(req)
    assert err.value.field_path == "contract_only"


def test_diagnostic_fields_translate_to_request_fields() -> None:
    assert _entry_field("owner.registration_id") == "handler_binding.owner_registration_id"
    assert _entry_field("owner.kind") == "source"
    assert _entry_field("owner") == "source"
    assert _entry_field("handler_binding.asserted_capability.fanout_bound") == (
        "descriptor.fanout_bound"
    )
    assert _entry_field("descriptor.read_contract") == "descriptor.read_contract"


def test_conflicts_are_failed_precondition_and_validation_is_invalid_argument() -> None:
    conflict = CatalogDiagnostic("a.b", "owner", DiagnosticCode.OWNER_CONFLICT, "taken")
    shape = CatalogDiagnostic("a.b", "descriptor.x", DiagnosticCode.MISSING_FIELD, "missing")
    err = catalog_error([conflict, shape], _entry_field)
    assert isinstance(err, FailedPreconditionError)
    assert (err.reason, err.field_path, err.attributes["entry"]) == (
        "owner_conflict",
        "source",
        "a.b",
    )
    assert isinstance(catalog_error([shape], _entry_field), InvalidArgumentError)


def test_reference_request_decoding() -> None:
    digest = versioned_digest("catalog", {"g": 1})
    ref = catalog_v1.ArtifactReference(
        catalog_generation=catalog_v1.GenerationTarget(
            catalog_generation_id="gen-1", catalog_digest=digest
        ),
        holder_kind=catalog_v1.ReferenceHolderKind.REFERENCE_HOLDER_KIND_NON_TERMINAL_RUN,
        holder_id="run-1",
    )
    decoded = requests.reference_request(ref, register=True)
    assert decoded.catalog_digest == digest and decoded.expires_at is None
    release = requests.reference_request(ref, register=False)
    assert release.identity == decoded.identity and release.catalog_digest is None
    ref.holder_kind = 17  # type: ignore[assignment]
    with pytest.raises(InvalidArgumentError) as err:
        requests.reference_request(ref, register=True)
    assert err.value.field_path == "reference.holder_kind"


def test_flowctl_parses_the_demo_document() -> None:
    plan = parse_build_document(_demo())
    assert (plan.org_id, plan.app_installation_id, plan.runtime_capability_id) == (
        "org-demo",
        "inst-demo",
        "cap-flow",
    )
    assert plan.view is not None and plan.view.schema_generation == 3
    sources = [e.source for e in plan.entries]
    assert sources[-1] == catalog_v1.EntrySource.ENTRY_SOURCE_DISTRIBUTION
    assert plan.entries[-2].contract_only and not plan.entries[-1].contract_only
    assert plan.entries[2].source == catalog_v1.EntrySource.ENTRY_SOURCE_EXTENSION


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(surprise=1), "unknown top-level keys"),
        (lambda d: d["binding"].update(org_id="x"), "binding: unknown keys"),
        (lambda d: d["entries"][0].update(source="pack"), "entries[0].source"),
        (lambda d: d["metadata_view"].pop("schema_generation"), "schema_generation"),
    ],
)
def test_flowctl_refuses_a_malformed_document(change: object, message: str) -> None:
    doc = _demo()
    change(doc)  # type: ignore[operator]
    with pytest.raises(CliError) as err:
        parse_build_document(doc)
    assert message in str(err.value)


def test_request_key_is_scoped_by_the_credential_and_needs_a_bounded_request_id() -> None:
    identity = TrustedIdentity(
        subject="t",
        audiences=("catalog",),
        org=TrustedOrgContext("org-1", "inst-1"),
        runtime_capability_id="cap-1",
        work_scope=TrustedRuntimeWorkScope("org-1", "inst-1", "cap-1", "b-1"),
        roles=frozenset(),
        key_id="k",
        issued_at=0,
        expires_at=1,
    )
    request = catalog_v1.OpenGenerationRequest(request_id="r")
    key = requests.request_key(identity, "OpenGeneration", request)
    assert (key.rpc, key.request_id) == ("OpenGeneration", "r")
    assert key.scope == DedupeScope("org-1", "inst-1", "cap-1", "b-1")
    for rid in ("", "   ", "x" * 201):
        with pytest.raises(InvalidArgumentError) as err:
            requests.request_key(
                identity, "OpenGeneration", catalog_v1.OpenGenerationRequest(request_id=rid)
            )
        assert err.value.field_path == "request_id"
