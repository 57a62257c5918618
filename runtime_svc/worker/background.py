"""Workers and sweeps as background loops of the runtime process, on the one lifecycle of
:mod:`services.background` (STYLE 12).

``start_background(cfg, engine)`` starts ``FLOW_RUNTIME_WORKERS`` worker loops (which
also execute the effect steps) and, when ``FLOW_RUNTIME_SWEEPS`` is true, the
recovery/cancellation sweep, the wait sweeps (wake reconciler, expiry and repair, every
``FLOW_RUNTIME_WAIT_SWEEP_MS``), the effect sweep (cancelled runs' handoff dispositions,
terminal non-delivery repair), the run-retention sweep and the request-dedupe retention
sweep (``runtime_requests``), all in one :class:`~services.background.LoopGroup`;
``await background.stop()`` asks them to finish their current iteration and waits
(bounded) before cancelling. Idle loops back off with bounded, jittered exponential
delays and hold no connection while sleeping; a :class:`~services.background.Wakeup`
(a wait resolved in this process) ends a worker's idle wait at once. Other loops
(reconcilers, dispatchers) join the same group with ``add``/``spawn``.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.controller import for_process
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.kernel.store_retention import RetentionSweep
from runtime_svc.records import RecordView
from runtime_svc.schema import runtime_requests
from runtime_svc.worker.binary import BinaryCheck
from runtime_svc.worker.loop import Outcome, StepWorker, Sweeper
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.views import FixedViews, RecordViewSource
from services.auth import TrustedRuntimeWorkScope
from services.background import HINTED_IDLE_FLOOR, IdleBackoff, LoopGroup, Wakeup
from services.config import ServiceConfig
from services.db import db_now
from services.errors import FailedPreconditionError
from services.request_dedupe import RequestLedger
from services.request_retention import RequestRetention

if TYPE_CHECKING:
    from runtime_svc.waits.runtime import WaitRuntime

__all__ = ["Background", "IdleBackoff", "start_background"]

log = logging.getLogger(__name__)

#: Retention is a slow background duty: one bounded pass every five minutes.
_RETENTION_INTERVAL_S = 300.0

#: The runtime process's loop group (kept under its historical name).
Background = LoopGroup


class _NoViews:
    async def view_for(self, scope: TrustedRuntimeWorkScope) -> RecordView:
        raise FailedPreconditionError(
            "no record view source configured for the worker", reason="metadata_view_missing"
        )


async def _run_resolved(worker: StepWorker, hints: list[object]) -> bool:
    """Claim the steps of runs a resolution in this process just made runnable (the
    wakeup's hints, ``runtime_svc.waits.resolution.ResolvedRun``) without the org and
    queue discovery reads — and, when the hint carries the resolution's candidate,
    without the candidate read; the claim re-validates each under its fence (a stale
    hint claims nothing: polling finds the step)."""
    from runtime_svc.waits.resolution import ResolvedRun

    did = False
    for hint in hints:
        if isinstance(hint, ResolvedRun):
            # The resolution's own candidate (the versions it committed) spares the read;
            # a hint without one (fault path, expiry) reads the run's current step.
            candidate = hint.candidate
            if candidate is None or candidate.org_id != hint.org_id:
                candidate = await worker.store.candidate_for_run(hint.org_id, hint.flow_run_id)
            if candidate is not None:
                outcomes = await worker.process_found(hint.org_id, candidate)
                did = did or any(o is not Outcome.NOT_ELIGIBLE for o in outcomes)
    return did


async def start_background(
    cfg: ServiceConfig | None,
    engine: AsyncEngine,
    *,
    views: RecordViewSource | None = None,
    settings: WorkerSettings | None = None,
    binary_check: BinaryCheck | None = None,
    waits: WaitRuntime | None = None,
    work_wake: Wakeup | None = None,
    outbox_wake: Wakeup | None = None,
) -> LoopGroup:
    """Start this process's workers and sweeps (see the module docstring).

    Args:
        cfg: the service configuration (the ``FLOW_RUNTIME_*`` settings come from it).
        engine: the runtime database.
        views: record views by work scope (the catalog-backed source in production);
            defaults to ``FLOW_RUNTIME_VIEW_FILE`` when set.
        settings: overrides the settings ``cfg`` selects (tests).
        binary_check: verifies each plan with the catalog before the workers' first
            claim of it (§8.4); ``runtime_svc.app`` passes the catalog-backed one.
        waits: the process's wait components (default: built here); workers execute
            ``DependencyWait`` steps and signal record changes through them, and the
            wait sweeps (reconciler, expiry, repair, retention) run with the sweeps.
        work_wake: wakes the worker loops (a wait resolved in this process).
        outbox_wake: woken after an EffectSubmit committed (the outbox dispatcher's).
    """
    if settings is not None:
        s = settings
    elif cfg is not None:
        s = WorkerSettings.from_config(cfg)
    else:
        s = WorkerSettings()
    source: RecordViewSource
    if views is not None:
        source = views
    elif s.view_file:
        source = FixedViews.from_file(s.view_file)
    else:
        source = _NoViews()
    store = FlowRunStateStore(engine, policy=s.retry_policy())
    if waits is None:
        from runtime_svc.waits.runtime import WaitRuntime  # the waits import the executor

        waits = WaitRuntime.build(engine, signal_kinds=s.signal_kinds)
    # The effects package imports the executor too (through the waits).
    from runtime_svc.effects.steps import EffectSteps
    from runtime_svc.effects.sweep import EffectSweeper

    effects = EffectSteps(
        engine,
        waits.steps,
        db_now,
        on_submitted=None if outbox_wake is None else outbox_wake.notify,
    )
    from runtime_svc.identity.reauth import Reauthorizer  # imports the executor too

    # One directory cache per process: every worker reauthorizes through it (§17.2).
    identity = Reauthorizer(engine, cache_ttl_s=s.reauth_cache_ms / 1000)
    group = LoopGroup()
    host = f"{socket.gethostname()}:{os.getpid()}"
    # §16: one admission controller for every worker of this process (its budget is the
    # process's connection pool); each worker asks it before it claims.
    admission = for_process(engine, workers=s.workers, quantum=s.batch_size)
    for i in range(s.workers):
        worker = StepWorker(
            engine,
            store,
            source,
            owner=f"{host}/w{i}/{uuid.uuid4().hex[:8]}",
            batch_size=s.batch_size,
            org_batch=s.org_batch,
            binary_check=binary_check,
            waits=waits.steps,
            changes=waits.producer,
            effects=effects,
            identity=identity,
            admission=admission,
        )

        async def work(w: StepWorker = worker) -> bool:
            # Runs a resolution in this process just made runnable first (claimed from
            # the hint). They were named, so no immediate re-poll follows them: the
            # backoff from its floor finds other work, and a new hint ends that wait.
            if work_wake is not None and await _run_resolved(w, work_wake.take_hints()):
                return False
            return any(o is not Outcome.NOT_ELIGIBLE for o in await w.run_once())

        group.spawn(
            f"flow-worker-{i}",
            work,
            s.idle_ms / 1000,
            wake=work_wake,
            min_idle_s=s.idle_ms / 1000 / HINTED_IDLE_FLOOR if work_wake is not None else 0.0,
        )
    if s.sweeps:
        sweeper = Sweeper(engine, store, org_batch=s.org_batch)

        async def sweep() -> bool:
            await sweeper.sweep_once()
            return False  # sweeps always wait their interval

        group.spawn("flow-sweeps", sweep, s.sweep_ms / 1000, interval=True)
        effect_sweeper = EffectSweeper(engine, waits.matcher, batch=s.wait_batch)
        wait_sweeper = waits.sweeper(
            batch=s.wait_batch,
            org_batch=s.org_batch,
            expiry_guard=effect_sweeper.expiry_allowed,
        )

        async def wait_sweep() -> bool:
            await wait_sweeper.sweep_once()
            return False  # jittered period (IdleBackoff), never a tight loop

        group.spawn("flow-wait-sweeps", wait_sweep, s.wait_sweep_ms / 1000, interval=True)

        async def effect_sweep() -> bool:
            # Cancelled runs' handoff dispositions and terminal non-delivery repair.
            await effect_sweeper.sweep_once()
            return False

        group.spawn("flow-effect-sweeps", effect_sweep, s.wait_sweep_ms / 1000, interval=True)
        group.add(
            RetentionSweep(
                engine,
                retention=timedelta(days=s.retention_days),
                interval_s=_RETENTION_INTERVAL_S,
                org_batch=s.org_batch,
            )
        )
        group.add(
            RequestRetention(
                engine,
                RequestLedger(runtime_requests),
                retention=timedelta(hours=s.request_retention_hours),
                interval_s=_RETENTION_INTERVAL_S,
                org_batch=s.org_batch,
            )
        )
    group.start()
    log.info("runtime background: %d worker(s), sweeps=%s", s.workers, s.sweeps)
    return group
