"""``nexus.flow.runtime.v1.FlowRunService``: the gRPC face of :mod:`runtime_svc.runs`.

Servicer methods are thin (decode → service → encode). The org and work scope always come
from the verified credential (:func:`services.auth.current_identity`); the auth
interceptor has already rejected a body ``org_id``/``scope`` that disagrees with it, so a
body value is checked, never used. A run of another org answers ``NOT_FOUND`` exactly
like a missing one.

Wire it into the runtime process with :func:`build_run_service`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.records import CatalogRecordViews
from runtime_svc.api.runs_proto import (
    input_variables_from_request,
    list_filters_from_request,
    run_proto,
    support_proto,
    target_from_request,
    wait_budget_seconds,
)
from runtime_svc.atomic import AtomicRunner
from runtime_svc.catalog_client import ScopedCredentials, catalog_channel
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.legacy.service import LegacyInterviewService
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.records.engine import ChangeSink
from runtime_svc.runs import PageTokenCodec, RunService, RunView, StartOutcome
from runtime_svc.runs.operate import RunOperator
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.views import FixedViews, RecordViewSource
from services.auth import current_identity
from services.config import ServiceConfig
from services.errors import InvalidArgumentError
from services.grpc_server import ServiceRegistration
from services.paging import DEFAULT_CLIENT_MAX_BYTES, fit_page, response_budget
from services.proto import runtime_v1
from services.request_dedupe import DedupeScope, RequestKey

__all__ = ["SERVICE_NAME", "FlowRunServicer", "build_run_service", "page_token_secret"]

SERVICE_NAME = "nexus.flow.runtime.v1.FlowRunService"

Context = Any  # grpc.aio.ServicerContext


def _require(request: Any, name: str) -> str:
    value: str = getattr(request, name)
    if not value:
        raise InvalidArgumentError(f"{name} is required", field_path=name)
    return value


def _request_key(rpc: str, request: Any) -> RequestKey:
    """The dedupe key: the caller's complete trusted scope, the RPC and ``request_id``."""
    return RequestKey.of(DedupeScope.of_identity(current_identity()), rpc, request)


def _expected_version(request: Any) -> int | None:
    """The expected root version of a delete/cancel: the presence-aware
    ``expected_state_version_value`` (which can expect 0), else the legacy field (0 = no
    expectation)."""
    legacy = int(request.expected_state_version) or None
    if not request.HasField("expected_state_version_value"):
        return legacy
    value = int(request.expected_state_version_value.value)
    if legacy is not None and legacy != value:
        raise InvalidArgumentError(
            "expected_state_version and expected_state_version_value disagree",
            reason="inconsistent",
            field_path="expected_state_version_value",
        )
    return value


def _present_version(request: Any) -> int | None:
    """The presence-aware ``expected_state_version`` of an operator control (unset: no
    expectation; set, including to 0: compared in the store's compare-and-swap)."""
    if not request.HasField("expected_state_version"):
        return None
    return int(request.expected_state_version.value)


def _encode_view(cls: Any) -> Any:
    def encode(view: RunView) -> bytes:
        data: bytes = cls(run=run_proto(view)).SerializeToString(deterministic=True)
        return data

    return encode


class _StartResponses:
    """:class:`~runtime_svc.runs.service.StartResponder` over ``StartRunResponse``."""

    def encode(self, outcome: StartOutcome) -> bytes:
        return runtime_v1.StartRunResponse(
            run=run_proto(outcome.view),
            completed=outcome.completed,
            existing_run=outcome.existing_run,
        ).SerializeToString(deterministic=True)

    def accepted(self, response: bytes) -> tuple[str, bool]:
        msg = runtime_v1.StartRunResponse.FromString(response)
        return msg.run.flow_run_id, msg.existing_run


class FlowRunServicer(runtime_v1.FlowRunServiceServicer):
    """Start, read, list, support-read, delete and cancel Flow runs (§10.1, §18, §19),
    and the operator controls pause, resume, quarantine retry and restart from a
    checkpoint (issue 14 item 5).

    Mutating RPCs are deduplicated on ``request_id`` (``services.request_dedupe``): a
    retry gets the original response bytes, a reuse with another body is refused.
    """

    def __init__(
        self, service: RunService, *, max_response_bytes: int = DEFAULT_CLIENT_MAX_BYTES
    ) -> None:
        self._svc = service
        self._ops = RunOperator(service)
        self._max_response = max_response_bytes

    async def StartRun(self, request: Any, context: Context) -> Any:
        key = _request_key("StartRun", request)
        scope = current_identity().require_work_scope()
        data = await self._svc.start_run_once(
            scope,
            key,
            _StartResponses(),
            target_from_request(request),
            input_variables_from_request(request),
            idempotency_key=request.idempotency_key,
            wait_budget_s=wait_budget_seconds(request),
        )
        return runtime_v1.StartRunResponse.FromString(data)

    async def GetRun(self, request: Any, context: Context) -> Any:
        run_id = _require(request, "flow_run_id")
        view = await self._svc.get_run(current_identity().org_id, run_id)
        return runtime_v1.GetRunResponse(run=run_proto(view))

    async def GetRunSupport(self, request: Any, context: Context) -> Any:
        run_id = _require(request, "flow_run_id")
        support = await self._svc.support(current_identity().org_id, run_id)
        return runtime_v1.GetRunSupportResponse(support=support_proto(support))

    async def ListRuns(self, request: Any, context: Context) -> Any:
        org, filters = current_identity().org_id, list_filters_from_request(request)

        async def fetch(size: int) -> Any:
            runs, token = await self._svc.list_runs(org, filters, size, request.page_token)
            return runtime_v1.ListRunsResponse(
                runs=[run_proto(v) for v in runs], next_page_token=token
            )

        # Paged by bytes as well as by count (services.paging); the read stays the runs'.
        return await fit_page(
            fetch,
            lambda r: r.runs,
            page_size=request.page_size,
            budget=self._max_response,
            what="flow run",
        )

    async def DeleteRun(self, request: Any, context: Context) -> Any:
        key = _request_key("DeleteRun", request)
        run_id = _require(request, "flow_run_id")
        data = await self._svc.delete_run_once(
            current_identity(),
            run_id,
            key,
            _encode_view(runtime_v1.DeleteRunResponse),
            expected_state_version=_expected_version(request),
        )
        return runtime_v1.DeleteRunResponse.FromString(data)

    async def CancelRun(self, request: Any, context: Context) -> Any:
        key = _request_key("CancelRun", request)
        run_id = _require(request, "flow_run_id")
        data = await self._svc.cancel_run_once(
            current_identity(),
            run_id,
            key,
            _encode_view(runtime_v1.CancelRunResponse),
            expected_state_version=_expected_version(request),
        )
        return runtime_v1.CancelRunResponse.FromString(data)

    # --- operator controls (runtime_svc.runs.operate) ---------------------------------

    async def PauseRun(self, request: Any, context: Context) -> Any:
        key = _request_key("PauseRun", request)
        data = await self._ops.pause_run_once(
            current_identity(),
            _require(request, "flow_run_id"),
            key,
            _encode_view(runtime_v1.PauseRunResponse),
            expected_state_version=_present_version(request),
            reason=request.reason,
        )
        return runtime_v1.PauseRunResponse.FromString(data)

    async def ResumeRun(self, request: Any, context: Context) -> Any:
        key = _request_key("ResumeRun", request)
        data = await self._ops.resume_run_once(
            current_identity(),
            _require(request, "flow_run_id"),
            key,
            _encode_view(runtime_v1.ResumeRunResponse),
            expected_state_version=_present_version(request),
            reason=request.reason,
        )
        return runtime_v1.ResumeRunResponse.FromString(data)

    async def RetryQuarantinedRun(self, request: Any, context: Context) -> Any:
        key = _request_key("RetryQuarantinedRun", request)
        data = await self._ops.retry_quarantined_run_once(
            current_identity(),
            _require(request, "flow_run_id"),
            request.reason,
            key,
            _encode_view(runtime_v1.RetryQuarantinedRunResponse),
            expected_state_version=_present_version(request),
        )
        return runtime_v1.RetryQuarantinedRunResponse.FromString(data)

    async def RestartFromCheckpoint(self, request: Any, context: Context) -> Any:
        key = _request_key("RestartFromCheckpoint", request)
        data = await self._ops.restart_from_checkpoint_once(
            current_identity(),
            _require(request, "flow_run_id"),
            request.checkpoint_id,
            request.reason,
            key,
            _encode_view(runtime_v1.RestartFromCheckpointResponse),
            expected_state_version=_present_version(request),
        )
        return runtime_v1.RestartFromCheckpointResponse.FromString(data)


def page_token_secret(cfg: ServiceConfig) -> bytes:
    """The ``ListRuns`` token key. Until ``ServiceConfig`` carries a dedicated secret,
    it is derived from the runtime's signing-key file (shared by replicas of one
    deployment); without one, tokens are still digest-bound to org and filters."""
    try:
        material = cfg.auth_signing_key.read_bytes()
    except OSError:
        material = b""
    return hashlib.sha256(b"list-runs-page-token\x00" + material).digest()


async def build_run_service(
    cfg: ServiceConfig,
    engine: AsyncEngine,
    *,
    store: FlowRunStateStore | None = None,
    max_wait_s: float = 30.0,
    views: RecordViewSource | None = None,
    synchronous_atomic: bool = True,
    changes: ChangeSink | None = None,
) -> ServiceRegistration:
    """The FlowRunService registration for ``runtime_svc.app.build_services``.

    Args:
        cfg: the runtime's configuration.
        engine: the runtime database.
        store: the run state store the workers use (default: a new one on ``engine``
            with the workers' retry policy).
        max_wait_s: the API budget ``StartRun.wait_budget`` is clamped to (§18.3).
        views: record views for synchronous Bounded Atomic runs (default: the
            ``FLOW_RUNTIME_VIEW_FILE`` view when set, else the catalog's views).
        synchronous_atomic: execute Bounded Atomic runs inside ``StartRun`` (§18.3);
            ``False`` leaves them to the workers (tests of the accept path only).
        changes: the record-change wake-signal producer of Bounded Atomic writes.
    """
    settings = WorkerSettings.from_config(cfg)
    store = store or FlowRunStateStore(engine, policy=settings.retry_policy())
    if views is None and synchronous_atomic:
        if settings.view_file:
            views = FixedViews.from_file(settings.view_file)
        else:
            views = CatalogRecordViews(catalog_channel(cfg), ScopedCredentials.for_service(cfg))
    owner = f"{socket.gethostname()}:{os.getpid()}/atomic/{uuid.uuid4().hex[:8]}"
    # §20: new runs whose cohort selects the legacy owner run on the element walker
    # (record writes validated by the same views; none configured -> they fail closed).
    legacy = LegacyInterviewService(
        engine,
        LegacyInterviewStore(engine, lease=timedelta(milliseconds=settings.lease_ms)),
        views,
        owner=f"{socket.gethostname()}:{os.getpid()}/legacy-start/{uuid.uuid4().hex[:8]}",
    )
    service = RunService(
        engine,
        store,
        PageTokenCodec(page_token_secret(cfg)),
        max_wait_s=max_wait_s,
        atomic=(
            AtomicRunner(engine, store, views, owner=owner, changes=changes)
            if views is not None
            else None
        ),
        legacy=legacy,
    )
    return ServiceRegistration(
        SERVICE_NAME,
        runtime_v1.add_FlowRunServiceServicer_to_server,
        FlowRunServicer(service, max_response_bytes=response_budget(cfg)),
    )
