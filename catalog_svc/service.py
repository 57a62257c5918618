"""The catalog service layer: trust checks, domain decisions, errors (§7.1, §8, §10.0).

Servicers decode a request into domain values and call one method here; this layer

* derives the trusted scope from the caller's credential (``services.auth``) and refuses
  a nested body field that disagrees with it (``PERMISSION_DENIED``) — the interceptor
  only checks top-level ``org_id``/``scope``/``binding`` fields;
* validates through the domain (every issue collected; ``INVALID_ARGUMENT`` naming the
  request field) and lets the pure generation builder decide (§8.2, §8.3);
* calls exactly one repository method per RPC (one transaction), and after the commit
  turns refusals into errors: a submission that violates §8.3 *commits* the REJECTED
  generation and then answers ``FAILED_PRECONDITION`` with the conflict code, the entry
  and the request field.

Mutating methods take the request's deduplication key and an encoder that serializes
the response inside the transaction, and return the response bytes (fresh or replayed).

Entry submissions (:class:`EntryRequest`): ``source`` PLATFORM / PACK / EXTENSION is the
owner kind and ``handler_binding.owner_registration_id`` the owner registration; a
contract-only entry names only its designated owner. ``source`` DISTRIBUTION is a
distribution-owned handler binding for an action type its owner already declared in the
generation: owner and declared descriptor come from that admitted entry, and the
request's descriptor is the capability the handler *asserts* (equal or narrower — a
broader one rejects the generation, §8.3). Action types submitted from the PLATFORM
source are platform-owned within the generation: no pack or extension may claim them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import IntEnum
from typing import Any

from catalog_svc.domain import (
    SUPPORTED_CONTRACT_VERSIONS,
    ActionOwner,
    BindingGap,
    CapabilityDescriptor,
    CatalogDiagnostic,
    CatalogEntrySubmission,
    Diagnostic,
    DiagnosticCode,
    DomainValidationError,
    GenerationDraft,
    GenerationState,
    HandlerBinding,
    OwnerKind,
    Rejected,
    RuntimeHandlerTuple,
    RuntimeMetadataView,
    RuntimeWorkBinding,
    RuntimeWorkBindingDigest,
    RuntimeWorkScope,
    SealedGeneration,
    SubmitDecision,
    binding_gaps,
    normalize_action_type,
    seal,
    submit_entry,
)
from catalog_svc.store import (
    BindingRecord,
    CatalogRepository,
    Encoder,
    EntryPage,
    EntryRecord,
    GenerationRecord,
    InstallationScope,
    ReferenceIdentity,
    ReferenceRecord,
    SealResult,
    SubmitResult,
    ViewRecord,
)
from services.auth import TrustedIdentity
from services.db import ID_LEN
from services.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from services.request_dedupe import Deduplicated, RequestKey

from .api.issues import catalog_error, invalid

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MAX_PAGE_SIZE",
    "CatalogService",
    "EntryRequest",
    "EntrySource",
    "GenerationSupport",
    "installation_scope",
    "work_scope",
]

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 500


class EntrySource(IntEnum):
    """Mirror of ``catalog.v1.EntrySource``: who submitted an entry (§8.1)."""

    UNSPECIFIED = 0
    PLATFORM = 1
    PACK = 2
    EXTENSION = 3
    DISTRIBUTION = 4


@dataclass(frozen=True, slots=True)
class EntryRequest:
    """A decoded ``SubmitEntryRequest`` before it meets the generation (module doc).

    ``descriptor`` is the declared descriptor — for DISTRIBUTION the asserted one;
    ``handler`` is ``None`` for a contract-only entry.
    """

    action_type: str
    source: EntrySource
    owner_registration_id: str
    descriptor: CapabilityDescriptor
    handler: HandlerBinding | None


@dataclass(frozen=True, slots=True)
class GenerationSupport:
    """Verdict of a runtime release for one sealed generation (§8.4)."""

    generation_id: str
    catalog_digest: str
    gaps: tuple[BindingGap, ...]


def _new_generation_id() -> str:
    return f"gen-{uuid.uuid4().hex}"


# -- trust ---------------------------------------------------------------------------------


def _denied(field_path: str) -> PermissionDeniedError:
    return PermissionDeniedError(
        "request scope does not match the caller's credential",
        reason="scope_mismatch",
        field_path=field_path,
    )


def work_scope(
    identity: TrustedIdentity, requested: RuntimeWorkScope, prefix: str = "scope"
) -> RuntimeWorkScope:
    """The caller's complete trusted work scope; ``requested`` must equal it.

    Raises:
        PermissionDeniedError: no complete work scope in the credential, or a component
            of ``requested`` differs.
    """
    trusted = identity.require_work_scope()
    scope = RuntimeWorkScope(
        trusted.org_id,
        trusted.app_installation_id,
        trusted.runtime_capability_id,
        RuntimeWorkBindingDigest(trusted.runtime_work_binding_digest),
    )
    mismatched = scope.mismatched_components(requested)
    if mismatched:
        raise _denied(f"{prefix}.{mismatched[0]}")
    return scope


def installation_scope(
    identity: TrustedIdentity,
    org_id: str,
    app_installation_id: str,
    *,
    org_path: str,
    installation_path: str,
) -> InstallationScope:
    """``(org, installation)`` of a metadata-view request, confirmed by the credential.

    Raises:
        InvalidArgumentError: a component is empty.
        PermissionDeniedError: it differs from (or is not carried by) the credential.
    """
    for value, path in ((org_id, org_path), (app_installation_id, installation_path)):
        if not value:
            raise InvalidArgumentError(
                f"{path} is required", reason="missing_field", field_path=path
            )
    if org_id != identity.org_id:
        raise _denied(org_path)
    if app_installation_id != identity.org.app_installation_id:
        raise _denied(installation_path)
    return InstallationScope(org_id, app_installation_id)


def _check_binding(identity: TrustedIdentity, binding: RuntimeWorkBinding) -> None:
    issues = binding.validate()
    for name in ("org_id", "app_installation_id", "runtime_capability_id"):
        value = getattr(binding, name)
        if isinstance(value, str) and len(value) > ID_LEN:
            issues.append(
                Diagnostic(
                    name, DiagnosticCode.OUT_OF_RANGE, f"{name} must be at most {ID_LEN} characters"
                )
            )
    if issues:
        raise invalid(issues, "binding")
    trusted = identity.scope_components()
    for name in ("org_id", "app_installation_id", "runtime_capability_id"):
        if getattr(binding, name) != trusted[name]:
            raise _denied(f"binding.{name}")


# -- entry submissions ---------------------------------------------------------------------


def _entry_field(field: str) -> str:
    """Domain submission path -> request path (see the module docstring)."""
    if field.startswith("owner.registration_id"):
        return "handler_binding.owner_registration_id"
    if field == "owner" or field.startswith("owner."):
        return "source"
    asserted = "handler_binding.asserted_capability"
    if field.startswith(asserted):
        return "descriptor" + field[len(asserted) :]
    if field == "metadata_view":
        return "scope.runtime_work_binding_digest"
    return field


def _refused(
    draft: GenerationDraft, entry: str, field: str, code: DiagnosticCode, message: str
) -> Rejected:
    return Rejected(draft, (CatalogDiagnostic(entry, field, code, message),))


def _platform_owned(draft: GenerationDraft) -> dict[str, ActionOwner]:
    return {e.action_type: e.owner for e in draft.entries if e.owner.kind is OwnerKind.PLATFORM}


def _decide_submit(
    request: EntryRequest, source_scope: RuntimeWorkScope
) -> Callable[[GenerationDraft, RuntimeMetadataView], SubmitDecision]:
    def decide(draft: GenerationDraft, view: RuntimeMetadataView) -> SubmitDecision:
        name = normalize_action_type(request.action_type)
        distribution = request.source is EntrySource.DISTRIBUTION
        declared = draft.get_entry(name)
        if not distribution or draft.state is not GenerationState.OPEN:
            # (A closed generation refuses whatever is submitted; the owner kind is moot.)
            kind = OwnerKind.PLATFORM if distribution else OwnerKind(int(request.source))
            owner = ActionOwner(kind, request.owner_registration_id)
            submission = CatalogEntrySubmission(
                request.action_type, owner, request.descriptor, request.handler
            )
        elif declared is None or request.handler is None:
            return _refused(
                draft,
                name,
                "source",
                DiagnosticCode.DANGLING_REFERENCE,
                "a distribution handler binding needs its owner's declaration of the "
                "action type in this generation first",
            )
        else:
            asserted = request.descriptor.normalized()
            handler = replace(
                request.handler,
                # Asserting exactly the declaration is the same entry as the owner binding
                # its own handler, whichever way the binding arrives.
                asserted_capability=None if asserted == declared.descriptor else asserted,
            )
            submission = CatalogEntrySubmission(name, declared.owner, declared.descriptor, handler)
        return submit_entry(
            draft,
            submission,
            _platform_owned(draft),
            source_scope=source_scope,
            metadata_view=view,
        )

    return decide


def _generation_rejected(
    record: GenerationRecord, diagnostics: Sequence[CatalogDiagnostic]
) -> FailedPreconditionError:
    codes = ",".join(record.draft.rejection_codes()) or "unknown"
    return FailedPreconditionError(
        f"the catalog generation was rejected ({codes}); correct the source and open a new "
        "generation",
        reason=DiagnosticCode.GENERATION_REJECTED.value,
        field_path="catalog_generation_id",
        attributes={
            "rejection_reasons": codes,
            "issues": "; ".join(
                f"{d.entry}:{_entry_field(d.field)}:{d.code.value}" for d in diagnostics
            )[:1000],
        },
    )


# -- the service ---------------------------------------------------------------------------


def _response(outcome: Deduplicated[Any]) -> bytes:
    if outcome.response is None:  # encoders decline only for outcomes raised above
        raise FailedPreconditionError("the request produced no response", reason="internal")
    return outcome.response


class CatalogService:
    """The catalog use cases over one :class:`~catalog_svc.store.CatalogRepository`."""

    def __init__(
        self,
        repository: CatalogRepository,
        *,
        new_generation_id: Callable[[], str] = _new_generation_id,
    ) -> None:
        self._repo = repository
        self._new_generation_id = new_generation_id

    # -- bindings ----------------------------------------------------------------------

    async def register_binding(
        self,
        identity: TrustedIdentity,
        binding: RuntimeWorkBinding,
        key: RequestKey,
        encode: Encoder[BindingRecord],
    ) -> bytes:
        """Register a binding of the caller's org, installation and capability."""
        _check_binding(identity, binding)
        try:
            outcome = await self._repo.register_binding(binding, key, encode)
        except NotFoundError as exc:
            raise FailedPreconditionError(
                "the binding's metadata view is not published by its installation",
                reason="metadata_view_not_published",
                field_path="binding.runtime_metadata_view_digest",
            ) from exc
        return _response(outcome)

    async def get_binding(
        self, identity: TrustedIdentity, requested: RuntimeWorkScope
    ) -> BindingRecord:
        """The binding of the caller's complete work scope (``NOT_FOUND`` otherwise)."""
        scope = work_scope(identity, requested)
        record = await self._repo.get_binding(scope)
        if record is None:
            raise NotFoundError("runtime work binding", requested.runtime_work_binding_digest)
        return record

    # -- metadata views ----------------------------------------------------------------

    async def publish_view(
        self,
        scope: InstallationScope,
        view: RuntimeMetadataView,
        schema_generation: int,
        key: RequestKey,
        encode: Encoder[ViewRecord],
    ) -> bytes:
        """Publish a validated view for the (already confirmed) installation scope."""
        if schema_generation < 1:
            raise InvalidArgumentError(
                "view.schema_generation must be at least 1",
                reason="out_of_range",
                field_path="view.schema_generation",
            )
        return _response(await self._repo.publish_view(scope, view, schema_generation, key, encode))

    async def get_view(self, scope: InstallationScope, digest: str) -> ViewRecord:
        """The view as the (confirmed) installation published it."""
        record = await self._repo.get_view(scope, digest)
        if record is None:
            raise NotFoundError("metadata view", digest)
        return record

    async def delete_view(
        self, scope: InstallationScope, digest: str, key: RequestKey, encode: Encoder[bool]
    ) -> bytes:
        return _response(await self._repo.delete_view(scope, digest, key, encode))

    # -- generations -------------------------------------------------------------------

    async def open_generation(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        contract_version: int,
        key: RequestKey,
        encode: Encoder[GenerationRecord],
    ) -> bytes:
        """Open a generation bound to the registered binding of the caller's scope."""
        scope = work_scope(identity, requested)
        if contract_version not in SUPPORTED_CONTRACT_VERSIONS:
            raise InvalidArgumentError(
                f"contract_version must be one of {sorted(SUPPORTED_CONTRACT_VERSIONS)}",
                reason=DiagnosticCode.UNSUPPORTED_VERSION.value,
                field_path="contract_version",
            )
        try:
            outcome = await self._repo.open_generation(
                scope, self._new_generation_id(), contract_version, key, encode
            )
        except DomainValidationError as exc:
            issues = [i for i in exc.issues if isinstance(i, CatalogDiagnostic)]
            raise catalog_error(issues, lambda f: f) from exc
        return _response(outcome)

    async def submit_entry(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        generation_id: str,
        request: EntryRequest,
        key: RequestKey,
        encode: Encoder[SubmitResult],
    ) -> bytes:
        """Submit one entry; refusals raise after the transaction committed its effect."""
        scope = work_scope(identity, requested)
        outcome = await self._repo.submit_entry(
            scope, generation_id, _decide_submit(request, scope), key, encode
        )
        result = outcome.value
        if (
            outcome.response is None
            and result is not None
            and isinstance(result.decision, Rejected)
        ):
            attrs = {"generation_state": result.generation.draft.state.name}
            raise catalog_error(result.decision.diagnostics, _entry_field, attributes=attrs)
        return _response(outcome)

    async def seal_generation(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        generation_id: str,
        key: RequestKey,
        encode: Encoder[SealResult],
    ) -> bytes:
        """Seal an OPEN generation (idempotent once sealed); a REJECTED one never seals."""
        scope = work_scope(identity, requested)
        outcome = await self._repo.seal_generation(scope, generation_id, seal, key, encode)
        result = outcome.value
        if outcome.response is None and result is not None:
            decision = result.decision
            if isinstance(decision, Rejected):
                if result.generation.draft.state is GenerationState.REJECTED:
                    raise _generation_rejected(result.generation, decision.diagnostics[1:])
                raise catalog_error(decision.diagnostics, _entry_field)
        return _response(outcome)

    async def get_generation(
        self, identity: TrustedIdentity, requested: RuntimeWorkScope, generation_id: str
    ) -> GenerationRecord:
        """A generation of the caller's complete scope, in any state."""
        scope = work_scope(identity, requested)
        record = await self._repo.get_generation(scope, generation_id)
        if record is None:
            raise NotFoundError("catalog generation", generation_id)
        return record

    async def _sealed(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        generation_id: str,
        catalog_digest: str,
    ) -> GenerationRecord:
        scope = work_scope(identity, requested)
        record = await self._repo.get_generation(scope, generation_id)
        # Missing, other scope, unsealed or another digest: all answer the same NOT_FOUND.
        if (
            record is None
            or record.draft.state is not GenerationState.SEALED
            or record.draft.catalog_digest != catalog_digest
        ):
            raise NotFoundError("catalog generation", generation_id)
        return record

    async def get_entry(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        generation_id: str,
        catalog_digest: str,
        action_type: str,
        entry_digest: str,
        binding_fingerprint: str,
    ) -> EntryRecord:
        """One sealed entry by its exact §8.2 read key."""
        record = await self._sealed(identity, requested, generation_id, catalog_digest)
        entry = record.draft.get_entry(action_type)
        if entry is None:
            raise NotFoundError("catalog entry", normalize_action_type(action_type))
        if entry.entry_digest != entry_digest:
            raise FailedPreconditionError(
                "the entry digest differs from the sealed entry",
                reason="entry_digest_mismatch",
                field_path="entry_digest",
                attributes={"entry": entry.action_type},
            )
        if (entry.binding_fingerprint or "") != binding_fingerprint:
            raise FailedPreconditionError(
                "the binding fingerprint differs from the sealed entry",
                reason="binding_fingerprint_mismatch",
                field_path="binding_fingerprint",
                attributes={"entry": entry.action_type},
            )
        return record.entry_record(entry)

    async def list_entries(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        generation_id: str,
        catalog_digest: str,
        page_size: int,
        after: str | None,
    ) -> EntryPage:
        """A page of a sealed generation's entries in action-type order."""
        if page_size < 0:
            raise InvalidArgumentError(
                "page_size must not be negative", reason="out_of_range", field_path="page_size"
            )
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        record = await self._sealed(identity, requested, generation_id, catalog_digest)
        remaining = [e for e in record.draft.entries if after is None or e.action_type > after]
        page = remaining[:size]
        more = len(remaining) > size
        return EntryPage(
            record,
            tuple(record.entry_record(e) for e in page),
            page[-1].action_type if more and page else None,
        )

    async def delete_generation(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        generation_id: str,
        catalog_digest: str,
        key: RequestKey,
        encode: Encoder[bool],
    ) -> bytes:
        """Delete an unreferenced generation; a SEALED one needs its catalog digest."""
        scope = work_scope(identity, requested)

        def check(record: GenerationRecord) -> None:
            if record.draft.state is not GenerationState.SEALED:
                return
            if not catalog_digest:
                raise InvalidArgumentError(
                    "catalog_digest is required to delete a sealed generation",
                    reason="missing_field",
                    field_path="catalog_digest",
                )
            if record.draft.catalog_digest != catalog_digest:
                raise FailedPreconditionError(
                    "catalog_digest differs from the sealed generation",
                    reason="catalog_digest_mismatch",
                    field_path="catalog_digest",
                )

        return _response(
            await self._repo.delete_generation(scope, generation_id, check, key, encode)
        )

    # -- retention references ----------------------------------------------------------

    async def register_reference(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        reference: ReferenceIdentity,
        catalog_digest: str | None,
        expires_at: datetime | None,
        key: RequestKey,
        encode: Encoder[ReferenceRecord],
    ) -> bytes:
        """Register a retention reference on an artifact of the caller's scope."""
        scope = work_scope(identity, requested)
        return _response(
            await self._repo.register_reference(
                scope, reference, expires_at, catalog_digest, key, encode
            )
        )

    async def release_reference(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        reference: ReferenceIdentity,
        key: RequestKey,
        encode: Encoder[bool],
    ) -> bytes:
        """Release a retention reference (``False`` in the response when absent)."""
        scope = work_scope(identity, requested)
        return _response(await self._repo.release_reference(scope, reference, key, encode))

    # -- runtime handler availability --------------------------------------------------

    async def publish_release(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        release_id: str,
        supported_capability_version: int,
        tuples: Sequence[RuntimeHandlerTuple],
        key: RequestKey,
        encode: Encoder[int],
    ) -> bytes:
        """Replace what a runtime release can execute within the caller's scope."""
        scope = work_scope(identity, requested)
        for i, tp in enumerate(tuples):
            if tp.runtime_work_binding_digest != scope.runtime_work_binding_digest:
                raise _denied(f"tuples[{i}].runtime_work_binding_digest")
        return _response(
            await self._repo.publish_release(
                scope, release_id, supported_capability_version, tuples, key, encode
            )
        )

    async def verify_release(
        self,
        identity: TrustedIdentity,
        requested: RuntimeWorkScope,
        release_id: str,
        generation_ids: Sequence[str],
    ) -> list[GenerationSupport]:
        """§8.4 release rule: the gaps of a release for each generation its work uses."""
        scope = work_scope(identity, requested)
        release, generations = await self._repo.verification_inputs(
            scope, release_id, generation_ids
        )
        if release is None:
            raise NotFoundError("runtime release", release_id)
        out: list[GenerationSupport] = []
        for generation_id, record in generations:
            if record is None:
                raise NotFoundError("catalog generation", generation_id)
            d = record.draft
            if d.state is not GenerationState.SEALED or d.catalog_digest is None:
                asked = list(generation_ids)
                raise FailedPreconditionError(
                    f"catalog generation {generation_id!r} is not sealed",
                    reason="generation_not_sealed",
                    field_path=(
                        f"catalog_generation_ids[{asked.index(generation_id)}]"
                        if generation_id in asked
                        else ""
                    ),
                )
            sealed = SealedGeneration.build(
                d.binding, d.generation_id, d.entries, d.contract_version
            )
            gaps = binding_gaps(
                sealed,
                release.tuples,
                supported_capability_version=release.supported_capability_version,
            )
            out.append(GenerationSupport(generation_id, d.catalog_digest, gaps))
        return out
