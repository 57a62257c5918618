"""Capability descriptor and submission validation: every diagnostic names entry and field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from catalog_svc.domain import (
    CapabilityDescriptor,
    CatalogDiagnostic,
    CatalogEntrySubmission,
    DiagnosticCode,
    DomainValidationError,
    ExecutionClass,
    IdempotencyScope,
)
from services.digest import versioned_digest
from tests.unit.catalog.factories import (
    INVOICE,
    effect_descriptor_dict,
    mutation_descriptor_dict,
    patch,
    submission,
    submission_dict,
)

ELEVEN_FIELDS = [
    "execution_class",
    "transaction_policy",
    "replay_policy",
    "fanout_bound",
    "read_contract",
    "lock_plan_contract",
    "effect_owner",
    "idempotency_policy",
    "output_durability",
    "security_policy",
    "minimum_capability_version",
]


def _shape_issues(raw: dict[str, Any]) -> set[tuple[str, str, DiagnosticCode]]:
    with pytest.raises(DomainValidationError) as err:
        CatalogEntrySubmission.from_dict(raw)
    out = set()
    for d in err.value.issues:
        assert isinstance(d, CatalogDiagnostic)
        out.add((d.entry, d.field, d.code))
    return out


def _field_issues(**kwargs: Any) -> set[tuple[str, str, DiagnosticCode]]:
    return {(d.entry, d.field, d.code) for d in submission(**kwargs).validate()}


def test_reference_descriptors_are_valid_and_cover_all_eleven_fields() -> None:
    for raw in (effect_descriptor_dict(), mutation_descriptor_dict()):
        desc = CapabilityDescriptor.from_dict(raw)
        assert desc.validate() == []
        assert sorted(desc.to_dict()) == sorted(ELEVEN_FIELDS)
    assert submission().validate() == []
    assert submission(effect=False).validate() == []


@pytest.mark.parametrize("field", ELEVEN_FIELDS)
def test_missing_field_names_entry_and_field(field: str) -> None:
    raw = submission_dict(descriptor_changes={field: ...}, handler=False)
    assert _shape_issues(raw) == {(INVOICE, f"descriptor.{field}", DiagnosticCode.MISSING_FIELD)}


@pytest.mark.parametrize(
    "field",
    [
        "execution_class",
        "transaction_policy",
        "replay_policy",
        "fanout_bound.kind",
        "read_contract",
        "lock_plan_contract.kind",
        "effect_owner.owner_class",
        "idempotency_policy.uniqueness_scope",
        "output_durability",
        "security_policy.principal_mode",
        "security_policy.reauthorization_policy",
    ],
)
@pytest.mark.parametrize("bad", ["sometimes", 42])
def test_unknown_enum_value_names_entry_and_field(field: str, bad: Any) -> None:
    raw = submission_dict(descriptor_changes={field: bad}, handler=False)
    assert _shape_issues(raw) == {
        (INVOICE, f"descriptor.{field}", DiagnosticCode.UNKNOWN_ENUM_VALUE)
    }


@pytest.mark.parametrize(
    ("changes", "effect", "field", "code"),
    [
        ({"execution_class": 0}, True, "descriptor.execution_class", DiagnosticCode.MISSING_FIELD),
        (
            {"fanout_bound.kind": "static_maximum"},
            True,
            "descriptor.fanout_bound.static_maximum",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"fanout_bound.static_maximum": 0},
            False,
            "descriptor.fanout_bound.static_maximum",
            DiagnosticCode.OUT_OF_RANGE,
        ),
        (
            {"fanout_bound.metadata_path": "input..cc"},
            True,
            "descriptor.fanout_bound.metadata_path",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"fanout_bound.metadata_path": "x"},
            False,
            "descriptor.fanout_bound.metadata_path",
            DiagnosticCode.INCONSISTENT,
        ),
        ({"read_contract": 0}, False, "descriptor.read_contract", DiagnosticCode.MISSING_FIELD),
        (
            {
                "lock_plan_contract.kind": "late_discovery_allowed",
                "lock_plan_contract.static_keys": [],
                "lock_plan_contract.max_keys": ...,
            },
            False,
            "descriptor.lock_plan_contract.max_keys",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {
                "lock_plan_contract.kind": "metadata_derived_keys",
                "lock_plan_contract.static_keys": [],
                "lock_plan_contract.resource_classes": [],
            },
            False,
            "descriptor.lock_plan_contract.resource_classes",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"lock_plan_contract.kind": "metadata_derived_keys"},
            False,
            "descriptor.lock_plan_contract.static_keys",
            DiagnosticCode.INCONSISTENT,
        ),
        (
            {"lock_plan_contract.resource_classes": ["record"]},
            False,
            "descriptor.lock_plan_contract.static_keys[1].resource_class",
            DiagnosticCode.INCONSISTENT,
        ),
        (
            {"lock_plan_contract.max_keys": 1},
            False,
            "descriptor.lock_plan_contract.max_keys",
            DiagnosticCode.OUT_OF_RANGE,
        ),
        (
            {"lock_plan_contract.resource_classes": ["record", "parent", "record"]},
            False,
            "descriptor.lock_plan_contract.resource_classes[2]",
            DiagnosticCode.DUPLICATE_NAME,
        ),
        (
            {"lock_plan_contract.max_keys": 3},
            True,
            "descriptor.lock_plan_contract.max_keys",
            DiagnosticCode.INCONSISTENT,
        ),
        (
            {"effect_owner.effect_owner_kind": ...},
            True,
            "descriptor.effect_owner.effect_owner_kind",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"effect_owner.effect_owner_kind": "https://mail.example"},
            True,
            "descriptor.effect_owner.effect_owner_kind",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"effect_owner.effect_owner_kind": "email"},
            False,
            "descriptor.effect_owner.effect_owner_kind",
            DiagnosticCode.INCONSISTENT,
        ),
        (
            {"idempotency_policy.key_shape": "invoice ${input.invoice_id}"},
            True,
            "descriptor.idempotency_policy.key_shape",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"idempotency_policy.key_shape": ...},
            True,
            "descriptor.idempotency_policy.key_shape",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"idempotency_policy.uniqueness_scope": ...},
            True,
            "descriptor.idempotency_policy.uniqueness_scope",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"idempotency_policy.uniqueness_scope": "flow_run"},
            False,
            "descriptor.idempotency_policy.uniqueness_scope",
            DiagnosticCode.INCONSISTENT,
        ),
        (
            {"security_policy.principal_mode": 0},
            True,
            "descriptor.security_policy.principal_mode",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"output_durability": 0},
            False,
            "descriptor.output_durability",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"minimum_capability_version": 0},
            True,
            "descriptor.minimum_capability_version",
            DiagnosticCode.OUT_OF_RANGE,
        ),
    ],
)
def test_invalid_field_value_names_entry_and_field(
    changes: dict[str, Any], effect: bool, field: str, code: DiagnosticCode
) -> None:
    raw = submission_dict(descriptor_changes=changes, effect=effect, handler=False)
    try:
        found = {
            (d.entry, d.field, d.code) for d in CatalogEntrySubmission.from_dict(raw).validate()
        }
    except DomainValidationError as err:  # UNSPECIFIED (0) is caught while parsing
        found = {(d.entry, d.field, d.code) for d in err.issues if isinstance(d, CatalogDiagnostic)}
    assert (INVOICE, field, code) in found


@pytest.mark.parametrize(
    ("changes", "effect", "field"),
    [
        # X1 external effect <=> an effect owner
        ({"effect_owner": {"owner_class": "none"}}, True, "descriptor.effect_owner.owner_class"),
        (
            {"effect_owner": {"owner_class": "runtime_delivery", "effect_owner_kind": "webhook"}},
            False,
            "descriptor.effect_owner.owner_class",
        ),
        # X2 waits and effects never run inside a transaction
        ({"transaction_policy": "owned_transaction"}, True, "descriptor.transaction_policy"),
        (
            {
                "execution_class": "wait",
                "effect_owner": {"owner_class": "none"},
                "output_durability": "checkpointed",
            },
            True,
            None,
        ),
        # X3 owner receipt <=> external effect
        ({"output_durability": "checkpointed"}, True, "descriptor.output_durability"),
        ({"output_durability": "owner_receipt"}, False, "descriptor.output_durability"),
        # X4 pure compute reads checkpoints only
        ({"execution_class": "pure_compute"}, False, "descriptor.read_contract"),
        # X5 idempotent by key needs a key
        (
            {"replay_policy": "idempotent_by_key"},
            False,
            "descriptor.idempotency_policy.key_required",
        ),
        # X6 the caller's context cannot outlive the save
        (
            {"security_policy.principal_mode": "caller"},
            True,
            "descriptor.security_policy.principal_mode",
        ),
    ],
)
def test_cross_field_rules(changes: dict[str, Any], effect: bool, field: str | None) -> None:
    found = _field_issues(descriptor_changes=changes, effect=effect, handler=False)
    if field is None:  # wait is fine with transaction_forbidden; the X2 positive case
        assert found == set()
        found = _field_issues(
            descriptor_changes={**changes, "transaction_policy": "caller_transaction"},
            effect=effect,
            handler=False,
        )
        field = "descriptor.transaction_policy"
    assert (INVOICE, field, DiagnosticCode.INCONSISTENT) in found


@pytest.mark.parametrize(
    ("kwargs", "field", "code"),
    [
        (
            {"version": None},
            "handler_binding.handler_implementation_version",
            DiagnosticCode.MISSING_FIELD,
        ),
        (
            {"version": "1.0", "release_digest": versioned_digest("release", {"v": 1})},
            "handler_binding.service_release_digest",
            DiagnosticCode.INCONSISTENT,
        ),
        (
            {"version": None, "release_digest": "sha256:deadbeef"},
            "handler_binding.service_release_digest",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"version": "1.0 beta"},
            "handler_binding.handler_implementation_version",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"handler_ref": "<function send at 0x7f3a2c1b>"},
            "handler_binding.handler_ref",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"handler_ref": "python:acme:send@0x7f3a2c1b"},
            "handler_binding.handler_ref",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"handler_owner": "pack acme"},
            "handler_binding.owner_registration_id",
            DiagnosticCode.INVALID_FORMAT,
        ),
        (
            {"asserted": {"replay_policy": "sometimes"}},
            "handler_binding.asserted_capability.replay_policy",
            DiagnosticCode.UNKNOWN_ENUM_VALUE,
        ),
    ],
)
def test_handler_binding_diagnostics_name_entry_and_field(
    kwargs: dict[str, Any], field: str, code: DiagnosticCode
) -> None:
    try:
        found = _field_issues(**kwargs)
    except DomainValidationError as err:
        found = {(d.entry, d.field, d.code) for d in err.issues if isinstance(d, CatalogDiagnostic)}
    assert (INVOICE, field, code) in found


def test_asserted_capability_is_validated_like_a_descriptor() -> None:
    found = _field_issues(asserted={"output_durability": "checkpointed"})
    assert (
        INVOICE,
        "handler_binding.asserted_capability.output_durability",
        DiagnosticCode.INCONSISTENT,
    ) in found


def test_action_type_and_owner_diagnostics() -> None:
    assert submission("  ACME.Send_Invoice ").entry_name == INVOICE
    found = _field_issues(action_type="acme..send")
    assert ("acme..send", "action_type", DiagnosticCode.INVALID_FORMAT) in found
    raw = submission_dict()
    raw["owner"] = {"kind": "distribution", "registration_id": "dist"}
    assert _shape_issues(raw) == {(INVOICE, "owner.kind", DiagnosticCode.UNKNOWN_ENUM_VALUE)}
    raw["owner"] = None
    raw["extra"] = 1
    assert _shape_issues(raw) == {
        (INVOICE, "owner", DiagnosticCode.MISSING_FIELD),
        (INVOICE, "extra", DiagnosticCode.UNKNOWN_FIELD),
    }


def test_descriptor_round_trip_and_normalization() -> None:
    raw = mutation_descriptor_dict()
    desc = CapabilityDescriptor.from_dict(raw)
    assert CapabilityDescriptor.from_dict(json.loads(json.dumps(desc.to_dict()))) == desc
    reordered = patch(raw, {"lock_plan_contract.resource_classes": ["parent", "record"]})
    reordered["lock_plan_contract"]["static_keys"].reverse()
    assert CapabilityDescriptor.from_dict(reordered).digest() == desc.digest()


def test_proto_numbers_are_accepted_for_enums() -> None:
    raw = patch(
        effect_descriptor_dict(),
        {
            "execution_class": int(ExecutionClass.EXTERNAL_EFFECT),
            "idempotency_policy.uniqueness_scope": int(IdempotencyScope.RUNTIME_WORK_SCOPE),
        },
    )
    assert CapabilityDescriptor.from_dict(raw) == CapabilityDescriptor.from_dict(
        effect_descriptor_dict()
    )


def test_from_dict_raises_with_every_issue() -> None:
    raw = patch(
        mutation_descriptor_dict(),
        {"execution_class": "pure_compute", "minimum_capability_version": 0},
    )
    with pytest.raises(DomainValidationError) as err:
        CapabilityDescriptor.from_dict(raw)
    assert {i.path for i in err.value.issues} == {"read_contract", "minimum_capability_version"}  # type: ignore[union-attr]
