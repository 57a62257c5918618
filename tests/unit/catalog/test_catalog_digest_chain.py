"""Descriptor digest → BindingFingerprint → EntryDigest → CatalogDigest (§8.1, §8.4)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog_svc.domain import (
    BINDING_FINGERPRINT_KIND,
    CATALOG_DIGEST_KIND,
    CONTRACT_VERSION,
    DESCRIPTOR_DIGEST_KIND,
    ENTRY_DIGEST_KIND,
    CatalogEntry,
    CatalogEntrySubmission,
    Sealed,
    compute_catalog_digest,
    seal,
    submit_entry,
)
from services.digest import is_digest, parse_digest, versioned_digest
from tests.unit.catalog.factories import (
    INVOICE,
    PLATFORM,
    UPDATE,
    accept,
    make_binding,
    open_draft,
    shuffled,
    submission,
    submission_dict,
)


def _entry(**kwargs: Any) -> CatalogEntry:
    return CatalogEntry.from_submission(submission(**kwargs))


def _sealed_digest(subs: list[CatalogEntrySubmission], **binding: Any) -> str:
    draft = open_draft(make_binding(**binding))
    for sub in subs:
        draft = submit_entry(draft, sub, {}, source_scope=draft.scope).draft
    decision = seal(draft)
    assert isinstance(decision, Sealed)
    return decision.catalog_digest


def _catalog_subs() -> list[CatalogEntrySubmission]:
    return [
        submission(),
        submission(
            UPDATE, PLATFORM, effect=False, handler_ref="python:core.records:update", version="9.1"
        ),
        submission("acme.archive", effect=False, handler=False),
        submission(
            "acme.notify",
            version="2.0",
            asserted={"security_policy.reauthorization_policy": "terminal_failure"},
        ),
    ]


def test_digest_kinds_and_versions() -> None:
    entry = _entry()
    assert parse_digest(entry.descriptor_digest)[:2] == (DESCRIPTOR_DIGEST_KIND, CONTRACT_VERSION)
    assert entry.binding_fingerprint is not None
    assert is_digest(entry.binding_fingerprint, BINDING_FINGERPRINT_KIND)
    assert is_digest(entry.entry_digest, ENTRY_DIGEST_KIND)
    assert is_digest(_sealed_digest([submission()]), CATALOG_DIGEST_KIND)


def test_fingerprint_is_exactly_the_specified_inputs() -> None:
    entry = _entry()
    expected = versioned_digest(
        BINDING_FINGERPRINT_KIND,
        {
            "owner_registration_id": "pack:acme.billing",
            "handler_ref": "python:acme.billing.handlers:send_invoice",
            "handler_implementation_version": "1.4.0",
            "service_release_digest": None,
            "descriptor_digest": entry.descriptor_digest,
        },
    )
    assert entry.binding_fingerprint == expected


@given(st.randoms(use_true_random=False))
def test_entry_digest_is_independent_of_key_order(rnd: random.Random) -> None:
    raw = submission_dict(asserted={"fanout_bound.metadata_path": "input.cc"})
    reordered = CatalogEntry.from_submission(CatalogEntrySubmission.from_dict(shuffled(raw, rnd)))
    assert reordered == CatalogEntry.from_submission(CatalogEntrySubmission.from_dict(raw))


@settings(max_examples=40)
@given(st.permutations(range(4)), st.integers(min_value=0, max_value=3))
def test_catalog_digest_is_independent_of_submission_order(order: list[int], repeat: int) -> None:
    subs = _catalog_subs()
    permuted = [subs[i] for i in order] + [subs[repeat]]  # plus an idempotent resubmission
    assert _sealed_digest(permuted) == _sealed_digest(subs)


def test_changed_handler_implementation_version_changes_fingerprint_entry_and_catalog() -> None:
    old, new = _entry(version="1.4.0"), _entry(version="1.4.1")
    assert old.descriptor_digest == new.descriptor_digest
    assert old.binding_fingerprint != new.binding_fingerprint
    assert old.entry_digest != new.entry_digest
    assert _sealed_digest([submission(version="1.4.0")]) != _sealed_digest(
        [submission(version="1.4.1")]
    )


def test_release_digest_and_version_are_distinct_identities() -> None:
    release = versioned_digest("service_release", {"build": 1})
    assert (
        _entry(version=None, release_digest=release).binding_fingerprint
        != _entry().binding_fingerprint
    )


def test_changed_descriptor_changes_every_digest() -> None:
    old, new = _entry(), _entry(descriptor_changes={"minimum_capability_version": 2})
    assert old.descriptor_digest != new.descriptor_digest
    assert old.binding_fingerprint != new.binding_fingerprint
    assert old.entry_digest != new.entry_digest


def test_asserted_capability_is_committed_by_the_entry_not_the_fingerprint() -> None:
    old = _entry()
    new = _entry(asserted={"security_policy.reauthorization_policy": "terminal_failure"})
    assert old.binding_fingerprint == new.binding_fingerprint  # §8.1's fingerprint inputs only
    assert old.entry_digest != new.entry_digest


def test_normalized_spellings_share_digests() -> None:
    assert (
        _entry(
            action_type=" ACME.Send_Invoice ",
            handler_ref="  python:acme.billing.handlers:send_invoice ",
        )
        == _entry()
    )


def test_contract_only_entry_has_no_fingerprint_and_its_own_digest() -> None:
    contract = _entry(handler=False)
    assert contract.binding_fingerprint is None and not contract.executable
    assert contract.entry_digest != _entry().entry_digest
    assert contract.descriptor_digest == _entry().descriptor_digest


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
    ],
)
def test_identical_entries_under_another_binding_do_not_alias(field: str, other: Any) -> None:
    subs = _catalog_subs()
    assert _sealed_digest(subs, **{field: other}) != _sealed_digest(subs)


def test_catalog_digest_is_exactly_binding_digest_plus_sorted_entry_digests() -> None:
    binding = make_binding()
    draft = open_draft(binding)
    for sub in _catalog_subs():
        draft = accept(draft, sub)
    decision = seal(draft)
    assert isinstance(decision, Sealed)
    digests = [e.entry_digest for e in decision.entries]
    expected = versioned_digest(
        CATALOG_DIGEST_KIND,
        {"runtime_work_binding_digest": binding.digest(), "entry_digests": sorted(digests)},
    )
    assert (
        decision.catalog_digest
        == expected
        == compute_catalog_digest(binding.digest(), reversed(digests))
    )
    assert [e.action_type for e in decision.entries] == sorted(
        e.action_type for e in decision.entries
    )
    assert INVOICE in {e.action_type for e in decision.entries}
