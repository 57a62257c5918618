"""Which asyncio event loop a service process (and the bench) runs on.

``FLOW_EVENT_LOOP``: ``auto`` (the default) runs on ``uvloop`` when it is installed and on
the standard library's loop otherwise; ``uvloop`` requires it (a process without it
refuses to start with a configuration error naming the variable); ``asyncio`` is the
standard library's loop.

Why: a durable step is mostly per-statement work (driver packets, the event loop's
callbacks, SQLAlchemy's execution) and the loop's share of that CPU is 10-15 %;
``uvloop`` (libuv) makes that share smaller (``docs/performance.md``, "Round 6: event
loop"). Nothing in the services depends on the loop's implementation: grpc.aio,
asyncmy, aiomysql, aiosqlite and aiosmtplib only use the public asyncio API, and the crash tests
run the real service processes on whichever loop ``auto`` picks.

Pure choice (:func:`resolve`) apart from running (:func:`run`), so the choice is unit
tested without starting a loop; ``services.config`` resolves ``FLOW_EVENT_LOOP`` once
(a bad value is a ``ConfigError`` at start-up).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["EVENT_LOOPS", "install", "loop_factory", "resolve", "run"]

T = TypeVar("T")

#: The values ``FLOW_EVENT_LOOP`` accepts.
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def _uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: str, *, uvloop_installed: bool | None = None) -> str:
    """The loop ``choice`` (a ``FLOW_EVENT_LOOP`` value) names on this host:
    ``"uvloop"`` or ``"asyncio"``.

    Raises:
        ValueError: ``choice`` is not one of :data:`EVENT_LOOPS`, or is ``uvloop`` on a
            host without it.
    """
    installed = _uvloop_installed() if uvloop_installed is None else uvloop_installed
    value = choice.strip().lower()
    if value not in EVENT_LOOPS:
        raise ValueError(f"FLOW_EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if value == "uvloop" and not installed:
        raise ValueError("FLOW_EVENT_LOOP=uvloop but the uvloop package is not installed")
    if value == "auto":
        return "uvloop" if installed else "asyncio"
    return value


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The ``asyncio.Runner`` loop factory of a resolved ``loop`` (``None`` = the standard
    library's default)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """``asyncio.run(main)`` on the resolved ``loop`` (``"uvloop"`` or ``"asyncio"``)."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)


def install(loop: str) -> None:
    """Make every later ``asyncio.run`` of this process use the resolved ``loop`` (the
    bench's figures and the command-line tools then run on the loop the services run on)."""
    if loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(None)
