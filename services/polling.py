"""One lifecycle for this process's polling background loops (STYLE 12).

``BackgroundLoops([LoopTask(...), ...])`` runs each task's body repeatedly until
:meth:`~BackgroundLoops.shutdown`: a body returns True when it did work (it runs again at
once) and False when idle (bounded, jittered exponential idle backoff up to ``idle_s``,
holding no connection while it sleeps); an ``interval`` task always waits ``idle_s``. A
body that raises is logged and backed off — one poisoned iteration never stops the
process — while a crash of the loop machinery itself ends :meth:`run` (children awaited
with ``FIRST_EXCEPTION``). ``shutdown()`` is idempotent and lets the current iterations
finish within a bounded grace before cancelling them.

A loop may also be *woken*: give its :class:`LoopTask` a :class:`Wakeup` and call
``wakeup.notify()`` where new work for it commits in this process (an outbox message
enqueued, a command accepted, a receipt written, a wait resolved). The loop's idle wait
ends at once and its backoff resets — latency follows the work, not the idle backoff —
while the polling stays the guarantee (a wakeup is a hint; losing one costs at most one
idle period, and other processes' work is found by polling).

Usable three ways: ``await loops.run()``; ``async with loops:`` (started in the
background, stopped on exit); ``await loops.start()`` then ``await loops.stop()`` (the
``services.service_main.Background`` protocol).

The outbox dispatchers and the effect owner's command dispatcher use it; it is the
shape the project-wide background lifecycle takes, so the integrator can fold it into
that one without changing callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

__all__ = ["BackgroundLoops", "LoopTask", "Wakeup"]

log = logging.getLogger(__name__)

_MIN_IDLE_S = 0.01


class Wakeup:
    """A process-local nudge for idle loops (see the module docstring). Every loop
    waiting on it wakes on :meth:`notify`; a notify while no loop waits is remembered
    until the next wait."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """New work was committed for the loops waiting on this wakeup."""
        self._event.set()

    async def wait(self, stop: asyncio.Event, idle_s: float) -> bool:
        """Sleep until :meth:`notify`, ``stop`` or ``idle_s`` passed; True when notified."""
        if self._event.is_set():
            self._event.clear()
            return True
        waiters = [asyncio.ensure_future(self._event.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waiters, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        notified = self._event.is_set()
        if notified:
            self._event.clear()
        return notified


@dataclass(frozen=True)
class LoopTask:
    """One loop: ``body()`` returns True when it did work; ``wake`` ends its idle wait."""

    name: str
    body: Callable[[], Awaitable[bool]]
    idle_s: float
    interval: bool = False
    wake: Wakeup | None = None


class BackgroundLoops:
    """Runs :class:`LoopTask` bodies until shutdown (see the module docstring)."""

    def __init__(
        self,
        tasks: Sequence[LoopTask],
        *,
        stop_grace_s: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        self._tasks = list(tasks)
        self._stop = asyncio.Event()
        self._grace = stop_grace_s
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._runner: asyncio.Task[None] | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def _loop(self, task: LoopTask) -> None:
        idle_max = max(task.idle_s, _MIN_IDLE_S)
        current = idle_max if task.interval else _MIN_IDLE_S
        while not self._stop.is_set():
            try:
                busy = await task.body()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: iteration failed; backing off", task.name)
                busy = False
            if busy and not task.interval:
                current = _MIN_IDLE_S
                await asyncio.sleep(0)  # let other tasks run between busy iterations
                continue
            delay = current * (0.5 + self._rng.random() / 2)
            if not task.interval:
                current = min(idle_max, current * 2)
            if task.wake is not None:
                if await task.wake.wait(self._stop, delay) and not task.interval:
                    current = _MIN_IDLE_S
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)

    async def run(self) -> None:
        """Run every loop until :meth:`shutdown` (or until one crashes)."""
        children = [asyncio.create_task(self._loop(t), name=t.name) for t in self._tasks]
        if not children:
            await self._stop.wait()
            return
        stopper = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait([*children, stopper], return_when=asyncio.FIRST_EXCEPTION)
            if stopper not in done:
                # A loop ended on its own: only an exception can do that.
                self._stop.set()
            _, pending = await asyncio.wait(children, timeout=self._grace)
            for child in pending:
                child.cancel()
            results = await asyncio.gather(*children, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError
                ):
                    raise result
        finally:
            stopper.cancel()
            for child in children:
                child.cancel()

    async def shutdown(self) -> None:
        """Ask every loop to stop after its current iteration (idempotent)."""
        self._stop.set()

    async def start(self) -> BackgroundLoops:
        """Run in a background task; pair with :meth:`stop`."""
        if self._runner is None:
            self._runner = asyncio.create_task(self.run(), name="background-loops")
        return self

    async def stop(self) -> None:
        """Shut down and wait for the background task (idempotent)."""
        await self.shutdown()
        runner, self._runner = self._runner, None
        if runner is not None:
            try:
                await asyncio.wait_for(runner, timeout=self._grace + 5)
            except TimeoutError:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner

    async def __aenter__(self) -> BackgroundLoops:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
