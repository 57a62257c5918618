"""A supervised pool of child processes: start N, restart a dead one with backoff, stop
them all on shutdown.

The runtime uses it for ``FLOW_RUNTIME_WORKER_PROCESSES`` (``runtime_svc.app``): one
Python process is one core at most, so step execution scales across cores only with more
processes. Execution stays exactly-once however many processes contend, because every
durable transition is fenced in the database (§12); the pool only keeps the right number
of them alive.

Lifecycle, chosen so that no child outlives its supervisor:

* each child gets a pipe as stdin and is started with ``--supervised``: the child treats
  end-of-file on stdin as SIGTERM (``services.service_main``), so a supervisor that dies
  — even by SIGKILL — takes its children down with it (the kernel closes the pipe);
* :meth:`ProcessPool.stop` sends SIGTERM to every child (graceful: a child finishes or
  abandons its in-flight steps — an abandoned step's lease simply expires and another
  worker recovers it), waits ``stop_grace_s`` and SIGKILLs whatever is left;
* ``spawn_env`` gives each start of a slot its own variables (e.g. a fresh metrics port);
* a child that exits while the pool runs is restarted after
  :meth:`RestartPolicy.delay` (jittered exponential in the number of consecutive short
  lives; a child that ran ``stable_s`` resets the count), so a crash loop (e.g. the
  database is down) does not spin;
* a slot whose child has exited ``unhealthy_after`` times in a row without running
  ``stable_s`` is *crash-looping* until a restarted child has run ``stable_s``:
  :meth:`ProcessPool.unhealthy` then names it, and the supervisor reports NOT_SERVING on
  its gRPC health service (``services.service_main``) so probes and operators see a pod
  that no longer executes steps instead of a healthy-looking supervisor.

Children share the supervisor's stdout/stderr and process group: Ctrl-C in a terminal
reaches all of them at once, and each drains on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ProcessPool", "RestartPolicy"]

log = logging.getLogger(__name__)

#: Unread bytes in a child's stdin pipe buffer beyond which :meth:`ProcessPool.send`
#: skips it (a child that does not read must not grow the supervisor's memory).
_MAX_PENDING_BYTES = 64 * 1024


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again.

    Attributes:
        base_s: delay after the first short-lived exit.
        max_s: the longest delay.
        stable_s: a child that ran at least this long counts as healthy (its exit restarts
            the backoff at ``base_s``).
        jitter: fraction of the delay drawn at random (spreads restarts of many pods).
        unhealthy_after: consecutive short lives after which a slot counts as
            crash-looping (see :meth:`ProcessPool.unhealthy`).
    """

    base_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 30.0
    jitter: float = 0.2
    unhealthy_after: int = 3

    def delay(self, failures: int, rand: float = 0.5) -> float:
        """Seconds to wait before restarting after ``failures`` consecutive short lives
        (``rand`` in [0, 1) places the delay within its jitter band)."""
        exp = min(self.max_s, self.base_s * float(2 ** max(0, failures - 1)))
        return max(0.0, exp * (1 - self.jitter + 2 * self.jitter * rand))

    def failures_after(self, failures: int, ran_s: float) -> int:
        """The consecutive-failure count after a child that ran ``ran_s`` exited."""
        return 1 if ran_s >= self.stable_s else failures + 1

    def crash_looping(self, failures: int, up_s: float | None) -> bool:
        """Whether a slot with ``failures`` consecutive short lives whose current child
        has been up ``up_s`` seconds (None: no child running) is crash-looping: it is
        until a restarted child has run ``stable_s``."""
        if failures < self.unhealthy_after:
            return False
        return up_s is None or up_s < self.stable_s


class ProcessPool:
    """``size`` copies of ``argv`` with environment ``env``, supervised (see the module
    docstring). Start with :meth:`start`, stop with :meth:`stop` (idempotent)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        size: int,
        *,
        policy: RestartPolicy | None = None,
        stop_grace_s: float = 30.0,
        spawn_env: Callable[[int], Mapping[str, str]] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a process pool needs at least one process")
        self.name = name
        self._argv, self._env, self._size = list(argv), dict(env), size
        self._policy = policy or RestartPolicy()
        self._stop_grace_s = stop_grace_s
        self._spawn_env = spawn_env
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._extra: dict[int, Mapping[str, str]] = {}
        self._slots: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        #: Per slot: consecutive short lives, and when its current child started
        #: (event-loop time; absent while no child runs).
        self._failures: dict[int, int] = {}
        self._since: dict[int, float] = {}
        self._next_send = 0
        #: Children started again after an unexpected exit (all slots).
        self.restarts = 0

    @property
    def size(self) -> int:
        return self._size

    def pids(self) -> list[int]:
        """The pids of the children alive now (slot order)."""
        return [pid for _, pid, _ in self.children()]

    def children(self) -> list[tuple[int, int, Mapping[str, str]]]:
        """``(slot, pid, spawn_env(slot))`` of every child alive now (slot order); empty
        once the pool is stopping."""
        if self._stopping.is_set():
            return []
        return [
            (slot, p.pid, self._extra.get(slot, {}))
            for slot, p in sorted(self._procs.items())
            if p.returncode is None
        ]

    def send(self, line: bytes) -> bool:
        """Write one message line (``services.supervisor_link``) to the stdin of one live
        child, round-robin over the slots; False when no child could take it. Never
        blocks: a child whose pipe already holds :data:`_MAX_PENDING_BYTES` unread bytes
        is skipped (messages are hints; the child's polling finds the work anyway)."""
        if self._stopping.is_set():
            return False
        for _ in range(self._size):
            slot = self._next_send
            self._next_send = (self._next_send + 1) % self._size
            proc = self._procs.get(slot)
            stdin = None if proc is None or proc.returncode is not None else proc.stdin
            if stdin is None or stdin.is_closing():
                continue
            if stdin.transport.get_write_buffer_size() > _MAX_PENDING_BYTES:
                continue
            stdin.write(line)
            return True
        return False

    def unhealthy(self) -> str | None:
        """Why the pool is not doing its job now, or None: names the crash-looping slots
        (:meth:`RestartPolicy.crash_looping`). A stopping pool is not unhealthy (the
        server's own drain reports that)."""
        if self._stopping.is_set():
            return None
        now = asyncio.get_running_loop().time()
        looping = []
        for slot in range(self._size):
            failures = self._failures.get(slot, 0)
            proc, since = self._procs.get(slot), self._since.get(slot)
            up = (
                now - since
                if since is not None and proc is not None and proc.returncode is None
                else None
            )
            if self._policy.crash_looping(failures, up):
                looping.append(f"{slot} ({failures} exits in a row)")
        if not looping:
            return None
        return f"{self.name} crash-looping: slot {', '.join(looping)}"

    async def start(self) -> ProcessPool:
        """Start every child (returns once each has been spawned)."""
        started = [asyncio.Event() for _ in range(self._size)]
        self._slots = [
            asyncio.create_task(self._slot(i, started[i]), name=f"{self.name}-{i}")
            for i in range(self._size)
        ]
        for event in started:
            await event.wait()
        for task in self._slots:
            if task.done() and task.exception() is not None:
                await self.stop()
                raise RuntimeError(f"{self.name}: a process could not be started") from (
                    task.exception()
                )
        return self

    async def _spawn(self, slot: int) -> asyncio.subprocess.Process:
        extra = dict(self._spawn_env(slot)) if self._spawn_env is not None else {}
        proc = await asyncio.create_subprocess_exec(
            *self._argv, env={**self._env, **extra}, stdin=asyncio.subprocess.PIPE
        )
        self._extra[slot] = extra
        self._procs[slot] = proc
        self._since[slot] = asyncio.get_running_loop().time()
        log.info("%s %d started (pid %d)", self.name, slot, proc.pid)
        return proc

    async def _slot(self, slot: int, started: asyncio.Event) -> None:
        """Keep one child alive in ``slot`` until the pool stops. The first start's
        failure is raised (``start`` reports it); a later one is retried with backoff."""
        loop = asyncio.get_running_loop()
        failures = 0
        try:
            proc: asyncio.subprocess.Process | None = await self._spawn(slot)
        finally:
            started.set()
        while True:
            if proc is not None:
                began = loop.time()
                code = await proc.wait()
                if self._stopping.is_set():
                    return
                ran = loop.time() - began
                failures = self._policy.failures_after(failures, ran)
                why = f"(pid {proc.pid}) exited with {code} after {ran:.1f}s"
            else:
                failures += 1
                why = "could not be started"
            self._failures[slot] = failures
            self._since.pop(slot, None)
            delay = self._policy.delay(failures, random.random())  # noqa: S311 - jitter, not a secret
            log.warning("%s %d %s; restarting in %.1fs", self.name, slot, why, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            self.restarts += 1
            try:
                proc = await self._spawn(slot)
            except OSError:
                log.exception("%s %d: starting a process failed", self.name, slot)
                proc = None

    async def _terminate(self, procs: list[asyncio.subprocess.Process], grace_s: float) -> None:
        """SIGTERM ``procs``, wait ``grace_s``, SIGKILL the rest and reap them."""
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in procs]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=grace_s)
        for proc in procs:
            if proc.returncode is None:
                log.warning("%s pid %d ignored SIGTERM; killing it", self.name, proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        if pending:
            await asyncio.wait(pending, timeout=10)

    async def stop(self) -> None:
        """SIGTERM every child, wait ``stop_grace_s``, SIGKILL the rest; idempotent."""
        if self._stopping.is_set():
            return
        procs = [p for p in self._procs.values() if p.returncode is None]
        self._stopping.set()
        await self._terminate(procs, self._stop_grace_s)
        for task in self._slots:
            task.cancel()
        await asyncio.gather(*self._slots, return_exceptions=True)
        # A slot that was starting a process when the stop began may have started one
        # after the list above was taken: it goes too.
        late = [p for p in self._procs.values() if p.returncode is None and p not in procs]
        await self._terminate(late, self._stop_grace_s)
        for proc in self._procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
        log.info("%s: %d process(es) stopped", self.name, len(procs) + len(late))
