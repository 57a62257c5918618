"""Servicer and background wiring of the runtime service.

:class:`RuntimeApp` builds the process's servicers and its background loops; the two
share one :class:`~runtime_svc.waits.WaitRuntime` (the record producer's memo, the
matcher and the signal service), so a wait committed by a local worker is seen at once by
local record writes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.definitions import build_definition_service
from runtime_svc.api.records import CatalogRecordViews, build_record_service
from runtime_svc.api.runs import build_run_service
from runtime_svc.api.signals import wake_signal_registration
from runtime_svc.catalog_client import GrpcCatalogClient, ScopedCredentials, catalog_channel
from runtime_svc.effects.finalizer import FlowEffectFinalizer
from runtime_svc.migration.process import start_bridge_duties
from runtime_svc.observability import RuntimeStateSource
from runtime_svc.outbox import RuntimeOutbox, start_runtime_outbox
from runtime_svc.processes import start_worker_processes
from runtime_svc.waits.resolution import ResolvedRun
from runtime_svc.waits.runtime import WaitRuntime
from runtime_svc.worker.background import start_background
from runtime_svc.worker.binary import BinaryCheck
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.views import FixedViews, RecordViewSource
from services.auth import load_signing_key
from services.background import Wakeup
from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration
from services.metrics import metrics
from services.metrics_state import StateSource
from services.process_pool import ProcessPool
from services.service_main import Background
from services.supervisor_link import encode_message

__all__ = ["RESOLVED_RUN", "SERVICE_NAMES", "RuntimeApp"]

log = logging.getLogger(__name__)

#: The supervisor → worker-process message naming a run a resolution made runnable.
RESOLVED_RUN = "resolved_run"

SERVICE_NAMES = (
    "nexus.flow.runtime.v1.FlowDefinitionService",
    "nexus.flow.runtime.v1.FlowRunService",
    "nexus.flow.runtime.v1.RecordService",
    "nexus.flow.runtime.v1.WakeSignalService",
)


class RuntimeApp:
    """The runtime process: ``build_services`` then ``start_background`` (the
    ``run_service`` factories), sharing this process's wait components."""

    def __init__(self) -> None:
        self._waits: WaitRuntime | None = None
        #: Wakes the workers: a wait resolved in this process (e.g. an effect receipt).
        self.work_wake = Wakeup()
        #: Wakes the outbox dispatcher: an EffectSubmit committed in this process.
        self.outbox_wake = Wakeup()
        #: The supervised worker processes (``FLOW_RUNTIME_WORKER_PROCESSES``), once
        #: started: a run made runnable here is relayed to one of them.
        self._pool: ProcessPool | None = None

    def _resolved(self, hint: object) -> None:
        """A wait resolved in this process made a run runnable: wake this process's
        workers and, when the steps execute in worker processes, relay the hint to one
        of them over its stdin (``services.supervisor_link``) so an idle worker process
        claims the run at once instead of at its next poll."""
        self.work_wake.notify(hint)
        if self._pool is not None and isinstance(hint, ResolvedRun):
            sent = self._pool.send(
                encode_message(
                    {"kind": RESOLVED_RUN, "org_id": hint.org_id, "flow_run_id": hint.flow_run_id}
                )
            )
            metrics().process_hint("sent" if sent else "dropped")

    def waits(self, cfg: ServiceConfig, engine: AsyncEngine) -> WaitRuntime:
        """This process's wait components (built on first use)."""
        if self._waits is None:
            settings = WorkerSettings.from_config(cfg)
            self._waits = WaitRuntime.build(
                engine, signal_kinds=settings.signal_kinds, on_resolved=self._resolved
            )
        return self._waits

    async def build_services(
        self, cfg: ServiceConfig, engine: AsyncEngine
    ) -> Sequence[ServiceRegistration]:
        """The runtime RPCs. The record service, the synchronous Bounded Atomic executor
        and the signal service's binding check share one catalog view source (one
        channel, one cache of immutable views).

        Raises:
            ConfigError: in production, the runtime's service key (``FLOW_AUTH_SERVICE_KEY``)
                cannot be read.
        """
        if cfg.is_production:
            # Production keys are provisioned, never generated: a runtime that cannot sign
            # its calls to the catalog must not start (development keys appear on first start).
            load_signing_key(cfg.auth_service_key)
        settings = WorkerSettings.from_config(cfg)
        views = CatalogRecordViews(catalog_channel(cfg), ScopedCredentials.for_service(cfg))
        run_views = None if settings.view_file else views
        bindings: RecordViewSource = (
            FixedViews.from_file(settings.view_file) if settings.view_file else views
        )
        waits = self.waits(cfg, engine)
        return [
            await build_definition_service(cfg, engine, producers=waits.registry),
            await build_run_service(cfg, engine, views=run_views, changes=waits.producer),
            await build_record_service(cfg, engine, views, changes=waits.producer),
            wake_signal_registration(waits.signals, bindings),
        ]

    def state_sources(self, cfg: ServiceConfig) -> Sequence[StateSource]:
        """The runtime's authoritative-state gauges (runs, lanes, waits, divergence, dual
        ownership; the Runtime outbox's are added by ``run_service``)."""
        t = cfg.telemetry
        return [RuntimeStateSource(count_cap=t.count_cap, window=t.probe_window)]

    async def start_background(self, cfg: ServiceConfig, engine: AsyncEngine) -> Background:
        """The workers and sweeps (``FLOW_RUNTIME_WORKERS``/``FLOW_RUNTIME_SWEEPS``), the
        bridge duties (§20.3: writer registration, heartbeat, legacy scheduler) and the
        canonical-outbox dispatcher (``FLOW_OUTBOX_DISPATCHERS``).

        Mutation steps validate against the metadata view of the run's work scope, read
        from the catalog (``FLOW_CATALOG_TARGET``) exactly as the record service reads
        it, and each plan is verified with the catalog before its first claim (§8.4);
        only a test/dev ``FLOW_RUNTIME_VIEW_FILE`` replaces both.

        With ``FLOW_RUNTIME_WORKER_PROCESSES`` > 0 the step workers run in that many
        supervised child processes instead of here (``runtime_svc.processes``); this
        process keeps the once-per-deployment duties.
        """
        settings = WorkerSettings.from_config(cfg)
        if cfg.runtime_worker_processes > 0:
            settings = dataclasses.replace(settings, workers=0)
        waits = self.waits(cfg, engine)
        views = None
        binary_check = None
        if not settings.view_file:
            channel = catalog_channel(cfg)
            credentials = ScopedCredentials.for_service(cfg)
            views = CatalogRecordViews(channel, credentials)
            # §8.4: before the first claim of a plan, verify with the catalog that this
            # binary executes exactly the sealed entries the plan pins.
            binary_check = BinaryCheck(GrpcCatalogClient(channel, credentials))
        workers = await start_background(
            cfg,
            engine,
            views=views,
            settings=settings,
            waits=waits,
            binary_check=binary_check,
            work_wake=self.work_wake,
            outbox_wake=self.outbox_wake,
        )
        # §20.3: register in the writer fleet (a binary the control record has left behind
        # refuses to start here, before serving), heartbeat, the legacy scheduler.
        legacy_views: RecordViewSource | None = views
        if legacy_views is None and settings.view_file:
            legacy_views = FixedViews.from_file(settings.view_file)
        try:
            bridged = await start_bridge_duties(
                engine,
                workers,
                views=legacy_views,
                legacy_scheduler=settings.legacy_scheduler,
                lease_ms=settings.lease_ms,
                idle_s=settings.idle_ms / 1000,
            )
        except BaseException:
            await workers.stop()
            raise
        # §15.4: a Rejected or AcceptanceUnknown handoff converges the Flow root-first
        # and only then becomes terminal, in the finalizer's one transaction.
        finalizer = FlowEffectFinalizer(engine, waits.matcher)
        outbox = await start_runtime_outbox(cfg, engine, finalizer=finalizer, wake=self.outbox_wake)
        try:
            pool = await start_worker_processes(cfg, os.environ)
        except BaseException:
            await _RuntimeBackground(bridged, outbox, None, self.work_wake).stop()
            raise
        self._pool = pool
        return _RuntimeBackground(bridged, outbox, pool, self.work_wake)


class _RuntimeBackground:
    """Workers/sweeps with the bridge duties, the canonical-outbox dispatcher and the
    supervised worker processes, stopped together (the processes first: they drain in
    parallel, each on its own). In a worker process it receives the supervisor's
    relayed hints (:meth:`on_supervisor_message`)."""

    def __init__(
        self,
        workers: Background,
        outbox: RuntimeOutbox | None,
        pool: ProcessPool | None,
        work_wake: Wakeup,
    ) -> None:
        self._workers, self._outbox, self._pool = workers, outbox, pool
        self._work_wake = work_wake

    def on_supervisor_message(self, message: Mapping[str, Any]) -> None:
        """A run the supervisor made runnable (``RuntimeApp._resolved``): wake this
        process's workers with it as their hint (the claim re-validates it; anything
        else is ignored)."""
        org, run = message.get("org_id"), message.get("flow_run_id")
        if message.get("kind") == RESOLVED_RUN and isinstance(org, str) and isinstance(run, str):
            log.debug("supervisor relayed a runnable run %s", run)
            metrics().process_hint("received")
            self._work_wake.notify(ResolvedRun(org, run))

    def unhealthy(self) -> str | None:
        """Crash-looping worker processes make the supervisor NOT_SERVING
        (``services.health_watch``): the pod no longer executes steps."""
        return self._pool.unhealthy() if self._pool is not None else None

    async def stop(self) -> None:
        if self._pool is not None:
            await self._pool.stop()
        if self._outbox is not None:
            await self._outbox.stop()
        await self._workers.stop()
