"""``nexus.flow.catalog.v1.CatalogService``: thin decode -> service -> encode.

Every method reads the caller's :func:`~services.auth.current_identity` (the auth
interceptor already refused credentials and top-level scope fields that disagree with
it), decodes the request into domain values (:mod:`.requests`, :mod:`.mapping`), calls one
:class:`~catalog_svc.service.CatalogService` method and encodes the result. Errors are
``services.errors.FlowError`` subclasses mapped to status codes by the one interceptor;
nothing here sets a status code.

Mutating RPCs hand the service an encoder, because the response is recorded with the
request's ``request_id`` (keyed by the caller's complete trusted scope) inside the
mutation's transaction (``services.request_dedupe``): a retry gets the original bytes
back, a reuse of the id with another body is ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from catalog_svc.domain import IdempotentDuplicate, Rejected, Sealed
from catalog_svc.service import CatalogService, installation_scope
from catalog_svc.store import (
    BindingRecord,
    Encoder,
    GenerationRecord,
    ReferenceRecord,
    SealResult,
    SubmitResult,
    ViewRecord,
)
from services.auth import current_identity
from services.db import ID_LEN, KEY_LEN
from services.errors import InvalidArgumentError, OutOfRangeError
from services.paging import DEFAULT_CLIENT_MAX_BYTES, fit_page
from services.proto import catalog_v1

from .issues import require_text
from .mapping import (
    binding_from_proto,
    decode_page_token,
    encode_page_token,
    entry_to_proto,
    gap_to_proto,
    generation_to_proto,
    reference_to_proto,
    registered_binding_to_proto,
    scope_from_proto,
)
from .requests import (
    digest_field,
    entry_request,
    generation_id,
    handler_tuples,
    reference_request,
    request_key,
)
from .view_mapping import view_from_proto, view_to_proto

__all__ = ["CatalogServicer"]

T = TypeVar("T")
R = TypeVar("R", bound=Message)


def _encoder(build: Callable[[T], Message | None], max_bytes: int) -> Encoder[T]:
    """Serializes a mutation's response inside its transaction: a response over the
    message limit raises there, so the mutation rolls back instead of committing an
    answer no client can receive."""

    def encode(value: T) -> bytes | None:
        msg = build(value)
        if msg is None:
            return None
        data = msg.SerializeToString(deterministic=True)
        if len(data) > max_bytes:
            raise OutOfRangeError(
                f"the response would exceed the message size limit of {max_bytes} bytes",
                reason="response_too_large",
                attributes={"max_message_bytes": str(max_bytes)},
            )
        return data

    return encode


def _parse(cls: type[R], data: bytes) -> R:
    msg = cls()
    msg.ParseFromString(data)
    return msg


def _required_message(request: Message, name: str) -> None:
    if not request.HasField(name):
        raise InvalidArgumentError(f"{name} is required", reason="missing_field", field_path=name)


def _view_response(record: ViewRecord) -> catalog_v1.MetadataView:
    return view_to_proto(
        record.view,
        org_id=record.scope.org_id,
        app_installation_id=record.scope.app_installation_id,
        digest=record.digest,
        schema_generation=record.schema_generation,
        created_at=record.created_at,
    )


class CatalogServicer(catalog_v1.CatalogServiceServicer):
    """The catalog RPCs over one :class:`~catalog_svc.service.CatalogService`."""

    def __init__(
        self, service: CatalogService, *, max_response_bytes: int = DEFAULT_CLIENT_MAX_BYTES
    ) -> None:
        self._svc = service
        self._max_response = max_response_bytes

    def _encode(self, build: Callable[[T], Message | None]) -> Encoder[T]:
        return _encoder(build, self._max_response)

    # -- bindings ----------------------------------------------------------------------

    async def RegisterWorkBinding(
        self, request: catalog_v1.RegisterWorkBindingRequest, context: Any
    ) -> catalog_v1.RegisterWorkBindingResponse:
        key = request_key(current_identity(), "RegisterWorkBinding", request)
        require_text(request.org_id, "org_id", max_length=ID_LEN)
        _required_message(request, "binding")

        def build(record: BindingRecord) -> Message:
            return catalog_v1.RegisterWorkBindingResponse(
                work_binding=registered_binding_to_proto(record)
            )

        data = await self._svc.register_binding(
            current_identity(), binding_from_proto(request.binding), key, self._encode(build)
        )
        return _parse(catalog_v1.RegisterWorkBindingResponse, data)

    async def GetWorkBinding(
        self, request: catalog_v1.GetWorkBindingRequest, context: Any
    ) -> catalog_v1.GetWorkBindingResponse:
        record = await self._svc.get_binding(current_identity(), scope_from_proto(request.scope))
        return catalog_v1.GetWorkBindingResponse(work_binding=registered_binding_to_proto(record))

    # -- metadata views ----------------------------------------------------------------

    async def PublishMetadataView(
        self, request: catalog_v1.PublishMetadataViewRequest, context: Any
    ) -> catalog_v1.PublishMetadataViewResponse:
        key = request_key(current_identity(), "PublishMetadataView", request)
        require_text(request.org_id, "org_id", max_length=ID_LEN)
        _required_message(request, "view")
        scope = installation_scope(
            current_identity(),
            request.view.org_id,
            request.view.app_installation_id,
            org_path="view.org_id",
            installation_path="view.app_installation_id",
        )
        view = view_from_proto(request.view)

        def build(record: ViewRecord) -> Message:
            return catalog_v1.PublishMetadataViewResponse(view=_view_response(record))

        data = await self._svc.publish_view(
            scope, view, request.view.schema_generation, key, self._encode(build)
        )
        return _parse(catalog_v1.PublishMetadataViewResponse, data)

    async def GetMetadataView(
        self, request: catalog_v1.GetMetadataViewRequest, context: Any
    ) -> catalog_v1.GetMetadataViewResponse:
        scope = installation_scope(
            current_identity(),
            request.org_id,
            request.app_installation_id,
            org_path="org_id",
            installation_path="app_installation_id",
        )
        digest = digest_field(
            request.runtime_metadata_view_digest,
            "runtime_metadata_view_digest",
            kind="runtime_metadata_view",
        )
        record = await self._svc.get_view(scope, digest)
        return catalog_v1.GetMetadataViewResponse(view=_view_response(record))

    async def DeleteMetadataView(
        self, request: catalog_v1.DeleteMetadataViewRequest, context: Any
    ) -> catalog_v1.DeleteMetadataViewResponse:
        key = request_key(current_identity(), "DeleteMetadataView", request)
        scope = installation_scope(
            current_identity(),
            request.org_id,
            request.app_installation_id,
            org_path="org_id",
            installation_path="app_installation_id",
        )
        digest = digest_field(
            request.runtime_metadata_view_digest,
            "runtime_metadata_view_digest",
            kind="runtime_metadata_view",
        )
        data = await self._svc.delete_view(
            scope,
            digest,
            key,
            self._encode(lambda deleted: catalog_v1.DeleteMetadataViewResponse(deleted=deleted)),
        )
        return _parse(catalog_v1.DeleteMetadataViewResponse, data)

    # -- generations -------------------------------------------------------------------

    async def OpenGeneration(
        self, request: catalog_v1.OpenGenerationRequest, context: Any
    ) -> catalog_v1.OpenGenerationResponse:
        key = request_key(current_identity(), "OpenGeneration", request)

        def build(record: GenerationRecord) -> Message:
            return catalog_v1.OpenGenerationResponse(generation=generation_to_proto(record))

        data = await self._svc.open_generation(
            current_identity(),
            scope_from_proto(request.scope),
            request.contract_version,
            key,
            self._encode(build),
        )
        return _parse(catalog_v1.OpenGenerationResponse, data)

    async def SubmitEntry(
        self, request: catalog_v1.SubmitEntryRequest, context: Any
    ) -> catalog_v1.SubmitEntryResponse:
        key = request_key(current_identity(), "SubmitEntry", request)
        scope = scope_from_proto(request.scope)
        gid = generation_id(request.catalog_generation_id)
        entry = entry_request(request)

        def build(result: SubmitResult) -> Message | None:
            decision = result.decision
            if isinstance(decision, Rejected):
                return None  # the service raises the refusal after the commit
            return catalog_v1.SubmitEntryResponse(
                entry=entry_to_proto(result.generation.entry_record(decision.entry)),
                already_present=isinstance(decision, IdempotentDuplicate),
            )

        data = await self._svc.submit_entry(
            current_identity(), scope, gid, entry, key, self._encode(build)
        )
        return _parse(catalog_v1.SubmitEntryResponse, data)

    async def SealGeneration(
        self, request: catalog_v1.SealGenerationRequest, context: Any
    ) -> catalog_v1.SealGenerationResponse:
        key = request_key(current_identity(), "SealGeneration", request)
        scope = scope_from_proto(request.scope)
        gid = generation_id(request.catalog_generation_id)

        def build(result: SealResult) -> Message | None:
            if not isinstance(result.decision, Sealed):
                return None
            return catalog_v1.SealGenerationResponse(
                generation=generation_to_proto(result.generation)
            )

        data = await self._svc.seal_generation(
            current_identity(), scope, gid, key, self._encode(build)
        )
        return _parse(catalog_v1.SealGenerationResponse, data)

    async def GetGeneration(
        self, request: catalog_v1.GetGenerationRequest, context: Any
    ) -> catalog_v1.GetGenerationResponse:
        record = await self._svc.get_generation(
            current_identity(),
            scope_from_proto(request.scope),
            generation_id(request.catalog_generation_id),
        )
        return catalog_v1.GetGenerationResponse(generation=generation_to_proto(record))

    async def GetEntry(
        self, request: catalog_v1.GetEntryRequest, context: Any
    ) -> catalog_v1.GetEntryResponse:
        record = await self._svc.get_entry(
            current_identity(),
            scope_from_proto(request.scope),
            generation_id(request.catalog_generation_id),
            digest_field(request.catalog_digest, "catalog_digest", kind="catalog"),
            require_text(request.action_type, "action_type", max_length=KEY_LEN),
            digest_field(request.entry_digest, "entry_digest", kind="catalog_entry"),
            digest_field(
                request.binding_fingerprint,
                "binding_fingerprint",
                kind="binding_fingerprint",
                required=False,
            ),
        )
        return catalog_v1.GetEntryResponse(entry=entry_to_proto(record))

    async def ListEntries(
        self, request: catalog_v1.ListEntriesRequest, context: Any
    ) -> catalog_v1.ListEntriesResponse:
        gid = generation_id(request.catalog_generation_id)
        digest = digest_field(request.catalog_digest, "catalog_digest", kind="catalog")
        after = decode_page_token(request.page_token, gid, digest)
        identity, scope = current_identity(), scope_from_proto(request.scope)

        async def fetch(size: int) -> catalog_v1.ListEntriesResponse:
            page = await self._svc.list_entries(identity, scope, gid, digest, size, after)
            return catalog_v1.ListEntriesResponse(
                entries=[entry_to_proto(e) for e in page.entries],
                next_page_token=(
                    ""
                    if page.next_after is None
                    else encode_page_token(gid, digest, page.next_after)
                ),
            )

        # Paged by bytes as well as by count (services.paging).
        return await fit_page(
            fetch,
            lambda r: r.entries,
            page_size=request.page_size,
            budget=self._max_response,
            what="catalog entry",
        )

    async def DeleteGeneration(
        self, request: catalog_v1.DeleteGenerationRequest, context: Any
    ) -> catalog_v1.DeleteGenerationResponse:
        key = request_key(current_identity(), "DeleteGeneration", request)
        data = await self._svc.delete_generation(
            current_identity(),
            scope_from_proto(request.scope),
            generation_id(request.catalog_generation_id),
            digest_field(request.catalog_digest, "catalog_digest", kind="catalog", required=False),
            key,
            self._encode(lambda deleted: catalog_v1.DeleteGenerationResponse(deleted=deleted)),
        )
        return _parse(catalog_v1.DeleteGenerationResponse, data)

    # -- retention references ----------------------------------------------------------

    async def RegisterReference(
        self, request: catalog_v1.RegisterReferenceRequest, context: Any
    ) -> catalog_v1.RegisterReferenceResponse:
        key = request_key(current_identity(), "RegisterReference", request)
        scope = scope_from_proto(request.scope)
        _required_message(request, "reference")
        ref = reference_request(request.reference, register=True)

        def build(record: ReferenceRecord) -> Message:
            return catalog_v1.RegisterReferenceResponse(reference=reference_to_proto(record))

        data = await self._svc.register_reference(
            current_identity(),
            scope,
            ref.identity,
            ref.catalog_digest,
            ref.expires_at,
            key,
            self._encode(build),
        )
        return _parse(catalog_v1.RegisterReferenceResponse, data)

    async def ReleaseReference(
        self, request: catalog_v1.ReleaseReferenceRequest, context: Any
    ) -> catalog_v1.ReleaseReferenceResponse:
        key = request_key(current_identity(), "ReleaseReference", request)
        scope = scope_from_proto(request.scope)
        _required_message(request, "reference")
        ref = reference_request(request.reference, register=False)
        data = await self._svc.release_reference(
            current_identity(),
            scope,
            ref.identity,
            key,
            self._encode(lambda released: catalog_v1.ReleaseReferenceResponse(released=released)),
        )
        return _parse(catalog_v1.ReleaseReferenceResponse, data)

    # -- runtime handler availability --------------------------------------------------

    async def PublishHandlerAvailability(
        self, request: catalog_v1.PublishHandlerAvailabilityRequest, context: Any
    ) -> catalog_v1.PublishHandlerAvailabilityResponse:
        key = request_key(current_identity(), "PublishHandlerAvailability", request)
        scope = scope_from_proto(request.scope)
        release = require_text(request.runtime_release_id, "runtime_release_id", max_length=ID_LEN)
        if request.supported_capability_version < 1:
            raise InvalidArgumentError(
                "supported_capability_version must be at least 1",
                reason="out_of_range",
                field_path="supported_capability_version",
            )
        tuples = handler_tuples(request.tuples)
        data = await self._svc.publish_release(
            current_identity(),
            scope,
            release,
            request.supported_capability_version,
            tuples,
            key,
            self._encode(lambda n: catalog_v1.PublishHandlerAvailabilityResponse(accepted_count=n)),
        )
        return _parse(catalog_v1.PublishHandlerAvailabilityResponse, data)

    async def VerifyRuntimeBinary(
        self, request: catalog_v1.VerifyRuntimeBinaryRequest, context: Any
    ) -> catalog_v1.VerifyRuntimeBinaryResponse:
        scope = scope_from_proto(request.scope)
        release = require_text(request.runtime_release_id, "runtime_release_id", max_length=ID_LEN)
        ids = [
            generation_id(g, f"catalog_generation_ids[{i}]")
            for i, g in enumerate(request.catalog_generation_ids)
        ]
        verdicts = await self._svc.verify_release(current_identity(), scope, release, ids)
        generations = [
            catalog_v1.GenerationSupport(
                catalog_generation_id=v.generation_id,
                catalog_digest=v.catalog_digest,
                supported=not v.gaps,
                gaps=[gap_to_proto(g) for g in v.gaps],
            )
            for v in verdicts
        ]
        return catalog_v1.VerifyRuntimeBinaryResponse(
            supported=all(g.supported for g in generations), generations=generations
        )
