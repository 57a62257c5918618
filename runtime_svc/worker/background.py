"""Workers and sweeps as background tasks of the runtime process (STYLE 12 lifecycle).

``start_background(cfg, engine)`` starts ``FLOW_RUNTIME_WORKERS`` worker tasks (which
also execute the effect steps) and, when ``FLOW_RUNTIME_SWEEPS`` is true, the sweep tasks
(lease recovery and cancellation cleanup, the wait reconciler / expiry / repair sweeps
and the effect sweep — cancelled runs' handoff dispositions, terminal non-delivery
repair — every ``FLOW_RUNTIME_WAIT_SWEEP_MS``, and retention); ``await background.stop()``
asks them to finish their current step and waits (bounded) before cancelling. Idle loops
back off with bounded, jittered exponential delays and hold no connection while sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.kernel.store_retention import RetentionSweep
from runtime_svc.records import RecordView
from runtime_svc.worker.loop import Outcome, StepWorker, Sweeper
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.views import FixedViews, RecordViewSource
from services.auth import TrustedRuntimeWorkScope
from services.config import ServiceConfig
from services.db import db_now
from services.errors import FailedPreconditionError
from services.polling import Wakeup

if TYPE_CHECKING:
    from runtime_svc.waits.runtime import WaitRuntime

__all__ = ["Background", "IdleBackoff", "start_background"]

log = logging.getLogger(__name__)

_MIN_IDLE_S = 0.01
_STOP_GRACE_S = 10.0
#: Retention is a slow background duty: one bounded pass every five minutes.
_RETENTION_INTERVAL_S = 300.0


class IdleBackoff:
    """Bounded, jittered exponential idle delay: reset on work, doubled when idle."""

    def __init__(self, max_s: float, rng: random.Random | None = None) -> None:
        self._max = max(max_s, _MIN_IDLE_S)
        self._current = _MIN_IDLE_S
        self._rng = rng or random.Random()  # noqa: S311 - idle jitter, not security

    def reset(self) -> None:
        self._current = _MIN_IDLE_S

    def next_delay(self) -> float:
        """Full jitter in ``[current/2, current]``, then double (capped)."""
        delay = self._current * (0.5 + self._rng.random() / 2)
        self._current = min(self._max, self._current * 2)
        return delay


class _NoViews:
    async def view_for(self, scope: TrustedRuntimeWorkScope) -> RecordView:
        raise FailedPreconditionError(
            "no record view source configured for the worker", reason="metadata_view_missing"
        )


class Background:
    """The running worker and sweep tasks."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def spawn(
        self,
        name: str,
        body: Callable[[], Awaitable[bool]],
        idle_s: float,
        *,
        wake: Wakeup | None = None,
    ) -> None:
        """Run ``body`` (returns True when it did work) until :meth:`stop`; ``wake`` ends
        an idle wait at once (new work committed in this process)."""
        self._tasks.append(asyncio.create_task(self._loop(name, body, idle_s, wake), name=name))

    async def _loop(
        self,
        name: str,
        body: Callable[[], Awaitable[bool]],
        idle_s: float,
        wake: Wakeup | None = None,
    ) -> None:
        backoff = IdleBackoff(idle_s)
        while not self._stop.is_set():
            try:
                busy = await body()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: iteration failed; backing off", name)
                busy = False
            if busy:
                backoff.reset()
                continue
            if wake is not None:
                if await wake.wait(self._stop, backoff.next_delay()):
                    backoff.reset()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=backoff.next_delay())

    async def stop(self) -> None:
        """Stop after the current iteration (bounded grace, then cancel)."""
        self._stop.set()
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=_STOP_GRACE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()


async def start_background(
    cfg: ServiceConfig | None,
    engine: AsyncEngine,
    *,
    views: RecordViewSource | None = None,
    settings: WorkerSettings | None = None,
    waits: WaitRuntime | None = None,
    work_wake: Wakeup | None = None,
    outbox_wake: Wakeup | None = None,
) -> Background:
    """Start this process's workers and sweeps (see the module docstring).

    Args:
        cfg: the service configuration (unused until the flags move into it).
        engine: the runtime database.
        views: record views by work scope (the catalog-backed source in production);
            defaults to ``FLOW_RUNTIME_VIEW_FILE`` when set.
        settings: overrides :meth:`WorkerSettings.from_env`.
        waits: the process's wait components (default: built here); workers execute
            ``DependencyWait`` steps and signal record changes through them, and the
            wait sweeps (reconciler, expiry, repair, retention) run with the sweeps.
        work_wake: wakes the worker loops (a wait resolved in this process).
        outbox_wake: woken after an EffectSubmit committed (the outbox dispatcher's).
    """
    del cfg  # the FLOW_RUNTIME_* flags move into ServiceConfig later
    s = settings or WorkerSettings.from_env()
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
    bg = Background()
    host = f"{socket.gethostname()}:{os.getpid()}"
    for i in range(s.workers):
        worker = StepWorker(
            engine,
            store,
            source,
            owner=f"{host}/w{i}/{uuid.uuid4().hex[:8]}",
            batch_size=s.batch_size,
            waits=waits.steps,
            changes=waits.producer,
            effects=effects,
        )

        async def work(w: StepWorker = worker) -> bool:
            return any(o is not Outcome.NOT_ELIGIBLE for o in await w.run_once())

        bg.spawn(f"flow-worker-{i}", work, s.idle_ms / 1000, wake=work_wake)
    if s.sweeps:
        sweeper = Sweeper(engine, store)

        async def sweep() -> bool:
            await sweeper.sweep_once()
            return False  # sweeps always wait their interval

        bg.spawn("flow-sweeps", sweep, s.sweep_ms / 1000)
        effect_sweeper = EffectSweeper(engine, waits.matcher, batch=s.wait_batch)
        wait_sweeper = waits.sweeper(batch=s.wait_batch, expiry_guard=effect_sweeper.expiry_allowed)

        async def wait_sweep() -> bool:
            await wait_sweeper.sweep_once()
            return False  # jittered period (IdleBackoff), never a tight loop

        bg.spawn("flow-wait-sweeps", wait_sweep, s.wait_sweep_ms / 1000)

        async def effect_sweep() -> bool:
            # Cancelled runs' handoff dispositions and terminal non-delivery repair.
            await effect_sweeper.sweep_once()
            return False

        bg.spawn("flow-effect-sweeps", effect_sweep, s.wait_sweep_ms / 1000)
        retention = RetentionSweep(engine, retention=timedelta(days=s.retention_days))

        async def purge() -> bool:
            await retention.sweep_once()
            return False

        bg.spawn("flow-retention", purge, _RETENTION_INTERVAL_S)
    log.info("runtime background: %d worker(s), sweeps=%s", s.workers, s.sweeps)
    return bg
