"""Generation builder: §8.3 conflict policy, one rule per test, as pure decisions."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog_svc.domain import (
    Accepted,
    ActionOwner,
    CatalogEntrySubmission,
    DiagnosticCode,
    DomainValidationError,
    GenerationDraft,
    GenerationState,
    IdempotentDuplicate,
    Rejected,
    RuntimeMetadataView,
    RuntimeWorkScope,
    Sealed,
    open_generation,
    required_tuples,
    seal,
    submit_entry,
)
from tests.unit.catalog.factories import (
    INVOICE,
    OTHER_PACK,
    PACK,
    PLATFORM,
    UPDATE,
    accept,
    make_binding,
    make_view,
    open_draft,
    submission,
)

RESERVED = {UPDATE: PLATFORM}


def _submit(
    draft: GenerationDraft,
    sub: CatalogEntrySubmission,
    platform_owned: dict[str, ActionOwner] | None = None,
    **kwargs: Any,
) -> Any:
    kwargs.setdefault("source_scope", draft.scope)
    return submit_entry(draft, sub, platform_owned or {}, **kwargs)


def _assert_rejects_generation(
    decision: Any, code: DiagnosticCode, field: str, entry: str = INVOICE
) -> GenerationDraft:
    assert isinstance(decision, Rejected), decision
    assert decision.rejects_generation
    assert decision.draft.state is GenerationState.REJECTED
    assert (entry, field, code) in {(d.entry, d.field, d.code) for d in decision.diagnostics}
    assert code.value in decision.draft.rejection_codes()
    sealed = seal(decision.draft)
    assert isinstance(sealed, Rejected) and not sealed.rejects_generation  # never sealable
    assert sealed.diagnostics[0].code is DiagnosticCode.GENERATION_REJECTED
    return decision.draft


def _platform_update(**kwargs: Any) -> CatalogEntrySubmission:
    kwargs.setdefault("handler_ref", "python:core.records:update")
    return submission(UPDATE, PLATFORM, effect=False, **kwargs)


# -- opening -------------------------------------------------------------------------------


def test_open_generation_is_bound_to_one_complete_binding() -> None:
    binding = make_binding()
    draft = open_generation(binding, "gen-1")
    assert draft.state is GenerationState.OPEN and draft.entries == ()
    assert draft.binding_digest == binding.digest()
    assert draft.scope == RuntimeWorkScope("org-1", "inst-1", "cap-flow", binding.digest())


@pytest.mark.parametrize(
    ("binding_changes", "generation_id", "contract_version", "field"),
    [
        ({"org_id": ""}, "gen-1", 1, "runtime_work_binding.org_id"),
        ({}, "gen 1", 1, "catalog_generation_id"),
        ({}, "gen-1", 2, "contract_version"),
    ],
)
def test_open_generation_rejects_invalid_arguments(
    binding_changes: dict[str, Any], generation_id: str, contract_version: int, field: str
) -> None:
    with pytest.raises(DomainValidationError) as err:
        open_generation(
            make_binding(**binding_changes), generation_id, contract_version=contract_version
        )
    assert [getattr(i, "field", None) for i in err.value.issues] == [field]


# -- admission and idempotency -------------------------------------------------------------


def test_new_entry_is_accepted_and_entries_stay_sorted() -> None:
    draft = open_draft()
    first = _submit(draft, submission())
    assert isinstance(first, Accepted) and not first.bound_contract
    second = _submit(first.draft, submission("acme.archive", effect=False, handler=False))
    assert isinstance(second, Accepted)
    assert [e.action_type for e in second.draft.entries] == ["acme.archive", INVOICE]
    assert draft.entries == ()  # pure: the input draft is never mutated


def test_byte_identical_resubmission_is_idempotent_before_sealing() -> None:
    draft = accept(open_draft(), submission())
    decision = _submit(draft, submission())
    assert isinstance(decision, IdempotentDuplicate)
    assert decision.draft is draft
    assert decision.entry == draft.entries[0]


def test_resubmission_in_another_spelling_is_idempotent() -> None:
    draft = accept(open_draft(), submission())
    respelled = submission(
        " Acme.SEND_invoice", handler_ref=" python:acme.billing.handlers:send_invoice "
    )
    assert isinstance(_submit(draft, respelled), IdempotentDuplicate)


# -- §8.3: the same action type from a different source rejects the whole generation --------


def test_same_action_type_from_another_owner_rejects_generation() -> None:
    draft = accept(open_draft(), submission())
    _assert_rejects_generation(
        _submit(draft, submission(owner=OTHER_PACK)), DiagnosticCode.OWNER_CONFLICT, "owner"
    )


def test_same_action_type_with_another_handler_ref_rejects_generation() -> None:
    draft = accept(open_draft(), submission())
    decision = _submit(draft, submission(handler_ref="python:acme.billing.v2:send_invoice"))
    _assert_rejects_generation(
        decision, DiagnosticCode.HANDLER_REF_CONFLICT, "handler_binding.handler_ref"
    )


def test_same_action_type_with_another_handler_version_rejects_generation() -> None:
    draft = accept(open_draft(), submission(version="1.4.0"))
    decision = _submit(draft, submission(version="1.5.0"))
    _assert_rejects_generation(
        decision,
        DiagnosticCode.HANDLER_VERSION_CONFLICT,
        "handler_binding.handler_implementation_version",
    )


def test_same_action_type_with_another_handler_binding_rejects_generation() -> None:
    draft = accept(open_draft(), submission())
    decision = _submit(
        draft, submission(asserted={"security_policy.reauthorization_policy": "terminal_failure"})
    )
    _assert_rejects_generation(
        decision, DiagnosticCode.HANDLER_BINDING_CONFLICT, "handler_binding.asserted_capability"
    )


def test_same_action_type_with_another_descriptor_rejects_generation() -> None:
    draft = accept(open_draft(), submission())
    decision = _submit(draft, submission(descriptor_changes={"minimum_capability_version": 2}))
    _assert_rejects_generation(decision, DiagnosticCode.DESCRIPTOR_CONFLICT, "descriptor")


def test_rejected_generation_refuses_every_later_submission() -> None:
    draft = accept(open_draft(), submission())
    rejected = _assert_rejects_generation(
        _submit(draft, submission(owner=OTHER_PACK)), DiagnosticCode.OWNER_CONFLICT, "owner"
    )
    for sub in (submission(), submission("acme.archive", effect=False, handler=False)):
        decision = _submit(rejected, sub)
        assert isinstance(decision, Rejected) and not decision.rejects_generation
        assert decision.draft is rejected
        assert [d.code for d in decision.diagnostics] == [DiagnosticCode.GENERATION_REJECTED]


# -- §8.3: reserved contract-only action types ----------------------------------------------


def test_reserved_contract_only_type_is_not_executable_until_its_owner_binds_one_handler() -> None:
    contract = accept(open_draft(), _platform_update(handler=False), RESERVED)
    sealed_contract = seal(contract)
    assert isinstance(sealed_contract, Sealed)
    entry = sealed_contract.generation.get_entry(UPDATE)
    assert entry is not None and not entry.executable and entry.binding_fingerprint is None
    assert required_tuples(sealed_contract.generation) == ()

    bound = _submit(contract, _platform_update(), RESERVED)
    assert isinstance(bound, Accepted) and bound.bound_contract
    sealed_bound = seal(bound.draft)
    assert isinstance(sealed_bound, Sealed)
    bound_entry = sealed_bound.generation.get_entry(UPDATE)
    assert bound_entry is not None and bound_entry.executable
    assert [t.action_type for t in required_tuples(sealed_bound.generation)] == [UPDATE]


def test_reserved_contract_binding_is_order_insensitive() -> None:
    contract_first = accept(
        accept(open_draft(), _platform_update(handler=False), RESERVED),
        _platform_update(),
        RESERVED,
    )
    handler_first = accept(open_draft(), _platform_update(), RESERVED)
    restated = _submit(handler_first, _platform_update(handler=False), RESERVED)
    assert isinstance(restated, IdempotentDuplicate)
    a, b = seal(contract_first), seal(handler_first)
    assert isinstance(a, Sealed) and isinstance(b, Sealed)
    assert a.catalog_digest == b.catalog_digest


def test_reserved_type_accepts_exactly_one_handler() -> None:
    draft = accept(
        accept(open_draft(), _platform_update(handler=False), RESERVED),
        _platform_update(),
        RESERVED,
    )
    decision = _submit(
        draft, _platform_update(handler_ref="python:core.records:update_v2"), RESERVED
    )
    _assert_rejects_generation(
        decision, DiagnosticCode.HANDLER_REF_CONFLICT, "handler_binding.handler_ref", UPDATE
    )


def test_reserved_type_handler_from_a_non_designated_owner_rejects_generation() -> None:
    draft = accept(open_draft(), _platform_update(handler=False), RESERVED)
    intruder = submission(UPDATE, PACK, effect=False, handler_ref="python:acme:update")
    decision = _submit(draft, intruder, RESERVED)
    _assert_rejects_generation(decision, DiagnosticCode.PLATFORM_OWNED_OVERRIDE, "owner", UPDATE)


def test_contract_restated_with_another_descriptor_rejects_generation() -> None:
    draft = accept(open_draft(), _platform_update(handler=False), RESERVED)
    decision = _submit(
        draft, _platform_update(descriptor_changes={"fanout_bound.static_maximum": 20}), RESERVED
    )
    _assert_rejects_generation(decision, DiagnosticCode.DESCRIPTOR_CONFLICT, "descriptor", UPDATE)


# -- §8.3: ownership and capability ----------------------------------------------------------


@pytest.mark.parametrize("platform_first", [True, False])
def test_pack_metadata_cannot_override_a_platform_owned_action(platform_first: bool) -> None:
    pack_sub = submission(UPDATE, PACK, effect=False, handler=False)
    draft = open_draft()
    if platform_first:
        draft = accept(draft, _platform_update(), RESERVED)
    decision = _submit(draft, pack_sub, RESERVED)
    _assert_rejects_generation(decision, DiagnosticCode.PLATFORM_OWNED_OVERRIDE, "owner", UPDATE)


def test_platform_ownership_lookup_normalizes_the_action_type() -> None:
    decision = _submit(
        open_draft(), submission(UPDATE, PACK, effect=False), {"  Core.Update_Record": PLATFORM}
    )
    _assert_rejects_generation(decision, DiagnosticCode.PLATFORM_OWNED_OVERRIDE, "owner", UPDATE)


def test_handler_bound_by_another_registration_rejects_generation() -> None:
    decision = _submit(open_draft(), submission(handler_owner="pack:globex.billing"))
    _assert_rejects_generation(
        decision, DiagnosticCode.HANDLER_OWNER_MISMATCH, "handler_binding.owner_registration_id"
    )


def test_handler_cannot_broaden_its_owners_declared_capability() -> None:
    decision = _submit(
        open_draft(), submission(asserted={"security_policy.principal_mode": "system"})
    )
    _assert_rejects_generation(
        decision,
        DiagnosticCode.CAPABILITY_BROADENED,
        "handler_binding.asserted_capability.security_policy.principal_mode",
    )


def test_handler_may_assert_a_narrower_capability() -> None:
    narrower = submission(asserted={"security_policy.reauthorization_policy": "terminal_failure"})
    stricter = submission(
        effect=False,
        asserted={"fanout_bound.static_maximum": 3, "read_contract": "checkpoint_only"},
    )
    assert isinstance(_submit(open_draft(), narrower), Accepted)
    assert isinstance(_submit(open_draft(), stricter), Accepted)


@pytest.mark.parametrize(
    "component",
    ["org_id", "app_installation_id", "runtime_capability_id", "runtime_work_binding_digest"],
)
def test_source_from_another_trusted_scope_rejects_generation(component: str) -> None:
    draft = open_draft()
    scope = draft.scope
    changes: dict[str, Any] = {component: "other"}
    foreign = dataclasses.replace(scope, **changes)
    decision = _submit(draft, submission(), source_scope=foreign)
    _assert_rejects_generation(decision, DiagnosticCode.SCOPE_MISMATCH, f"scope.{component}")


# -- §8.3: sealed generations are immutable -------------------------------------------------


def test_sealed_generation_is_immutable() -> None:
    draft = accept(open_draft(), submission())
    sealed = seal(draft)
    assert isinstance(sealed, Sealed) and not sealed.already_sealed
    assert sealed.draft.state is GenerationState.SEALED
    assert sealed.draft.catalog_digest == sealed.catalog_digest
    for sub in (
        submission(),
        submission(version="9.9.9"),
        submission("acme.archive", effect=False, handler=False),
    ):
        decision = _submit(sealed.draft, sub)
        assert isinstance(decision, Rejected) and not decision.rejects_generation
        assert decision.draft is sealed.draft
        assert [d.code for d in decision.diagnostics] == [DiagnosticCode.GENERATION_SEALED]


def test_sealing_again_is_idempotent() -> None:
    first = seal(accept(open_draft(), submission()))
    assert isinstance(first, Sealed)
    again = seal(first.draft)
    assert isinstance(again, Sealed) and again.already_sealed
    assert again.catalog_digest == first.catalog_digest and again.draft is first.draft


# -- refused submissions do not reject the generation ---------------------------------------


def test_invalid_submission_is_refused_without_rejecting_the_generation() -> None:
    draft = open_draft()
    bad = submission(descriptor_changes={"minimum_capability_version": 0})
    decision = _submit(draft, bad)
    assert isinstance(decision, Rejected) and not decision.rejects_generation
    assert decision.draft is draft and draft.state is GenerationState.OPEN
    assert [(d.entry, d.field) for d in decision.diagnostics] == [
        (INVOICE, "descriptor.minimum_capability_version")
    ]
    assert isinstance(_submit(draft, submission()), Accepted)


def test_key_shape_inputs_must_be_declared_in_the_bound_view() -> None:
    draft = open_draft()
    view = make_view()
    assert isinstance(_submit(draft, submission(), metadata_view=view), Accepted)
    undeclared = submission(
        descriptor_changes={"idempotency_policy.key_shape": "${input.customer}:${run.id}"}
    )
    decision = _submit(draft, undeclared, metadata_view=view)
    assert isinstance(decision, Rejected) and not decision.rejects_generation
    assert [(d.field, d.code) for d in decision.diagnostics] == [
        ("descriptor.idempotency_policy.key_shape", DiagnosticCode.UNDECLARED_INPUT)
    ]
    no_metadata = submission(
        "acme.unknown", descriptor_changes={"fanout_bound.metadata_path": "input.x"}
    )
    decision = _submit(draft, no_metadata, metadata_view=view)
    assert isinstance(decision, Rejected)
    assert {d.code for d in decision.diagnostics} == {DiagnosticCode.UNDECLARED_INPUT}


def test_wrong_metadata_view_is_refused() -> None:
    draft = open_draft(make_binding(runtime_metadata_view_digest=make_view().digest()))
    other_view = RuntimeMetadataView(objects=make_view().objects)
    decision = _submit(draft, submission(), metadata_view=other_view)
    assert isinstance(decision, Rejected) and not decision.rejects_generation
    assert [d.code for d in decision.diagnostics] == [DiagnosticCode.VIEW_MISMATCH]


# -- the whole protocol is order-insensitive -------------------------------------------------


@settings(max_examples=50)
@given(st.permutations(range(6)))
def test_any_order_of_non_conflicting_submissions_seals_the_same_catalog(order: list[int]) -> None:
    subs = [
        submission(),
        submission(),  # identical resubmission
        _platform_update(handler=False),  # reserved contract ...
        _platform_update(),  # ... and its one matching handler
        submission("acme.archive", effect=False, handler=False),
        submission("acme.notify", version="2.0"),
    ]
    draft = open_draft()
    for i in order:
        decision = _submit(draft, subs[i], RESERVED)
        assert isinstance(decision, Accepted | IdempotentDuplicate), decision
        draft = decision.draft
    sealed = seal(draft)
    assert isinstance(sealed, Sealed)
    reference = open_draft()
    for sub in (subs[0], subs[3], subs[4], subs[5]):
        reference = accept(reference, sub, RESERVED)
    expected = seal(reference)
    assert isinstance(expected, Sealed)
    assert sealed.generation == expected.generation
