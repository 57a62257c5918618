"""``nexus.flow.runtime.v1.RecordService``: the gRPC face of :mod:`runtime_svc.records`.

Servicer methods are thin: decode → :class:`~runtime_svc.records.RecordEngine` → encode.
The org always comes from the verified credential (:func:`services.auth.current_identity`);
writes also need its complete work scope, which selects the metadata view the request is
validated against. The auth interceptor has already rejected a body ``org_id``/``scope``
that disagrees with the credential, so body values are checked there, never used here.

**Metadata views** come from the catalog service through the trusted scope:
``GetWorkBinding(scope)`` names the binding's view digest, ``GetMetadataView`` returns the
view. :class:`CatalogRecordViews` caches both: a binding is immutable and named by its
content digest, and a view is an immutable, content-addressed artifact, so a cached entry
can never go stale. (:class:`runtime_svc.catalog_client.GrpcCatalogClient` reduces a view
to the compiler's document, which lacks the write rules — required, max length,
picklists, precision, read-only — so this module reads the view proto itself, with the
same scoped credentials.)

**Request ids.** Mutating requests carry ``request_id`` (required). The response is
recorded with it in the record transaction (``RecordEngine.mutate_once``,
``services.request_dedupe``), keyed by the caller's complete trusted scope: a retry of an
applied request replays the *original* response (the record as that write left it, and
the runs it started) without touching the record, a reuse of the id with another body
fails ``INVALID_ARGUMENT``. The ledger is read inside the one record transaction.

**After-save triggers** (issue 5, "Starting runs"). The view source also returns the
request-bound binding (:class:`~runtime_svc.definitions.RequestBoundView`). When that view
subscribes an after-save Flow to the write's object and event, the servicer admits the
plans *before* the record transaction
(:func:`~runtime_svc.runs.select_after_save_plans`; a refusal fails the request before
anything is written) and accepts their runs *inside* it, after the business rows
(:func:`~runtime_svc.runs.admit_after_save_runs_txn` through
``RecordEngine.mutate_once(on_applied=…)``). Run keys derive from the mutation; a retried
request replays the run ids of its first application from the ledger. A write the view
subscribes nothing to skips admission entirely: no query beyond the record transaction.

**Before-save triggers** (issue 6). When the view subscribes a before-save Flow to the
write's object and event, the record engine runs
:meth:`~runtime_svc.embedded.BeforeSaveDispatcher.transform_txn` inside its one record
transaction, after the stored row is read and before the row is written (plan selection,
the transforms in dispatch order, re-validation — see :mod:`runtime_svc.embedded`). A
failing or over-budget Flow fails the write ``FAILED_PRECONDITION``
(``before_save.flow_failed`` / ``before_save.budget_exceeded``), nothing is written, and
its audit row is appended after the rollback.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.catalog_client import (
    ScopedCredentials,
    binding_doc,
    catalog_channel,
    metadata_view_doc,
)
from runtime_svc.compiler.inputs import (
    FieldView,
    MetadataViewInput,
    ObjectView,
    RelationshipView,
    RuntimeWorkBindingRef,
)
from runtime_svc.definitions.admission import RequestBoundView, TriggerSelection
from runtime_svc.definitions.inputs import pin_subscription_versions
from runtime_svc.embedded import (
    ActivationRead,
    BeforeSaveDispatcher,
    BeforeSaveFailedError,
    record_failure,
)
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.records import (
    Actor,
    FieldRules,
    FieldType,
    MutationResult,
    ParentRef,
    RecordEngine,
    RecordMutation,
    RecordState,
    RecordView,
    prepare_create,
    prepare_delete,
    prepare_update,
)
from runtime_svc.records.engine import ChangeSink, Transform
from runtime_svc.records.view import IMPLICIT_ID_FIELD
from runtime_svc.runs.after_save import admit_after_save_runs_txn, select_after_save_plans
from services.auth import TrustedRuntimeWorkScope, bearer_metadata, current_identity
from services.config import ServiceConfig
from services.errors import FailedPreconditionError, FlowError, InvalidArgumentError
from services.grpc_server import ServiceRegistration
from services.proto import catalog_v1, common_v1, runtime_v1
from services.remote_errors import remote_error
from services.request_dedupe import DedupeScope, RequestKey

__all__ = [
    "SERVICE_NAME",
    "CatalogRecordViews",
    "RecordServicer",
    "RecordViewSource",
    "build_record_service",
    "record_proto",
    "record_view_from_proto",
]

#: A response message of a record write.
M = TypeVar("M", bound=Message)

SERVICE_NAME = "nexus.flow.runtime.v1.RecordService"

Context = Any  # grpc.aio.ServicerContext

#: Metadata views (and binding → view digests) kept per process.
_MAX_CACHED_VIEWS = 256
#: Deadline of one catalog call (as ``runtime_svc.catalog_client``).
_CATALOG_TIMEOUT_S = 10.0

_F = catalog_v1.FieldType
_FIELD_TYPES: Mapping[int, FieldType] = {
    _F.FIELD_TYPE_STRING: FieldType.STRING,
    _F.FIELD_TYPE_TEXT: FieldType.TEXT,
    _F.FIELD_TYPE_INTEGER: FieldType.INTEGER,
    _F.FIELD_TYPE_DECIMAL: FieldType.DECIMAL,
    _F.FIELD_TYPE_BOOLEAN: FieldType.BOOLEAN,
    _F.FIELD_TYPE_DATE: FieldType.DATE,
    _F.FIELD_TYPE_DATETIME: FieldType.DATETIME,
    _F.FIELD_TYPE_PICKLIST: FieldType.PICKLIST,
    _F.FIELD_TYPE_MULTI_PICKLIST: FieldType.MULTI_PICKLIST,
    _F.FIELD_TYPE_REFERENCE: FieldType.REFERENCE,
    _F.FIELD_TYPE_EMAIL: FieldType.EMAIL,
    _F.FIELD_TYPE_CURRENCY: FieldType.CURRENCY,
    _F.FIELD_TYPE_ID: FieldType.ID,
}
#: Record field types → the compiler's value types (``FieldView.type``).
_COMPILER_TYPES: Mapping[FieldType, str] = {
    FieldType.INTEGER: "number",
    FieldType.DECIMAL: "number",
    FieldType.CURRENCY: "number",
    FieldType.BOOLEAN: "boolean",
    FieldType.DATE: "date",
    FieldType.DATETIME: "datetime",
    FieldType.REFERENCE: "reference",
    FieldType.ID: "id",
}
_MASTER_DETAIL = catalog_v1.RelationshipKind.RELATIONSHIP_KIND_MASTER_DETAIL
_AFTER_SAVE_TIMING = common_v1.TriggerTiming.TRIGGER_TIMING_AFTER_SAVE
_BEFORE_SAVE_TIMING = common_v1.TriggerTiming.TRIGGER_TIMING_BEFORE_SAVE
_EVENTS: Mapping[int, str] = {
    common_v1.TriggerEvent.TRIGGER_EVENT_CREATE: "create",
    common_v1.TriggerEvent.TRIGGER_EVENT_UPDATE: "update",
    common_v1.TriggerEvent.TRIGGER_EVENT_DELETE: "delete",
}


# --- metadata views -----------------------------------------------------------------------


def record_view_from_proto(view: Any) -> RecordView:
    """The :class:`RecordView` of a ``catalog_v1.MetadataView``.

    Relationships lock the parent when the catalog marks them lock-relevant or
    master-detail (as :func:`runtime_svc.catalog_client.metadata_view_doc` does). Every
    object gets the read-only implicit ``Id`` field. A field type this runtime does not
    know is read-only (fail closed: a value it cannot validate is never written). Trigger
    subscriptions and actions are not part of the record engine's view.
    """
    objects: list[ObjectView] = []
    rules: list[tuple[str, FieldRules]] = []
    for o in view.objects:
        fields: list[FieldView] = []
        for f in o.fields:
            known = f.type in _FIELD_TYPES
            ftype = _FIELD_TYPES.get(f.type, FieldType.STRING)
            reference_to = f.reference_object_api_name or None
            fields.append(FieldView(f.api_name, _COMPILER_TYPES.get(ftype, "string"), reference_to))
            rules.append(
                (
                    o.api_name,
                    FieldRules(
                        name=f.api_name,
                        type=ftype,
                        required=f.required,
                        max_length=max(f.max_length, 0),
                        precision=max(f.precision, 0),
                        scale=max(f.scale, 0),
                        picklist_values=tuple(f.picklist_values),
                        reference_to=reference_to,
                        read_only=f.read_only or not known or ftype is FieldType.ID,
                    ),
                )
            )
        if not any(f.name == IMPLICIT_ID_FIELD for f in fields):
            fields.insert(0, FieldView(IMPLICIT_ID_FIELD, "id"))
            rules.append((o.api_name, FieldRules(IMPLICIT_ID_FIELD, FieldType.ID, read_only=True)))
        objects.append(ObjectView(o.api_name, tuple(fields), o.history_tracked))
    relationships = tuple(
        RelationshipView(
            name=r.name,
            parent_object=r.parent_object_api_name,
            child_object=r.child_object_api_name,
            field=r.child_field_api_name,
            max_children=r.max_children if r.max_children > 0 else None,
            lock_parent=bool(r.lock_relevant or r.kind == _MASTER_DETAIL),
        )
        for r in view.relationships
    )
    metadata = MetadataViewInput(
        digest=view.runtime_metadata_view_digest,
        objects=tuple(objects),
        relationships=relationships,
    )
    return RecordView.build(metadata, rules)


@dataclass(frozen=True)
class BoundRecordView:
    """The metadata view a write is bound to, in the two shapes a write needs.

    Attributes:
        records: the record engine's view (fields, write rules, relationships).
        request: the request-bound binding and admission view (trigger subscriptions);
            its ``view`` is ``None`` when the catalog's view is not a usable admission
            input, which fails admission closed for subscribed writes only.
        after_save: ``(object, event)`` pairs the view subscribes an after-save Flow to.
        before_save: ``(object, event)`` pairs the view subscribes a before-save Flow to.
    """

    records: RecordView
    request: RequestBoundView
    after_save: frozenset[tuple[str, str]]
    before_save: frozenset[tuple[str, str]] = frozenset()

    def subscribes_after_save(self, object_name: str, event: str) -> bool:
        """Whether a write of ``event`` on ``object_name`` needs after-save admission."""
        return (object_name, event) in self.after_save

    def subscribes_before_save(self, object_name: str, event: str) -> bool:
        """Whether a write of ``event`` on ``object_name`` runs before-save Flows."""
        return (object_name, event) in self.before_save


def _binding_ref_from_proto(registered: Any, binding_digest: str) -> RuntimeWorkBindingRef:
    """The :class:`RuntimeWorkBindingRef` of a ``common_v1.RuntimeWorkBinding`` (through
    :func:`runtime_svc.catalog_client.binding_doc`, the definitions' mapping)."""
    return RuntimeWorkBindingRef(**binding_doc(registered, binding_digest))


def _admission_view_from_proto(view: Any) -> MetadataViewInput | None:
    """The admission view of a ``catalog_v1.MetadataView``, as activation compiles it
    (:func:`runtime_svc.catalog_client.metadata_view_doc`, version-less subscriptions
    pinned to 0), or ``None`` when it is not a valid compiler input."""
    try:
        return MetadataViewInput.from_dict(pin_subscription_versions(metadata_view_doc(view), {}))
    except ValueError:
        return None


def _timing_pairs(view: Any, timing: Any) -> frozenset[tuple[str, str]]:
    return frozenset(
        (s.object_api_name, _EVENTS[e])
        for s in view.trigger_subscriptions
        if s.timing == timing
        for e in s.events
        if e in _EVENTS
    )


class RecordViewSource(Protocol):
    """Where the record service gets the metadata view of a trusted work scope."""

    async def view_for(self, scope: TrustedRuntimeWorkScope) -> RecordView:
        """The view bound to ``scope``.

        Raises:
            FailedPreconditionError: the catalog has no binding or view for ``scope``.
            UnavailableError: the catalog cannot be reached.
        """
        ...

    async def bound_view_for(self, scope: TrustedRuntimeWorkScope) -> BoundRecordView:
        """The view bound to ``scope`` with its binding and trigger subscriptions.

        Raises:
            FailedPreconditionError: the catalog has no binding or view for ``scope``.
            UnavailableError: the catalog cannot be reached.
        """
        ...


def _catalog_failure(exc: grpc.aio.AioRpcError, what: str) -> FlowError:
    def missing() -> FlowError:
        return FailedPreconditionError(
            f"the catalog has no {what} for this work scope", reason="metadata_view_missing"
        )

    return remote_error(exc, service="catalog", what=what, not_found=missing)


def _scope_proto(scope: TrustedRuntimeWorkScope) -> Any:
    return common_v1.TrustedRuntimeWorkScope(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
    )


class CatalogRecordViews:
    """:class:`RecordViewSource` over the catalog's gRPC API, cached by content digest.

    Args:
        channel: a channel to the catalog service.
        credentials: mints the catalog credential of a work scope
            (:class:`runtime_svc.catalog_client.ScopedCredentials`).
        timeout_s: deadline of one catalog call.
        max_cached: views (and binding → view digests) kept.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        credentials: Callable[[TrustedRuntimeWorkScope], str],
        *,
        timeout_s: float = _CATALOG_TIMEOUT_S,
        max_cached: int = _MAX_CACHED_VIEWS,
    ) -> None:
        self._stub = catalog_v1.CatalogServiceStub(channel)
        self._credentials = credentials
        self._timeout = timeout_s
        self._max = max_cached
        # Keys carry the full scope / org + installation, so no entry is ever served to
        # another tenant even if two tenants published byte-identical views.
        self._bindings: OrderedDict[TrustedRuntimeWorkScope, RuntimeWorkBindingRef] = OrderedDict()
        self._views: OrderedDict[
            tuple[str, str, str],
            tuple[
                RecordView,
                MetadataViewInput | None,
                frozenset[tuple[str, str]],
                frozenset[tuple[str, str]],
            ],
        ] = OrderedDict()

    @property
    def cached_views(self) -> int:
        """Number of views in the cache."""
        return len(self._views)

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._max:
            cache.popitem(last=False)

    async def view_for(self, scope: TrustedRuntimeWorkScope) -> RecordView:
        return (await self.bound_view_for(scope)).records

    async def bound_view_for(self, scope: TrustedRuntimeWorkScope) -> BoundRecordView:
        md = bearer_metadata(self._credentials(scope))
        binding = self._bindings.get(scope)
        if binding is None:
            try:
                resp = await self._stub.GetWorkBinding(
                    catalog_v1.GetWorkBindingRequest(scope=_scope_proto(scope)),
                    metadata=md,
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as exc:
                raise _catalog_failure(exc, "work binding") from exc
            # Keyed by the trusted scope's digest, as activation binds plans
            # (runtime_svc.catalog_client.GrpcCatalogClient.load_snapshot).
            binding = _binding_ref_from_proto(
                resp.work_binding.binding, scope.runtime_work_binding_digest
            )
            self._remember(self._bindings, scope, binding)
        digest = binding.metadata_view_digest
        key = (scope.org_id, scope.app_installation_id, digest)
        cached = self._views.get(key)
        if cached is not None:
            self._views.move_to_end(key)
            return BoundRecordView(
                cached[0], RequestBoundView(binding, cached[1]), cached[2], cached[3]
            )
        try:
            resp = await self._stub.GetMetadataView(
                catalog_v1.GetMetadataViewRequest(
                    org_id=scope.org_id,
                    app_installation_id=scope.app_installation_id,
                    runtime_metadata_view_digest=digest,
                ),
                metadata=md,
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise _catalog_failure(exc, "metadata view") from exc
        view = record_view_from_proto(resp.view)
        if view.digest != digest:
            raise FailedPreconditionError(
                "the catalog returned a metadata view under another digest",
                reason="metadata_view_digest_mismatch",
            )
        admission = _admission_view_from_proto(resp.view)
        after = _timing_pairs(resp.view, _AFTER_SAVE_TIMING)
        before = _timing_pairs(resp.view, _BEFORE_SAVE_TIMING)
        self._remember(self._views, key, (view, admission, after, before))
        return BoundRecordView(view, RequestBoundView(binding, admission), after, before)


# --- proto mapping -----------------------------------------------------------------------------


def _timestamp(value: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def record_proto(state: RecordState) -> Any:
    """``runtime_v1.Record`` of a stored record."""
    fields = Struct()
    fields.update(dict(state.fields))
    return runtime_v1.Record(
        org_id=state.org_id,
        object_api_name=state.object_name,
        record_id=state.record_id,
        version=state.version,
        fields=fields,
        parent_refs=[
            runtime_v1.ParentRef(
                relationship_name=r.relationship_name,
                parent_object_api_name=r.parent_object,
                parent_record_id=r.parent_record_id,
            )
            for r in state.parent_refs
        ],
        is_deleted=state.is_deleted,
        created_at=_timestamp(state.created_at),
        updated_at=_timestamp(state.updated_at),
    )


def _fields(request: Any) -> dict[str, Any]:
    if not request.HasField("fields"):
        return {}
    value: dict[str, Any] = json_format.MessageToDict(request.fields)
    return value


def _request_key(rpc: str, request: Any) -> RequestKey:
    """The dedupe key: the caller's complete trusted scope, the RPC and ``request_id``
    (required, at most 200 characters). The body is digested as the caller sent it (an
    empty ``record_id`` stays empty), so a retry of a create with a server-generated id
    matches its first attempt."""
    return RequestKey.of(DedupeScope.of_identity(current_identity()), rpc, request)


def _require(value: str, field_path: str) -> str:
    if not value:
        raise InvalidArgumentError(f"{field_path} is required", field_path=field_path)
    return value


@dataclass(frozen=True)
class _WriteContext:
    org: str
    scope: TrustedRuntimeWorkScope
    bound: BoundRecordView
    actor: Actor

    @property
    def view(self) -> RecordView:
        return self.bound.records


class RecordServicer(runtime_v1.RecordServiceServicer):
    """Create, update, soft-delete and read business records (issue 5, deliverable 1),
    starting the after-save Flow runs a write's request-bound view subscribes
    (deliverable 7).

    Args:
        engine: the record engine.
        views: the metadata-view source.
        db: the runtime database (after-save admission reads activations from it).
        runs: the one run-state store the servicer accepts after-save runs through.
        before_save: runs Embedded Before-Save Flows inside the record transaction.
    """

    def __init__(
        self,
        engine: RecordEngine,
        views: RecordViewSource,
        db: AsyncEngine,
        runs: FlowRunStateStore | None = None,
        before_save: BeforeSaveDispatcher | None = None,
    ) -> None:
        self._engine = engine
        self._views = views
        self._db = db
        self._runs = runs or FlowRunStateStore(db)
        self._before = before_save or BeforeSaveDispatcher()

    async def _context(self) -> _WriteContext:
        identity = current_identity()
        scope = identity.require_work_scope()
        bound = await self._views.bound_view_for(scope)
        return _WriteContext(identity.org_id, scope, bound, Actor("workload", identity.subject))

    def _before_save(
        self, ctx: _WriteContext, mutation: RecordMutation
    ) -> tuple[Transform | None, ActivationRead | None]:
        """The before-save hook of a write the view subscribes a before-save Flow to, and
        its activation read (made by the write's ledger lookup, one statement less)."""
        if not ctx.bound.subscribes_before_save(mutation.object_name, mutation.kind.value):
            return None, None
        dispatcher, request_view, view = self._before, ctx.bound.request, ctx.view
        activations = dispatcher.activation_read(ctx.org, request_view, mutation)

        async def transform(
            conn: AsyncConnection, m: RecordMutation, current: RecordState | None
        ) -> RecordMutation:
            return await dispatcher.transform_txn(
                conn, ctx.org, request_view, view, m, current, activations=activations
            )

        return transform, activations

    async def _write(
        self,
        rpc: str,
        request: Any,
        prepare: Callable[[RecordView], RecordMutation],
        respond: Callable[[MutationResult, list[str]], M],
        parse: Callable[[bytes], M],
    ) -> M:
        """One deduplicated record write: admit after-save plans, then — in one
        transaction — replay the original response of a retried request, or run the
        before-save Flows, mutate, accept the after-save runs and record the response.
        A fresh write answers with the response message its committed attempt encoded
        for the ledger; a replay parses the recorded bytes (``parse``)."""
        key = _request_key(rpc, request)
        # The ledger is read inside the record transaction (one transaction per write, the
        # before-save hot path); a retry's view comes from the cache.
        ctx = await self._context()
        mutation = prepare(ctx.view)
        event = mutation.kind.value
        run_ids: list[str] = []
        admit: Callable[[AsyncConnection, MutationResult], Awaitable[None]] | None = None
        if ctx.bound.subscribes_after_save(mutation.object_name, event):
            selection: TriggerSelection = await select_after_save_plans(
                self._db, ctx.scope, mutation.object_name, event, ctx.bound.request
            )
            if selection.plans:

                async def admit(conn: AsyncConnection, applied: MutationResult) -> None:
                    ids = await admit_after_save_runs_txn(
                        conn, self._runs, ctx.scope, selection, applied, event=event
                    )
                    # Replaced, not extended: a whole-transaction retry runs this again.
                    run_ids[:] = ids

        built: list[M] = []

        def encode(result: MutationResult) -> bytes:
            message = respond(result, list(run_ids))
            # Replaced, not appended: the committed attempt is the last to encode.
            built[:] = [message]
            data: bytes = message.SerializeToString(deterministic=True)
            return data

        transform, activations = self._before_save(ctx, mutation)
        try:
            done = await self._engine.mutate_once(
                ctx.org,
                ctx.view,
                mutation,
                actor=ctx.actor,
                key=key,
                encode=encode,
                on_applied=admit,
                transform=transform,
                also=activations,
            )
        except BeforeSaveFailedError as exc:
            # Rolled back: nothing was written. The evidence is the engine's audit row.
            await record_failure(self._db, exc.evidence, ctx.actor)
            raise
        if done.response is None:  # pragma: no cover - the encoder always answers
            raise FailedPreconditionError("the write produced no response", reason="internal")
        if done.replayed or not built:
            return parse(done.response)
        return built[0]

    async def CreateRecord(self, request: Any, context: Context) -> Any:
        """Validate against the scope's view and create the record at version 1."""

        def prepare(view: RecordView) -> RecordMutation:
            return prepare_create(
                view,
                request.object_api_name,
                request.record_id,
                _fields(request),
                [
                    ParentRef(p.relationship_name, p.parent_object_api_name, p.parent_record_id)
                    for p in request.parent_refs
                ],
            )

        def respond(result: MutationResult, run_ids: list[str]) -> Any:
            return runtime_v1.CreateRecordResponse(
                record=_record(result), triggered_flow_run_ids=run_ids
            )

        return await self._write(
            "CreateRecord", request, prepare, respond, runtime_v1.CreateRecordResponse.FromString
        )

    async def UpdateRecord(self, request: Any, context: Context) -> Any:
        """Compare-and-swap on ``expected_version``; a mismatch fails ``ABORTED``."""

        def prepare(view: RecordView) -> RecordMutation:
            return prepare_update(
                view,
                request.object_api_name,
                request.record_id,
                request.expected_version,
                _fields(request),
            )

        def respond(result: MutationResult, run_ids: list[str]) -> Any:
            return runtime_v1.UpdateRecordResponse(
                record=_record(result), triggered_flow_run_ids=run_ids
            )

        return await self._write(
            "UpdateRecord", request, prepare, respond, runtime_v1.UpdateRecordResponse.FromString
        )

    async def DeleteRecord(self, request: Any, context: Context) -> Any:
        """Soft delete with compare-and-swap; the response carries ``is_deleted`` true."""

        def prepare(view: RecordView) -> RecordMutation:
            return prepare_delete(
                view, request.object_api_name, request.record_id, request.expected_version
            )

        def respond(result: MutationResult, run_ids: list[str]) -> Any:
            return runtime_v1.DeleteRecordResponse(
                record=_record(result), triggered_flow_run_ids=run_ids
            )

        return await self._write(
            "DeleteRecord", request, prepare, respond, runtime_v1.DeleteRecordResponse.FromString
        )

    async def GetRecord(self, request: Any, context: Context) -> Any:
        """A live record of the caller's org; deleted or other-org records are NOT_FOUND."""
        org = current_identity().org_id
        state = await self._engine.get(
            org,
            _require(request.object_api_name, "object_api_name"),
            _require(request.record_id, "record_id"),
        )
        return runtime_v1.GetRecordResponse(record=record_proto(state))


def _record(result: MutationResult) -> Any:
    return record_proto(result.record)


async def build_record_service(
    cfg: ServiceConfig,
    engine: AsyncEngine,
    catalog: RecordViewSource | None = None,
    *,
    catalog_target: str | None = None,
    credentials: Callable[[TrustedRuntimeWorkScope], str] | None = None,
    changes: ChangeSink | None = None,
) -> ServiceRegistration:
    """The RecordService registration for ``runtime_svc.app.build_services``.

    Args:
        cfg: the runtime's configuration.
        engine: the runtime database.
        catalog: the metadata-view source (default: :class:`CatalogRecordViews` over a
            gRPC channel to the catalog service).
        catalog_target: ``host:port`` of the catalog (default: the catalog's configured
            listen address and port).
        credentials: mints the catalog credential of a work scope (default: signed with
            ``FLOW_AUTH_SIGNING_KEY``).
        changes: the record-change wake-signal producer (``None``: no signals).
    """
    if catalog is None:
        if credentials is None:
            credentials = ScopedCredentials.for_service(cfg)
        channel = catalog_channel(cfg, catalog_target)
        catalog = CatalogRecordViews(channel, credentials)
    return ServiceRegistration(
        SERVICE_NAME,
        runtime_v1.add_RecordServiceServicer_to_server,
        RecordServicer(RecordEngine(engine, changes=changes), catalog, engine),
    )
