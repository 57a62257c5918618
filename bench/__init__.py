"""Benchmarks run by ``make bench``: they print figures and ratios, they are not tests."""

from __future__ import annotations

from services import event_loop
from services.config import event_loop_choice

__all__ = ["on_service_loop"]


def on_service_loop() -> str:
    """Make every later ``asyncio.run`` of this process use the event loop the services
    run on (``FLOW_EVENT_LOOP``, default ``auto``: uvloop where installed), print which,
    and return its name — so a section run alone (``python -m bench.sync_bench``)
    measures on the same loop as ``make bench``."""
    loop = event_loop_choice()
    event_loop.install(loop)
    print(f"event loop: {loop} (FLOW_EVENT_LOOP)")
    return loop
