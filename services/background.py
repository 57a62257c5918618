"""One lifecycle for every background loop of a service process (STYLE 12), and the fair
org rotation the cross-org loops use.

A **loop** (:class:`BackgroundLoop`) calls one iteration — ``run_once()``, or the
``body`` it was given — until it is shut down. An iteration returns ``True`` when it did
work (the next one starts at once) and ``False`` when it found none (the loop then waits
a bounded, jittered, exponentially growing idle delay, :class:`IdleBackoff`, capped at
``idle_s``). A periodic duty (a sweep, retention) is an ``interval`` loop instead: it
waits a jittered ``idle_s`` after every iteration. An iteration that raises is logged and
treated as idle, so a failing dependency (database down) backs off instead of spinning.
The loop holds no connection while it waits: an iteration opens and closes its own
transactions.

Lifecycle, the same for every loop and for a :class:`LoopGroup` of them:

* ``await loop.run()`` runs until :meth:`~BackgroundLoop.shutdown`;
* ``shutdown()`` is idempotent: it asks the loop to stop after the current iteration,
  waits a bounded grace period, then cancels;
* ``async with loop:`` starts ``run()`` as a task and shuts it down on exit.

A :class:`LoopGroup` owns several loops (the runtime's workers, sweeps, wait sweeps,
retention and outbox dispatcher; the catalog's request sweep; the effect owner's command
and outbox dispatchers). Its children are awaited
with ``FIRST_EXCEPTION``: a child that dies of an error that escaped its iteration
handler (a bug in the loop itself) stops the whole group and ``run()`` re-raises it.
Add a loop with :meth:`LoopGroup.add` (or :meth:`LoopGroup.spawn` for a plain body);
``stop()`` is the ``services.service_main.Background`` hook.

A loop may also be *woken*: give it a :class:`Wakeup` and call ``wakeup.notify()`` where
new work for it commits in this process (an outbox message enqueued, a command accepted,
a receipt written, a wait resolved). The loop's idle wait ends at once and its backoff
resets — latency follows the work, not the idle backoff — while polling stays the
guarantee (a wakeup is a hint; losing one costs at most one idle period, and other
processes' work is found by polling). A notification may carry a *hint* — what
committed (an outbox message's id, an accepted command) — that the woken loop takes with
:meth:`Wakeup.take_hints` to claim that work at once, without first discovering it by a
query; hints are bounded (the oldest are dropped: polling still finds their work) and
only ever a shortcut to work the loop's own fenced claim re-validates.

:class:`OrgRotation` walks the orgs that have work in bounded batches with a cursor that
survives between passes and wraps around, so every org is served within
``ceil(orgs / batch)`` passes however many orgs sort before it (issue 10, item 1).

Example::

    group = LoopGroup()
    group.spawn("flow-sweeps", sweeper.sweep_once_busy, idle_s=1.0, interval=True)
    group.add(RequestRetention(engine, ledger, retention=window))
    group.start()           # or: async with group: ...
    ...
    await group.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

__all__ = [
    "DEFAULT_GRACE_S",
    "HINTED_IDLE_FLOOR",
    "MAX_HINTS",
    "BackgroundLoop",
    "Body",
    "IdleBackoff",
    "LoopGroup",
    "OrgRotation",
    "OrgSource",
    "Wakeup",
    "settle_tasks",
]

log = logging.getLogger(__name__)


async def settle_tasks(tasks: Iterable[asyncio.Future[Any]], grace_s: float) -> None:
    """Wait at most ``grace_s`` for ``tasks`` (work handed over after a commit and still
    in flight when its owner stops), then cancel the ones still running and reap them."""
    pending = set(tasks)
    if not pending:
        return
    _, late = await asyncio.wait(pending, timeout=grace_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)


#: One iteration of a loop: ``True`` when it did work.
Body = Callable[[], Awaitable[bool]]
#: ``(after, limit) -> orgs`` in org order strictly after ``after`` (all when ``None``).
OrgSource = Callable[[str | None, int], Awaitable[list[str]]]

#: How long :meth:`BackgroundLoop.shutdown` lets the current iteration finish.
DEFAULT_GRACE_S = 10.0
_MIN_IDLE_S = 0.01
#: A woken loop whose producers name their work (hints) starts its idle backoff after
#: work at ``idle_s / HINTED_IDLE_FLOOR`` instead of 10 ms: no rapid re-polls competing
#: with the next hop on the same event loop (polling finds other processes' work).
HINTED_IDLE_FLOOR = 4
#: The most hints a :class:`Wakeup` keeps (older ones are dropped; polling finds them).
MAX_HINTS = 256


class Wakeup:
    """A process-local nudge for idle loops (see the module docstring). A notify wakes
    ONE loop waiting on it — the one that has waited longest — since one loop takes the
    notified work (and its hints); waking every idle loop would send all but one of them
    on a discovery pass per notification. A notify while no loop waits is remembered
    until the next wait (a busy loop re-polls by itself). ``notify(hint)`` also
    remembers what committed (bounded to ``max_hints``, oldest dropped) for
    :meth:`take_hints`. Several notifications in a row wake as many waiting loops: the
    first to run takes the hints, the others poll and find the rest of the burst."""

    def __init__(self, max_hints: int = MAX_HINTS) -> None:
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._pending = False
        self._hints: deque[object] = deque(maxlen=max(1, max_hints))
        self._lost = False

    def notify(self, hint: object | None = None) -> None:
        """New work was committed for the loops waiting on this wakeup (``hint``: what,
        for a loop that can claim it directly); wakes one waiting loop."""
        if hint is not None:
            if len(self._hints) == self._hints.maxlen:
                self._lost = True  # the oldest is dropped: only a poll finds it now
            self._hints.append(hint)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._pending = True

    def take_hints(self) -> list[object]:
        """The hints notified since the last call, oldest first (and forget them)."""
        hints = list(self._hints)
        self._hints.clear()
        return hints

    def take_lost(self) -> bool:
        """Whether a hint was dropped (the bound) since the last call, and forget it: a
        loop that relies on the hints to name every notified piece of work must then
        poll (see ``BackgroundLoop(wake_resets=False)``)."""
        lost, self._lost = self._lost, False
        return lost

    async def wait(self, stop: asyncio.Event, idle_s: float) -> bool:
        """Sleep until :meth:`notify` picks this loop, ``stop`` or ``idle_s`` passed;
        True when notified."""
        if self._pending:
            self._pending = False
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        stopping: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait(
                {waiter, stopping}, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._pending = True  # picked, then cancelled: hand the notification on
            raise
        finally:
            stopping.cancel()
            if not waiter.done():
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        return not waiter.cancelled()


class IdleBackoff:
    """Bounded, jittered exponential idle delay: reset on work, doubled when idle."""

    def __init__(
        self, max_s: float, rng: random.Random | None = None, *, min_s: float = _MIN_IDLE_S
    ) -> None:
        self._max = max(max_s, _MIN_IDLE_S)
        self._min = min(max(min_s, _MIN_IDLE_S), self._max)
        self._current = self._min
        self._rng = rng or random.Random()  # noqa: S311 - idle jitter, not security

    def reset(self) -> None:
        self._current = self._min

    def next_delay(self) -> float:
        """Full jitter in ``[current/2, current]``, then double (capped)."""
        delay = self._current * (0.5 + self._rng.random() / 2)
        self._current = min(self._max, self._current * 2)
        return delay

    def period(self) -> float:
        """The jittered full period ``[max/2, max]`` (an interval loop's wait)."""
        return self._max * (0.5 + self._rng.random() / 2)


class BackgroundLoop:
    """One background loop (see the module docstring).

    Subclasses implement :meth:`run_once`; or pass ``body``.

    Args:
        name: the loop's name (task name, log lines).
        idle_s: the longest idle wait between iterations that found no work.
        body: the iteration, when not subclassing.
        grace_s: how long :meth:`shutdown` waits for the current iteration.
        interval: a periodic duty (sweeps, retention): wait a jittered ``idle_s`` after
            every iteration, busy or not, instead of the exponential idle backoff.
        wake: ends the idle wait at once when notified (the backoff resets).
        min_idle_s: the first idle delay after work (default 10 ms). A loop whose
            producers in this process wake it (and name their work) needs no rapid
            re-polls after each piece of work: a larger floor keeps those polls — and
            their transactions on the event loop the next hop runs on — off the busy
            path, while polling still finds other processes' work within ``idle_s``.
        wake_resets: whether a wake restarts the idle backoff at its floor (default).
            ``False`` for a loop whose body serves what the wake *named* (hints, handed
            messages) without a discovery query and polls itself when a wake named
            nothing or hints were dropped (:meth:`Wakeup.take_lost`): the wake ends
            the wait, but the polls for other processes' work keep their backed-off
            schedule (at most ``idle_s`` apart, as before) instead of restarting at the
            floor after every named piece of work — one discovery query per effect and
            loop fewer under a steady trickle of work (issue 12, round 6). Work a poll
            finds still resets the backoff.
    """

    def __init__(
        self,
        name: str,
        *,
        idle_s: float,
        body: Body | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        interval: bool = False,
        wake: Wakeup | None = None,
        min_idle_s: float = _MIN_IDLE_S,
        wake_resets: bool = True,
    ) -> None:
        if idle_s <= 0:
            raise ValueError("idle_s must be > 0")
        self.name = name
        self._idle_s = idle_s
        self._min_idle_s = min_idle_s
        self._body = body
        self.interval = interval
        self._wake = wake
        self._wake_resets = wake_resets
        self._grace_s = grace_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running = False

    @property
    def stopping(self) -> bool:
        """Whether :meth:`shutdown` was called (iterations check it between units)."""
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is iterating and no :meth:`shutdown` was asked for."""
        return self._running and not self._stop.is_set()

    async def run_once(self) -> bool:
        """One iteration; ``True`` when it did work."""
        if self._body is None:
            raise NotImplementedError(f"{type(self).__name__} must implement run_once()")
        return await self._body()

    async def run(self) -> None:
        """Iterate until :meth:`shutdown` (errors of an iteration are logged, then idle)."""
        backoff = IdleBackoff(self._idle_s, min_s=self._min_idle_s)
        self._running = True
        try:
            await self._iterate(backoff)
        finally:
            self._running = False

    async def _iterate(self, backoff: IdleBackoff) -> None:
        while not self._stop.is_set():
            try:
                busy = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: iteration failed; backing off", self.name)
                busy = False
            if self.interval:
                delay = backoff.period()
            elif busy:
                backoff.reset()
                await asyncio.sleep(0)  # let the other loops run between busy iterations
                continue
            else:
                delay = backoff.next_delay()
            if self._wake is not None:
                if await self._wake.wait(self._stop, delay) and self._wake_resets:
                    backoff.reset()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)

    def start(self) -> asyncio.Task[None]:
        """Start :meth:`run` as a task (idempotent); :meth:`shutdown` awaits it."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=self.name)
        return self._task

    async def shutdown(self) -> None:
        """Stop after the current iteration (bounded grace, then cancel); idempotent."""
        self._stop.set()
        task, self._task = self._task, None
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=self._grace_s)
        if not done:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> BackgroundLoop:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


class LoopGroup:
    """Several background loops with one lifecycle (see the module docstring).

    Args:
        loops: loops to own from the start.
        grace_s: how long :meth:`shutdown` waits for the children's current iterations.
    """

    def __init__(
        self, loops: Iterable[BackgroundLoop] = (), *, grace_s: float = DEFAULT_GRACE_S
    ) -> None:
        self._loops: list[BackgroundLoop] = list(loops)
        self._tasks: dict[BackgroundLoop, asyncio.Task[None]] = {}
        self._grace_s = grace_s
        self._started = False
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def loops(self) -> tuple[BackgroundLoop, ...]:
        return tuple(self._loops)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def add(self, loop: BackgroundLoop) -> BackgroundLoop:
        """Own ``loop``; it starts at once when the group is already running."""
        self._loops.append(loop)
        if self._started and not self._stop.is_set():
            self._tasks[loop] = loop.start()
            self._changed.set()
        return loop

    def spawn(
        self,
        name: str,
        body: Body,
        idle_s: float,
        *,
        interval: bool = False,
        wake: Wakeup | None = None,
        min_idle_s: float = _MIN_IDLE_S,
    ) -> BackgroundLoop:
        """Own a loop over ``body`` (``True`` when it did work; ``interval``: a periodic
        duty; ``wake``: ends its idle wait; ``min_idle_s``: the first idle delay after
        work — see :class:`BackgroundLoop`)."""
        return self.add(
            BackgroundLoop(
                name,
                idle_s=idle_s,
                body=body,
                grace_s=self._grace_s,
                interval=interval,
                wake=wake,
                min_idle_s=min_idle_s,
            )
        )

    def start(self) -> LoopGroup:
        """Start every child as a task (idempotent)."""
        if not self._started and not self._stop.is_set():
            self._started = True
            for loop in self._loops:
                self._tasks[loop] = loop.start()
        return self

    async def run(self) -> None:
        """Run every child until :meth:`shutdown`; a child that dies stops the group and
        its error is re-raised (``FIRST_EXCEPTION``)."""
        self.start()
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    done, _ = await asyncio.wait(
                        {*self._tasks.values(), stopper, changed},
                        return_when=asyncio.FIRST_EXCEPTION,
                    )
                finally:
                    changed.cancel()
                failed = [
                    t
                    for t in done
                    if t not in (stopper, changed) and not t.cancelled() and t.exception()
                ]
                if failed:
                    error = failed[0].exception()
                    log.error("background loop %s died; stopping the group", failed[0].get_name())
                    await self.shutdown()
                    if error is not None:
                        raise error
                # A child that ended on its own (shut down individually) is forgotten.
                for loop, task in list(self._tasks.items()):
                    if task.done():
                        del self._tasks[loop]
        finally:
            stopper.cancel()

    async def shutdown(self) -> None:
        """Ask every child to stop, wait (bounded), cancel the rest; idempotent."""
        self._stop.set()
        loops, self._loops = self._loops, []
        self._tasks.clear()
        if loops:
            await asyncio.gather(*(loop.shutdown() for loop in loops), return_exceptions=True)

    async def stop(self) -> None:
        """:meth:`shutdown` (the ``services.service_main.Background`` hook)."""
        await self.shutdown()

    async def __aenter__(self) -> LoopGroup:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


class OrgRotation:
    """Fair, bounded iteration over orgs with work (see the module docstring).

    Args:
        source: the orgs with work, in org order after a cursor, at most ``limit``.
        batch: the most orgs one :meth:`next_batch` returns.
    """

    def __init__(self, source: OrgSource, *, batch: int = 100) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self._source = source
        self.batch = batch
        self._after: str | None = None

    @property
    def cursor(self) -> str | None:
        """The last org served (the next batch starts after it)."""
        return self._after

    async def next_batch(self) -> list[str]:
        """The next at most ``batch`` orgs after the cursor, wrapping around to the first
        orgs when the end is reached; the cursor moves past them."""
        after = self._after
        orgs = await self._source(after, self.batch)
        if len(orgs) == self.batch:
            self._after = orgs[-1]
            return orgs
        # The end: continue from the beginning, up to the old cursor, within the batch.
        self._after = None
        if after is None:
            return orgs
        room = self.batch - len(orgs)
        head = [o for o in await self._source(None, room) if o <= after and o not in orgs]
        if len(head) == room and head:
            self._after = head[-1]
        return orgs + head
