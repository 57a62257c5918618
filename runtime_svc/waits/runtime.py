"""One process's durable-wait components, built once and shared by the record service,
the signal service, the workers and the sweeps (so a local wait commit refreshes the
record producer's memo that local record writes read)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel.store_waits import WaitStore
from runtime_svc.kernel.wait_model import DependencyRecord
from runtime_svc.waits.plans import PlanSource
from runtime_svc.waits.reconciler import WaitSweeper
from runtime_svc.waits.record_producer import RecordChangeProducer, RecordWatches
from runtime_svc.waits.registry import DEFAULT_SIGNAL_KINDS, ProducerRegistry
from runtime_svc.waits.resolution import Clock, Matcher, ResolvedRun
from runtime_svc.waits.signals import SignalService
from runtime_svc.waits.steps import WaitSteps
from services.db import db_now

__all__ = ["WaitRuntime"]


@dataclass(frozen=True)
class WaitRuntime:
    """The wait components of one runtime process."""

    engine: AsyncEngine
    registry: ProducerRegistry
    matcher: Matcher
    watches: RecordWatches
    producer: RecordChangeProducer
    steps: WaitSteps
    signals: SignalService

    @classmethod
    def build(
        cls,
        engine: AsyncEngine,
        *,
        clock: Clock = db_now,
        signal_kinds: Iterable[str] = DEFAULT_SIGNAL_KINDS,
        watch_ttl_s: float | None = None,
        on_resolved: Callable[[ResolvedRun], None] | None = None,
    ) -> WaitRuntime:
        """Wire registry, matcher, record producer, wait steps and signal service.

        Args:
            engine: the runtime database.
            clock: the durable clock (the run store's; tests shift it).
            signal_kinds: external signal kinds accepted from ``SubmitWakeSignal``.
            watch_ttl_s: the record producer's memo lifetime (default 2 s).
            on_resolved: called with the run a resolution made runnable (wakes workers).
        """
        registry = ProducerRegistry(signal_kinds)
        matcher = Matcher(
            engine, WaitStore(engine, clock), registry, PlanSource(), clock, on_resolved=on_resolved
        )
        watches = RecordWatches() if watch_ttl_s is None else RecordWatches(watch_ttl_s)
        return cls(
            engine=engine,
            registry=registry,
            matcher=matcher,
            watches=watches,
            producer=RecordChangeProducer(watches, matcher),
            steps=WaitSteps(engine, matcher, watches, clock),
            signals=SignalService(engine, matcher, registry, clock),
        )

    def sweeper(
        self,
        *,
        batch: int = 100,
        org_batch: int = 100,
        expiry_guard: Callable[[DependencyRecord], Awaitable[bool]] | None = None,
    ) -> WaitSweeper:
        """The bounded wait sweeps (reconciler, expiry, repair, retention): ``batch`` rows
        per part and org, ``org_batch`` orgs per pass in rotation; ``expiry_guard`` says
        whether a due dependency may expire now."""
        return WaitSweeper(
            self.engine,
            self.matcher,
            batch=batch,
            watches=self.watches,
            org_batch=org_batch,
            expiry_guard=expiry_guard,
        )
