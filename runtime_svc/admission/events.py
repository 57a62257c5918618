"""The admission ticket of the attempt the current task executes (task-local).

The worker runs an admitted candidate inside :func:`admitted`; the observability hook of
a scheduled retry calls :func:`note_retry` with its safe reason code (``deadlock``,
``lock_wait_timeout``, …), which lands on that ticket, so the controller's outcome window
can tell lock waits and deadlocks from other retries (§16.2 signals) without the worker
passing reasons around. No import of the kernel or the worker: the hooks module imports
this one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["Ticket", "admitted", "note_retry"]


@dataclass
class Ticket:
    """One admission: what it counted in flight, and what the attempt reported."""

    org_id: str
    lane: str
    counted: tuple[str, ...]
    flow_run_id: str = ""
    retry_reasons: list[str] = field(default_factory=list)
    released: bool = False


_CURRENT: ContextVar[Ticket | None] = ContextVar("nexus_flow_admission", default=None)


@contextmanager
def admitted(ticket: Ticket) -> Iterator[Ticket]:
    """Make ``ticket`` current for the attempt executed in this block."""
    token = _CURRENT.set(ticket)
    try:
        yield ticket
    finally:
        _CURRENT.reset(token)


def note_retry(reason: str) -> None:
    """The current attempt scheduled a retry for ``reason`` (no-op without a ticket)."""
    ticket = _CURRENT.get()
    if ticket is not None:
        ticket.retry_reasons.append(reason)
