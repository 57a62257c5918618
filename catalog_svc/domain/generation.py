"""The catalog-generation builder protocol as pure state (§8.2, §8.3).

``open_generation`` → ``submit_entry`` … → ``seal``. Each step is a pure function that
returns a decision value carrying the resulting :class:`GenerationDraft`; the repository
persists ``decision.draft`` with a compare-and-swap and the servicer maps the decision
to a response. Nothing here raises for a domain outcome.

Lifecycle::

    OPEN ──submit (accepted / idempotent / refused)──▶ OPEN
    OPEN ──submit violating §8.3──▶ REJECTED   (terminal: never sealable)
    OPEN ──seal──▶ SEALED                      (terminal: immutable)

Two kinds of refusal, deliberately different:

* **Refused submission** (``Rejected.rejects_generation`` is False): the submission
  itself is malformed (field validation, undeclared key inputs, wrong metadata view).
  Nothing was admitted, so no second claim on the action type exists; the draft is
  unchanged and the source may submit a corrected entry.
* **Rejected generation** (``rejects_generation`` is True): a §8.3 conflict — another
  owner, handler reference, handler version/binding or descriptor for an admitted action
  type; a pack overriding a platform-owned action; a handler not bound by the entry's
  owner; a handler asserting a broader capability than its owner declared; a source
  from another trusted scope. Choosing a winner would be precedence/last-writer-wins,
  which §8.3 forbids, so the whole draft becomes REJECTED: every later submit and seal
  is refused and the fix is to correct the source and open a new generation.

Per action type, admission is order-insensitive: the owner's contract-only declaration
and the same owner's handler binding with a byte-identical descriptor are the two halves
of one entry (the reserved contract becomes executable when its designated owner binds
exactly one matching handler); whichever arrives second is ``Accepted`` (binding the
contract) or an ``IdempotentDuplicate`` (contract already bound). A second, different
handler is a conflict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import IntEnum

from .binding import RuntimeWorkBinding, RuntimeWorkScope, WorkScopeLike
from .broadening import broadened_fields
from .diagnostics import CatalogDiagnostic, DiagnosticCode, DomainValidationError
from .entry import ActionOwner, CatalogEntry, CatalogEntrySubmission
from .idempotency_key import KeyShapeError, shape_input_names
from .ids import (
    CONTRACT_VERSION,
    SUPPORTED_CONTRACT_VERSIONS,
    CatalogDigest,
    CatalogGenerationId,
    RuntimeWorkBindingDigest,
    check_generation_id,
    normalize_action_type,
)
from .metadata_view import RuntimeMetadataView
from .sealed import SealedGeneration

__all__ = [
    "Accepted",
    "GenerationDraft",
    "GenerationState",
    "IdempotentDuplicate",
    "Rejected",
    "SealDecision",
    "Sealed",
    "SubmitDecision",
    "open_generation",
    "seal",
    "submit_entry",
]


class GenerationState(IntEnum):
    """Lifecycle of a generation (numbers mirror the proto ``GenerationState``)."""

    UNSPECIFIED = 0
    OPEN = 1
    SEALED = 2
    REJECTED = 3


@dataclass(frozen=True, slots=True)
class GenerationDraft:
    """A generation under construction (or its terminal state).

    Attributes:
        binding: the complete binding the generation is bound to.
        binding_digest: its ``RuntimeWorkBindingDigest``.
        generation_id: stable identity within the binding (assigned by the repository).
        state: OPEN, SEALED or REJECTED.
        entries: admitted entries sorted by action type (one per action type).
        rejection: the §8.3 diagnostics that rejected the generation (REJECTED only).
        contract_version: descriptor schema version of the generation.
        catalog_digest: set once SEALED.
    """

    binding: RuntimeWorkBinding
    binding_digest: RuntimeWorkBindingDigest
    generation_id: CatalogGenerationId
    state: GenerationState = GenerationState.OPEN
    entries: tuple[CatalogEntry, ...] = ()
    rejection: tuple[CatalogDiagnostic, ...] = ()
    contract_version: int = CONTRACT_VERSION
    catalog_digest: CatalogDigest | None = None

    @property
    def scope(self) -> RuntimeWorkScope:
        """The complete trusted scope of the generation."""
        return RuntimeWorkScope(
            self.binding.org_id,
            self.binding.app_installation_id,
            self.binding.runtime_capability_id,
            self.binding_digest,
        )

    @property
    def entries_by_action_type(self) -> Mapping[str, CatalogEntry]:
        """Admitted entries keyed by normalized action type."""
        return {e.action_type: e for e in self.entries}

    def get_entry(self, action_type: str) -> CatalogEntry | None:
        """The admitted entry of the (normalized) action type."""
        wanted = normalize_action_type(action_type)
        return next((e for e in self.entries if e.action_type == wanted), None)

    def rejection_codes(self) -> tuple[str, ...]:
        """Safe, sorted, distinct reason codes of a REJECTED generation."""
        return tuple(sorted({d.code.value for d in self.rejection}))

    def _with_entry(self, entry: CatalogEntry) -> GenerationDraft:
        kept = [e for e in self.entries if e.action_type != entry.action_type]
        return replace(self, entries=tuple(sorted([*kept, entry], key=lambda e: e.action_type)))


@dataclass(frozen=True, slots=True)
class Accepted:
    """The entry was admitted; ``bound_contract`` when it bound a handler to an
    already admitted contract-only entry (the repository updates rather than inserts)."""

    draft: GenerationDraft
    entry: CatalogEntry
    bound_contract: bool = False


@dataclass(frozen=True, slots=True)
class IdempotentDuplicate:
    """Nothing changed: the submission is already represented by ``entry``."""

    draft: GenerationDraft
    entry: CatalogEntry


@dataclass(frozen=True, slots=True)
class Rejected:
    """Refused. ``rejects_generation`` is True when this decision moved the draft to
    REJECTED (the repository must persist it); ``draft`` is the resulting state."""

    draft: GenerationDraft
    diagnostics: tuple[CatalogDiagnostic, ...]
    rejects_generation: bool = False


@dataclass(frozen=True, slots=True)
class Sealed:
    """The generation is sealed; ``already_sealed`` for an idempotent repeat."""

    draft: GenerationDraft
    generation: SealedGeneration
    already_sealed: bool = False

    @property
    def catalog_digest(self) -> CatalogDigest:
        """The sealed ``CatalogDigest``."""
        return self.generation.catalog_digest

    @property
    def entries(self) -> tuple[CatalogEntry, ...]:
        """The sealed entries, sorted by action type."""
        return self.generation.entries


SubmitDecision = Accepted | IdempotentDuplicate | Rejected
SealDecision = Sealed | Rejected


def open_generation(
    binding: RuntimeWorkBinding, generation_id: str, *, contract_version: int = CONTRACT_VERSION
) -> GenerationDraft:
    """Open an empty generation bound to one complete binding (§8.2 step 1).

    Raises:
        DomainValidationError: the binding, generation id or contract version is invalid
            (an argument error, not a domain outcome).
    """
    issues = [
        CatalogDiagnostic.from_diagnostic("", d, prefix="runtime_work_binding")
        for d in binding.validate()
    ]
    issues += [CatalogDiagnostic.from_diagnostic("", d) for d in check_generation_id(generation_id)]
    if contract_version not in SUPPORTED_CONTRACT_VERSIONS:
        issues.append(
            CatalogDiagnostic(
                "",
                "contract_version",
                DiagnosticCode.UNSUPPORTED_VERSION,
                f"contract version {contract_version} is not one of "
                f"{sorted(SUPPORTED_CONTRACT_VERSIONS)}",
            )
        )
    if issues:
        raise DomainValidationError("catalog generation", tuple(issues))
    return GenerationDraft(
        binding=binding,
        binding_digest=binding.digest(),
        generation_id=CatalogGenerationId(generation_id),
        contract_version=contract_version,
    )


def _refuse_terminal(draft: GenerationDraft, entry: str) -> Rejected:
    if draft.state is GenerationState.SEALED:
        diag = CatalogDiagnostic(
            entry, "", DiagnosticCode.GENERATION_SEALED, "a sealed generation is immutable"
        )
    else:
        reasons = ", ".join(draft.rejection_codes()) or "unknown"
        diag = CatalogDiagnostic(
            entry,
            "",
            DiagnosticCode.GENERATION_REJECTED,
            f"the generation was rejected ({reasons}); "
            "correct the source and open a new generation",
        )
    return Rejected(draft, (diag,))


def _poison(draft: GenerationDraft, diagnostics: list[CatalogDiagnostic]) -> Rejected:
    rejected = replace(draft, state=GenerationState.REJECTED, rejection=tuple(diagnostics))
    return Rejected(rejected, tuple(diagnostics), rejects_generation=True)


def _view_issues(
    draft: GenerationDraft, submission: CatalogEntrySubmission, view: RuntimeMetadataView
) -> list[CatalogDiagnostic]:
    entry = submission.entry_name
    if view.digest() != draft.binding.runtime_metadata_view_digest:
        return [
            CatalogDiagnostic(
                entry,
                "metadata_view",
                DiagnosticCode.VIEW_MISMATCH,
                "the metadata view is not the one the generation's binding references",
            )
        ]
    action = view.get_action(entry)
    declared = action.input_names() if action is not None else frozenset()
    out: list[CatalogDiagnostic] = []
    sources = [("descriptor", submission.descriptor)]
    hb = submission.handler_binding
    if hb is not None and hb.asserted_capability is not None:
        sources.append(("handler_binding.asserted_capability", hb.asserted_capability))
    for prefix, desc in sources:
        shape = desc.idempotency_policy.key_shape
        if not shape:
            continue
        try:
            names = shape_input_names(shape)
        except KeyShapeError:
            continue  # already reported by field validation
        for name in sorted(names - declared):
            out.append(
                CatalogDiagnostic(
                    entry,
                    f"{prefix}.idempotency_policy.key_shape",
                    DiagnosticCode.UNDECLARED_INPUT,
                    f"${{input.{name}}} is not a declared input of {entry!r} "
                    "in the bound metadata view",
                )
            )
    return out


def _conflicts(
    draft: GenerationDraft, entry: CatalogEntry, platform_owned: Mapping[str, ActionOwner]
) -> list[CatalogDiagnostic]:
    name = entry.action_type
    out: list[CatalogDiagnostic] = []
    designated = {normalize_action_type(k): v for k, v in platform_owned.items()}.get(name)
    if designated is not None and entry.owner != designated:
        out.append(
            CatalogDiagnostic(
                name,
                "owner",
                DiagnosticCode.PLATFORM_OWNED_OVERRIDE,
                f"{name!r} is platform-owned by {designated}; "
                f"{entry.owner} cannot declare or bind it",
            )
        )
    hb = entry.handler_binding
    if hb is not None and hb.owner_registration_id != entry.owner.registration_id:
        out.append(
            CatalogDiagnostic(
                name,
                "handler_binding.owner_registration_id",
                DiagnosticCode.HANDLER_OWNER_MISMATCH,
                f"the handler is bound by {hb.owner_registration_id!r}, not by the entry owner "
                f"{entry.owner.registration_id!r}",
            )
        )
    if hb is not None and hb.asserted_capability is not None:
        out += [
            CatalogDiagnostic.from_diagnostic(name, d, prefix="handler_binding.asserted_capability")
            for d in broadened_fields(entry.descriptor, hb.asserted_capability)
        ]
    existing = draft.get_entry(name)
    if existing is None:
        return out
    if existing.owner != entry.owner:
        out.append(
            CatalogDiagnostic(
                name,
                "owner",
                DiagnosticCode.OWNER_CONFLICT,
                f"already owned by {existing.owner}, now {entry.owner}",
            )
        )
    if existing.descriptor_digest != entry.descriptor_digest:
        out.append(
            CatalogDiagnostic(
                name,
                "descriptor",
                DiagnosticCode.DESCRIPTOR_CONFLICT,
                "a different descriptor was already admitted",
            )
        )
    old = existing.handler_binding
    if old is not None and hb is not None:
        if old.handler_ref != hb.handler_ref:
            out.append(
                CatalogDiagnostic(
                    name,
                    "handler_binding.handler_ref",
                    DiagnosticCode.HANDLER_REF_CONFLICT,
                    f"handler {old.handler_ref!r} already bound, now {hb.handler_ref!r}",
                )
            )
        if (old.handler_implementation_version, old.service_release_digest) != (
            hb.handler_implementation_version,
            hb.service_release_digest,
        ):
            out.append(
                CatalogDiagnostic(
                    name,
                    "handler_binding.handler_implementation_version",
                    DiagnosticCode.HANDLER_VERSION_CONFLICT,
                    "a different handler implementation version was already bound",
                )
            )
        if old.asserted_capability != hb.asserted_capability:
            out.append(
                CatalogDiagnostic(
                    name,
                    "handler_binding.asserted_capability",
                    DiagnosticCode.HANDLER_BINDING_CONFLICT,
                    "a handler binding with a different asserted capability was already bound",
                )
            )
    return out


def submit_entry(
    draft: GenerationDraft,
    submission: CatalogEntrySubmission,
    platform_owned: Mapping[str, ActionOwner],
    *,
    source_scope: WorkScopeLike,
    metadata_view: RuntimeMetadataView | None = None,
) -> SubmitDecision:
    """Admit one source's submission (§8.2 steps 2-4, §8.3).

    Args:
        draft: the current generation state.
        submission: the descriptor and optional handler binding.
        platform_owned: reserved action types and their designated platform owners.
        source_scope: the trusted Catalog scope the source was read under; it must equal
            the generation's complete scope (§8.4).
        metadata_view: the bound view, when available, to check that key-shape inputs
            are declared inputs of the action.

    Returns:
        ``Accepted``, ``IdempotentDuplicate`` or ``Rejected`` (see module docstring).
    """
    entry_name = submission.entry_name
    if draft.state is not GenerationState.OPEN:
        return _refuse_terminal(draft, entry_name)
    mismatched = draft.scope.mismatched_components(source_scope)
    if mismatched:
        return _poison(
            draft,
            [
                CatalogDiagnostic(
                    entry_name,
                    f"scope.{c}",
                    DiagnosticCode.SCOPE_MISMATCH,
                    "the source's trusted Catalog scope differs from the generation's binding",
                )
                for c in mismatched
            ],
        )
    issues = submission.validate()
    if not issues and metadata_view is not None:
        issues = _view_issues(draft, submission, metadata_view)
    if issues:
        return Rejected(draft, tuple(issues))
    entry = CatalogEntry.from_submission(submission)
    conflicts = _conflicts(draft, entry, platform_owned)
    if conflicts:
        return _poison(draft, conflicts)
    existing = draft.get_entry(entry.action_type)
    if existing is None:
        return Accepted(draft._with_entry(entry), entry)
    if existing.entry_digest == entry.entry_digest or entry.handler_binding is None:
        # Byte-identical resubmission, or the owner's contract restated after its handler
        # was bound (owner and descriptor are equal, or _conflicts would have said so).
        return IdempotentDuplicate(draft, existing)
    # The designated owner binds exactly one matching handler to its admitted contract.
    return Accepted(draft._with_entry(entry), entry, bound_contract=True)


def seal(draft: GenerationDraft) -> SealDecision:
    """Seal the generation: sort entries and compute the ``CatalogDigest`` (§8.2 step 5-6).

    Sealing a SEALED draft again is idempotent (``already_sealed``); a REJECTED draft is
    never sealable.
    """
    if draft.state is GenerationState.REJECTED:
        return Rejected(draft, (_refuse_terminal(draft, "").diagnostics[0], *draft.rejection))
    generation = SealedGeneration.build(
        draft.binding, draft.generation_id, draft.entries, draft.contract_version
    )
    if draft.state is GenerationState.SEALED:
        if draft.catalog_digest != generation.catalog_digest:
            return Rejected(
                draft,
                (
                    CatalogDiagnostic(
                        "",
                        "catalog_digest",
                        DiagnosticCode.DIGEST_MISMATCH,
                        "sealed digest does not match entries",
                    ),
                ),
            )
        return Sealed(draft, generation, already_sealed=True)
    if draft.state is not GenerationState.OPEN:
        return _refuse_terminal(draft, "")
    sealed = replace(draft, state=GenerationState.SEALED, catalog_digest=generation.catalog_digest)
    return Sealed(sealed, generation)
