"""Pressure signals (§16.2) → how many new admissions each lane gets in a pass: pure.

:class:`PressureSignals` is one sample of the signals the runtime can observe without a
query of its own: admitted and active mutation transactions, connection-pool saturation,
and — over a sliding window of attempt outcomes (:class:`OutcomeWindow`) — the lock-wait,
deadlock, retry and lease-expiry rates, plus the oldest queue age admission saw. A
signal's pressure is 0 up to half its threshold (:data:`SOFT_START`), then rises linearly
to 1 at the threshold; the pass's pressure is the largest.

:func:`pass_limits` says how many candidates each lane of an org may fetch in one pass,
and :func:`mutation_inflight_limit` how many mutation attempts may be in flight at once:

* mutation lanes (durable mutation, bounded atomic foreground) get
  ``floor((1 - pressure) * capacity)`` per pass — zero at full pressure — and at most
  ``floor((1 - pressure) * (budget - reserved))`` in flight, where ``reserved =
  ceil(reserved_share * budget)`` (at least one) is never theirs;
* the cold lanes (dependency wakeup, effect completion, maintenance) are served first in
  a pass and never drop below their reserved share of it, so dependency completions and
  recovery keep moving however hard mutations are throttled;
* nothing is ever *added* under pressure: the limits only shrink, so overload is never
  answered with more polling or more connections (the worker skips the claim query of a
  lane whose limit is zero).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from runtime_svc.admission.budgets import PressureThresholds
from runtime_svc.compiler.kinds import QueueClass

__all__ = [
    "COLD_LANES",
    "MUTATION_LANES",
    "SOFT_START",
    "OutcomeKind",
    "OutcomeWindow",
    "PressureSignals",
    "mutation_inflight_limit",
    "pass_limits",
    "pressure_level",
]

#: Lanes whose steps open business mutation transactions: throttled first.
MUTATION_LANES = frozenset(
    {QueueClass.DURABLE_MUTATION.value, QueueClass.BOUNDED_ATOMIC_FOREGROUND.value}
)
#: Lanes the reserved share keeps moving (§16.2: cold lanes, dependency completions,
#: recovery).
COLD_LANES = frozenset(
    {
        QueueClass.DEPENDENCY_WAKEUP.value,
        QueueClass.EFFECT_COMPLETION.value,
        QueueClass.MAINTENANCE.value,
    }
)


#: A signal below this fraction of its threshold is no pressure at all; from there it
#: rises linearly to 1 at the threshold (one busy connection is not overload).
SOFT_START = 0.5


class OutcomeKind:
    """Outcome classes the window counts (strings, so the worker's outcomes map 1:1)."""

    OK = "ok"
    RETRY = "retry"
    LOCK_WAIT = "lock_wait"
    DEADLOCK = "deadlock"
    LEASE_EXPIRED = "lease_expired"
    FAILED = "failed"


@dataclass(frozen=True)
class PressureSignals:
    """One sample of the §16.2 signals (rates are per admitted attempt)."""

    active_mutations: int = 0
    pool_in_use: int = 0
    pool_size: int = 0
    lock_wait_rate: float = 0.0
    deadlock_rate: float = 0.0
    retry_rate: float = 0.0
    queue_age_seconds: float = 0.0
    lease_expiry_rate: float = 0.0

    @property
    def pool_saturation(self) -> float:
        return self.pool_in_use / self.pool_size if self.pool_size > 0 else 0.0

    def levels(self, t: PressureThresholds) -> dict[str, float]:
        """Each signal's pressure in ``[0, 1]`` (for the gauge and the log line)."""
        raw = {
            "active_mutations": self.active_mutations / t.active_mutations,
            "pool_saturation": self.pool_saturation / t.pool_saturation,
            "lock_wait_rate": self.lock_wait_rate / t.lock_wait_rate,
            "deadlock_rate": self.deadlock_rate / t.deadlock_rate,
            "retry_rate": self.retry_rate / t.retry_rate,
            "queue_age_seconds": self.queue_age_seconds / t.queue_age_seconds,
            "lease_expiry_rate": self.lease_expiry_rate / t.lease_expiry_rate,
        }
        return {
            k: min(1.0, max(0.0, (v - SOFT_START) / (1.0 - SOFT_START))) for k, v in raw.items()
        }


def pressure_level(signals: PressureSignals, thresholds: PressureThresholds) -> float:
    """The largest pressure of the throttling signals, in ``[0, 1]``.

    Queue age is sampled and exported (the ``nexus_flow_admission_pressure`` gauge) but
    does not throttle: holding mutations back because the queue is old would only make it
    older, and with no admission there would be no new sample to end it. An old queue is
    what the fair scheduler and the reserved share bound.
    """
    levels = signals.levels(thresholds)
    return max((v for k, v in levels.items() if k != "queue_age_seconds"), default=0.0)


def pass_limits(
    lanes: Iterable[str],
    *,
    capacity: int,
    pressure: float,
    reserved_share: float,
    lane_caps: Mapping[str, int | None] | None = None,
) -> dict[str, int]:
    """Candidates each lane may fetch in one org's pass (see the module docstring).

    Args:
        lanes: the lanes this worker serves.
        capacity: the org's admissions this pass (``min(batch, credit)``).
        pressure: :func:`pressure_level`.
        reserved_share: the share cold lanes keep however high the pressure.
        lane_caps: optional per-lane limit (the policy's lane ``max_inflight``).
    """
    caps = lane_caps or {}
    pressure = min(1.0, max(0.0, pressure))
    capacity = max(0, capacity)
    reserved = max(1, math.ceil(reserved_share * capacity)) if capacity else 0
    out: dict[str, int] = {}
    for lane in dict.fromkeys(lanes):
        if lane in MUTATION_LANES:
            room = math.floor((1.0 - pressure) * capacity)
        else:
            room = max(reserved, math.floor((1.0 - pressure) * capacity))
        cap = caps.get(lane)
        out[lane] = room if cap is None else min(room, cap)
    return out


def mutation_inflight_limit(budget: int, pressure: float, reserved_share: float) -> int:
    """Mutation attempts that may be in flight at once in this process.

    The environment ``budget`` less the cold lanes' reserved share
    (``ceil(reserved_share * budget)``, at least one), scaled down by pressure: zero at
    full pressure, so new mutations stop before the pool is exhausted while the reserved
    connections keep dependency completions and recovery moving.
    """
    pressure = min(1.0, max(0.0, pressure))
    reserved = max(1, math.ceil(reserved_share * budget))
    return max(0, math.floor((1.0 - pressure) * max(budget - reserved, 0)))


class OutcomeWindow:
    """Attempt outcomes of this process over the last ``horizon_s`` seconds (at most
    ``size`` of them), for the §16.2 rates.

    Bounded both ways: a retry storm shows as a rising rate within a few attempts, and
    the rate decays as attempts succeed again *or* as time passes — so a rate that
    stopped mutation admissions cannot keep them stopped once no new outcome arrives
    (after the horizon, admissions resume and probe the database again).
    """

    def __init__(
        self,
        size: int = 200,
        *,
        horizon_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        if horizon_s <= 0:
            raise ValueError("horizon_s must be > 0")
        self._events: deque[tuple[float, str]] = deque(maxlen=size)
        self._horizon = horizon_s
        self._clock = clock

    def _prune(self) -> None:
        oldest = self._clock() - self._horizon
        while self._events and self._events[0][0] < oldest:
            self._events.popleft()

    def add(self, kind: str) -> None:
        self._events.append((self._clock(), kind))

    def rate(self, *kinds: str) -> float:
        self._prune()
        if not self._events:
            return 0.0
        return sum(1 for _, e in self._events if e in kinds) / len(self._events)

    def __len__(self) -> int:
        self._prune()
        return len(self._events)
