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

With workers (and ``FLOW_RUNTIME_PRECLAIM_WAKE``, default on), the process's wait
resolutions pre-claim the resumed step for these workers (:class:`LocalWakeSeats`,
``docs/adr/0007-pre-claimed-wake.md``): a worker executes the handed-over Running step
before it looks at hints or polls.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.controller import AdmissionController, for_process
from runtime_svc.admission.events import Ticket
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.kernel.store_reads import Candidate
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
    from runtime_svc.waits.preclaim import PreClaimedWake
    from runtime_svc.waits.runtime import WaitRuntime

__all__ = ["Background", "IdleBackoff", "LocalWakeSeats", "start_background"]

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


class LocalWakeSeats:
    """This process's step workers as takers of pre-claimed wakes (the waits'
    ``WakeSeats``, ``docs/adr/0007-pre-claimed-wake.md``).

    A reservation is granted, in memory, when the group is not stopping, a worker serves
    the step's lane, fewer handed-over steps wait (reserved or delivered, not yet taken)
    than there are workers (room), a worker has the run's plan cached and this binary's
    verdict on it is clear (§8.4), and admission (when configured) admits it now
    (:meth:`AdmissionController.admit_now` — the ticket then covers the step until its
    chain ends). A delivered step is taken by the next worker loop that runs
    (:meth:`take`; the delivery wakes one). A step never taken (the process stops or
    dies first) stays Running under a lease nobody renews: lease expiry recovers it.

    Args:
        workers: the process's step workers.
        admission: their shared admission controller (``None``: none, as in tests).
        wake: wakes the worker loops.
        stopping: whether the worker loops are stopping (no reservation then).
        owner: the lease owner pre-claims are written for (any of the workers may run
            the step: the fence, not the name, is what every later write compares).
    """

    def __init__(
        self,
        workers: Sequence[StepWorker],
        *,
        admission: AdmissionController | None = None,
        wake: Wakeup | None = None,
        stopping: Callable[[], bool] = lambda: False,
        owner: str | None = None,
    ) -> None:
        self._workers = workers  # the caller's list (the process adds its workers later)
        self.admission = admission
        self._wake = wake
        self._stopping = stopping
        host = f"{socket.gethostname()}:{os.getpid()}"
        self.owner = owner or f"{host}/wake/{uuid.uuid4().hex[:8]}"
        self._reserved = 0
        self._delivered: deque[tuple[PreClaimedWake, Ticket | None]] = deque()

    def outstanding(self) -> int:
        """Handed-over steps no worker has taken yet (reserved or delivered)."""
        return self._reserved + len(self._delivered)

    def reserve(self, org_id: str, candidate: Candidate) -> _Seat | None:
        """See the class docstring; ``None`` leaves the wake to today's path."""
        if self._stopping() or self.outstanding() >= len(self._workers):
            return None
        serving = [w for w in self._workers if w.serves(candidate.queue_class)]
        plan = next((p for w in serving if (p := w.preclaim_plan(org_id, candidate.plan_id))), None)
        if plan is None:
            return None
        ticket = None
        if self.admission is not None:
            ticket = self.admission.admit_now(org_id, candidate, plan)
            if ticket is None:
                return None
        self._reserved += 1
        return _Seat(self, ticket)

    def take(self) -> tuple[PreClaimedWake, Ticket | None] | None:
        """The oldest delivered step, for the calling worker to execute."""
        return self._delivered.popleft() if self._delivered else None

    def _settle(self, seat: _Seat, wake: PreClaimedWake | None) -> None:
        self._reserved -= 1
        if wake is not None:
            self._delivered.append((wake, seat.ticket))
            if self._wake is not None:
                self._wake.notify()
        elif seat.ticket is not None and self.admission is not None:
            self.admission.release(seat.ticket, "not_eligible")


@dataclass
class _Seat:
    """One reservation of :class:`LocalWakeSeats` (settled once)."""

    seats: LocalWakeSeats
    ticket: Ticket | None
    settled: bool = False

    @property
    def lease_owner(self) -> str:
        return self.seats.owner

    def deliver(self, wake: PreClaimedWake) -> None:
        if not self.settled:
            self.settled = True
            self.seats._settle(self, wake)

    def cancel(self) -> None:
        if not self.settled:
            self.settled = True
            self.seats._settle(self, None)


async def run_preclaimed(worker: StepWorker, seats: LocalWakeSeats) -> bool:
    """Execute the pre-claimed wakes delivered to this process (one at a time, until
    none is left); whether there was one."""
    did = False
    while (item := seats.take()) is not None:
        wake, ticket = item
        await worker.process_preclaimed(wake, admission=seats.admission, ticket=ticket)
        did = True
    return did


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
    workers: list[StepWorker] = []
    seats = None
    if s.workers > 0 and s.preclaim_wake:
        seats = LocalWakeSeats(
            workers, admission=admission, wake=work_wake, stopping=lambda: group.stopping
        )
        from runtime_svc.waits.preclaim import PreClaimer

        waits.matcher.preclaim = PreClaimer(store, seats)
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
        workers.append(worker)

        async def work(w: StepWorker = worker) -> bool:
            # Runs the steps resolutions of this process pre-claimed for its workers
            # (already Running: ADR 0007), then the runs a resolution just made runnable
            # (claimed from the hint). They were named, so no immediate re-poll follows
            # them: the backoff from its floor finds other work, and a new hint or
            # delivery ends that wait.
            did = seats is not None and await run_preclaimed(w, seats)
            if work_wake is not None and await _run_resolved(w, work_wake.take_hints()):
                did = True
            if did:
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
