"""RuntimeWorkBinding: validation naming the field, canonical digest, work scope."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog_svc.domain import (
    WORK_BINDING_DIGEST_KIND,
    Diagnostic,
    DiagnosticCode,
    DomainValidationError,
    RuntimeWorkBinding,
    RuntimeWorkScope,
)
from services.auth import TrustedRuntimeWorkScope
from services.digest import is_digest, versioned_digest
from tests.unit.catalog.factories import make_binding, shuffled


def test_valid_binding_has_no_issues_and_a_versioned_digest() -> None:
    binding = make_binding()
    assert binding.validate() == []
    assert is_digest(binding.digest(), WORK_BINDING_DIGEST_KIND)
    assert binding.digest() == make_binding().digest()


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("org_id", "org-2"),
        ("app_installation_id", "inst-2"),
        ("runtime_capability_id", "cap-other"),
        ("catalog_revision", 8),
        ("schema_generation", 4),
        ("engine_generation", 3),
        ("catalog_snapshot_digest", versioned_digest("catalog_snapshot", {"rev": 8})),
        ("runtime_metadata_view_digest", versioned_digest("runtime_metadata_view", {"x": 1})),
    ],
)
def test_every_field_is_committed_by_the_digest(field: str, other: Any) -> None:
    assert make_binding(**{field: other}).digest() != make_binding().digest()


@pytest.mark.parametrize(
    ("field", "bad", "code"),
    [
        ("org_id", "", DiagnosticCode.MISSING_FIELD),
        ("org_id", "org 1", DiagnosticCode.INVALID_FORMAT),
        ("app_installation_id", "inst\n1", DiagnosticCode.INVALID_FORMAT),
        ("runtime_capability_id", 5, DiagnosticCode.INVALID_TYPE),
        ("catalog_revision", 0, DiagnosticCode.OUT_OF_RANGE),
        ("schema_generation", True, DiagnosticCode.INVALID_TYPE),
        ("engine_generation", 2**63, DiagnosticCode.OUT_OF_RANGE),
        ("catalog_snapshot_digest", "sha256:abc", DiagnosticCode.INVALID_FORMAT),
        (
            "runtime_metadata_view_digest",
            versioned_digest("catalog_snapshot", {}),
            DiagnosticCode.INVALID_FORMAT,
        ),
        ("runtime_metadata_view_digest", "", DiagnosticCode.MISSING_FIELD),
    ],
)
def test_validation_names_the_field(field: str, bad: Any, code: DiagnosticCode) -> None:
    issues = dataclasses.replace(make_binding(), **{field: bad}).validate()
    assert [(i.path, i.code) for i in issues] == [(field, code)]


def test_from_dict_round_trips_and_collects_every_issue() -> None:
    binding = make_binding()
    assert RuntimeWorkBinding.from_dict(binding.to_dict()) == binding

    raw = binding.to_dict()
    raw["org_id"] = None
    raw["catalog_revision"] = "7"
    raw["surprise"] = 1
    with pytest.raises(DomainValidationError) as err:
        RuntimeWorkBinding.from_dict(raw)
    assert {(i.path, i.code) for i in err.value.issues if isinstance(i, Diagnostic)} == {
        ("org_id", DiagnosticCode.MISSING_FIELD),
        ("catalog_revision", DiagnosticCode.INVALID_TYPE),
        ("surprise", DiagnosticCode.UNKNOWN_FIELD),
    }


@given(st.randoms(use_true_random=False))
def test_digest_is_independent_of_key_order(rnd: random.Random) -> None:
    binding = make_binding()
    assert (
        RuntimeWorkBinding.from_dict(shuffled(binding.to_dict(), rnd)).digest() == binding.digest()
    )


def test_work_scope_and_component_mismatch() -> None:
    binding = make_binding()
    scope = binding.work_scope()
    assert scope == RuntimeWorkScope("org-1", "inst-1", "cap-flow", binding.digest())
    assert scope.mismatched_components(scope) == []
    trusted = TrustedRuntimeWorkScope("org-2", "inst-1", "cap-flow", binding.digest())
    assert scope.mismatched_components(trusted) == ["org_id"]
    other = make_binding(app_installation_id="inst-2").work_scope()
    assert scope.mismatched_components(other) == [
        "app_installation_id",
        "runtime_work_binding_digest",
    ]
