"""Mirror a process's background health into its gRPC health service.

The gRPC health service (``services.grpc_server``) answers SERVING for ``""`` and every
served service from start until the drain. Some background duties can fail in a way the
server itself does not notice — a supervisor whose worker processes crash-loop
(``services.process_pool``) still answers RPCs but executes no step. A background object
that can tell implements :class:`HealthSource`; :func:`start_health_watch` polls it and
flips the health statuses to NOT_SERVING while it reports a reason (and back to SERVING
when it stops), logging each change once, so readiness/liveness probes and operators see
the problem. After the server's graceful shutdown began, the health servicer ignores
further changes (it stays NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol, runtime_checkable

from grpc_health.v1 import health_pb2

from services.grpc_server import RunningServer

__all__ = ["HEALTH_WATCH_S", "HealthSource", "HealthWatch", "start_health_watch"]

log = logging.getLogger(__name__)

#: How often the health source is asked (a probe's period is seconds; this is cheap).
HEALTH_WATCH_S = 1.0


@runtime_checkable
class HealthSource(Protocol):
    """Something whose failure makes the process unfit to serve."""

    def unhealthy(self) -> str | None:
        """Why the process is not doing its job now, or None when it is."""


class HealthWatch:
    """The polling task of :func:`start_health_watch`; :meth:`stop` is idempotent."""

    def __init__(self, running: RunningServer, source: HealthSource, interval_s: float) -> None:
        self._running, self._source, self._interval_s = running, source, interval_s
        self._reason: str | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def reason(self) -> str | None:
        """The reason reported at the last check (None: healthy)."""
        return self._reason

    async def check(self) -> None:
        """Ask the source once and update the health statuses when the answer changed."""
        reason = self._source.unhealthy()
        if reason == self._reason:
            return
        healthy = reason is None
        if healthy:
            log.info("healthy again (was: %s); health SERVING", self._reason)
        else:
            log.error("unhealthy: %s; health NOT_SERVING", reason)
        self._reason = reason
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self._running.service_names):
            await self._running.health.set(name, status)

    async def _loop(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # a failing check must not end the watch
                log.exception("health check of the background duties failed")
            await asyncio.sleep(self._interval_s)

    def start(self) -> HealthWatch:
        self._task = asyncio.create_task(self._loop(), name="health-watch")
        return self

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def start_health_watch(
    running: RunningServer, source: HealthSource, *, interval_s: float = HEALTH_WATCH_S
) -> HealthWatch:
    """Start polling ``source`` every ``interval_s`` and mirroring it into ``running``'s
    health service (see the module docstring)."""
    return HealthWatch(running, source, interval_s).start()
