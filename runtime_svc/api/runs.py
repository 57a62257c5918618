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
from runtime_svc.runs import PageTokenCodec, RunService
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.views import FixedViews, RecordViewSource
from services.auth import current_identity
from services.config import ServiceConfig
from services.errors import InvalidArgumentError
from services.grpc_server import ServiceRegistration
from services.proto import runtime_v1

__all__ = ["SERVICE_NAME", "FlowRunServicer", "build_run_service", "page_token_secret"]

SERVICE_NAME = "nexus.flow.runtime.v1.FlowRunService"

Context = Any  # grpc.aio.ServicerContext


def _require(request: Any, name: str) -> str:
    value: str = getattr(request, name)
    if not value:
        raise InvalidArgumentError(f"{name} is required", field_path=name)
    return value


class FlowRunServicer(runtime_v1.FlowRunServiceServicer):
    """Start, read, list, support-read, delete and cancel Flow runs (§10.1, §18, §19)."""

    def __init__(self, service: RunService) -> None:
        self._svc = service

    async def StartRun(self, request: Any, context: Context) -> Any:
        _require(request, "request_id")
        scope = current_identity().require_work_scope()
        outcome = await self._svc.start_run(
            scope,
            target_from_request(request),
            input_variables_from_request(request),
            idempotency_key=request.idempotency_key,
            wait_budget_s=wait_budget_seconds(request),
        )
        return runtime_v1.StartRunResponse(
            run=run_proto(outcome.view),
            completed=outcome.completed,
            existing_run=outcome.existing_run,
        )

    async def GetRun(self, request: Any, context: Context) -> Any:
        run_id = _require(request, "flow_run_id")
        view = await self._svc.get_run(current_identity().org_id, run_id)
        return runtime_v1.GetRunResponse(run=run_proto(view))

    async def GetRunSupport(self, request: Any, context: Context) -> Any:
        run_id = _require(request, "flow_run_id")
        support = await self._svc.support(current_identity().org_id, run_id)
        return runtime_v1.GetRunSupportResponse(support=support_proto(support))

    async def ListRuns(self, request: Any, context: Context) -> Any:
        runs, token = await self._svc.list_runs(
            current_identity().org_id,
            list_filters_from_request(request),
            request.page_size,
            request.page_token,
        )
        return runtime_v1.ListRunsResponse(runs=[run_proto(v) for v in runs], next_page_token=token)

    async def DeleteRun(self, request: Any, context: Context) -> Any:
        _require(request, "request_id")
        run_id = _require(request, "flow_run_id")
        view = await self._svc.delete_run(
            current_identity(), run_id, expected_state_version=request.expected_state_version
        )
        return runtime_v1.DeleteRunResponse(run=run_proto(view))

    async def CancelRun(self, request: Any, context: Context) -> Any:
        _require(request, "request_id")
        run_id = _require(request, "flow_run_id")
        view = await self._svc.cancel_run(
            current_identity(), run_id, expected_state_version=request.expected_state_version
        )
        return runtime_v1.CancelRunResponse(run=run_proto(view))


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
    """
    settings = WorkerSettings.from_env()
    store = store or FlowRunStateStore(engine, policy=settings.retry_policy())
    if views is None and synchronous_atomic:
        if settings.view_file:
            views = FixedViews.from_file(settings.view_file)
        else:
            views = CatalogRecordViews(catalog_channel(cfg), ScopedCredentials.from_config(cfg))
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
        atomic=AtomicRunner(engine, store, views, owner=owner) if views is not None else None,
        legacy=legacy,
    )
    return ServiceRegistration(
        SERVICE_NAME,
        runtime_v1.add_FlowRunServiceServicer_to_server,
        FlowRunServicer(service),
    )
