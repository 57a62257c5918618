"""Sealed artifact round trip/verification and the §8.4 runtime-binary release rule."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog_svc.domain import (
    BindingGapReason,
    CatalogDiagnostic,
    DiagnosticCode,
    DomainValidationError,
    EntryDigest,
    RuntimeHandlerTuple,
    Sealed,
    SealedGeneration,
    binding_gaps,
    required_tuples,
    seal,
    verify_runtime_binary,
)
from tests.unit.catalog.factories import INVOICE, PLATFORM, UPDATE, accept, open_draft, submission


def _generation(generation_id: str = "gen-1", invoice_version: str = "1.4.0") -> SealedGeneration:
    draft = open_draft(generation_id=generation_id)
    for sub in (
        submission(version=invoice_version),
        submission(
            UPDATE, PLATFORM, effect=False, handler_ref="python:core.records:update", version="9.1"
        ),
        submission("acme.archive", effect=False, handler=False),
    ):
        draft = accept(draft, sub)
    decision = seal(draft)
    assert isinstance(decision, Sealed)
    return decision.generation


def _codes(raw: dict[str, Any]) -> set[tuple[str, DiagnosticCode]]:
    with pytest.raises(DomainValidationError) as err:
        SealedGeneration.from_dict(raw)
    return {(d.field, d.code) for d in err.value.issues if isinstance(d, CatalogDiagnostic)}


def test_persisted_generation_round_trips_and_verifies() -> None:
    gen = _generation()
    assert gen.verify() == []
    assert SealedGeneration.from_dict(json.loads(json.dumps(gen.to_dict()))) == gen
    assert gen.scope.runtime_work_binding_digest == gen.binding_digest


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        (
            lambda raw: raw["entries"][1]["descriptor"].update(minimum_capability_version=9),
            ("descriptor_digest", DiagnosticCode.DIGEST_MISMATCH),
        ),
        (
            lambda raw: raw["entries"][1]["handler_binding"].update(
                handler_implementation_version="1.4.1"
            ),
            ("binding_fingerprint", DiagnosticCode.DIGEST_MISMATCH),
        ),
        (
            lambda raw: raw.update(catalog_digest=raw["entries"][0]["entry_digest"]),
            ("catalog_digest", DiagnosticCode.DIGEST_MISMATCH),
        ),
        (
            lambda raw: raw["runtime_work_binding"].update(org_id="org-2"),
            ("runtime_work_binding_digest", DiagnosticCode.DIGEST_MISMATCH),
        ),
        (lambda raw: raw["entries"].reverse(), ("entries", DiagnosticCode.INCONSISTENT)),
        (
            lambda raw: raw.update(contract_version=7),
            ("contract_version", DiagnosticCode.UNSUPPORTED_VERSION),
        ),
    ],
)
def test_tampered_artifact_is_refused(tamper: Any, expected: tuple[str, DiagnosticCode]) -> None:
    raw = json.loads(json.dumps(_generation().to_dict()))
    tamper(raw)
    assert expected in _codes(raw)


def test_required_tuples_cover_exactly_the_executable_entries() -> None:
    gen = _generation()
    tuples = required_tuples(gen)
    assert [t.action_type for t in tuples] == [
        INVOICE,
        UPDATE,
    ]  # the contract-only entry never dispatches
    invoice = gen.get_entry(INVOICE)
    assert invoice is not None
    assert tuples[0] == RuntimeHandlerTuple(
        gen.binding_digest,
        gen.generation_id,
        invoice.action_type,
        invoice.handler_ref,  # type: ignore[arg-type]
        invoice.entry_digest,
        invoice.binding_fingerprint,  # type: ignore[arg-type]
    )


@given(st.data())
def test_binary_verification_reports_exactly_the_missing_tuples(data: st.DataObject) -> None:
    required = list(required_tuples(_generation("gen-1"))) + list(
        required_tuples(_generation("gen-2"))
    )
    published = data.draw(st.lists(st.sampled_from(required), unique=True))
    noise = list(required_tuples(_generation("gen-3", invoice_version="2.0.0")))
    missing = verify_runtime_binary(published + noise, required + required[:1])
    assert missing == sorted(set(required) - set(published))


def test_a_different_fingerprint_is_missing_not_a_fallback() -> None:
    old, new = _generation(invoice_version="1.4.0"), _generation(invoice_version="1.5.0")
    assert old.binding_digest == new.binding_digest and old.generation_id == new.generation_id
    missing = verify_runtime_binary(required_tuples(new), required_tuples(old))
    assert [t.action_type for t in missing] == [INVOICE]


def test_binding_gaps_explain_each_missing_entry() -> None:
    gen = _generation()
    invoice, update = required_tuples(gen)
    assert binding_gaps(gen, [invoice, update]) == ()
    assert [g.reason for g in binding_gaps(gen, [invoice])] == [BindingGapReason.HANDLER_MISSING]
    newer = required_tuples(_generation(invoice_version="1.5.0"))[0]
    assert [g.reason for g in binding_gaps(gen, [newer, update])] == [
        BindingGapReason.FINGERPRINT_MISMATCH
    ]
    stale = invoice._replace(
        entry_digest=EntryDigest("catalog_entry/v1:sha256:" + "0" * 64)
    )  # same fingerprint
    assert [g.reason for g in binding_gaps(gen, [stale, update])] == [
        BindingGapReason.ENTRY_DIGEST_MISMATCH
    ]
    # the invoice entry needs capability version 1, the update entry version 2
    gaps = binding_gaps(gen, [invoice, update], supported_capability_version=1)
    assert [(g.action_type, g.reason) for g in gaps] == [
        (UPDATE, BindingGapReason.CAPABILITY_VERSION_TOO_LOW)
    ]
