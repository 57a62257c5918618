"""Runtime execution budget of a compiled step (§9.1, §9.2): pure counters, no I/O.

The compiler proves a step's maximum element executions, reads, writes and fan-out
(:class:`~runtime_svc.compiler.plan.BoundSummary`); the synchronous profiles (Embedded
Before-Save, Bounded Atomic) also *enforce* them while the step runs, because a plan
must never silently run a larger transaction than the one it was admitted with. A
:class:`BudgetMeter` is charged by the interpreter:

* ``steps`` — one per element execution (a ``Loop`` node counts once per visit);
* ``reads`` — one per record a ``GetRecords`` returned (or, for a miss, one per query);
* ``writes`` — one per record mutation intent (the Embedded Before-Save transform of the
  trigger record itself is not a write: it is the caller's own row);
* ``fanout`` — one per loop-body entry, and the size of a collection an ``UpdateRecord``
  / ``DeleteRecord`` targets at once.

A bound that the summary lists as unknown (``None``) is not enforced here — only the
synchronous profiles use a meter, and their plans never have unknown bounds. Exhausting
a bound raises :class:`BudgetExceeded` naming it; the caller fails deterministically
(before-save: the record mutation; Bounded Atomic: the run, terminally, never retried).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime_svc.compiler.plan import BoundSummary

__all__ = ["BUDGET_EXCEEDED", "BudgetExceeded", "BudgetMeter"]

#: Stable safe code of a step that exceeded its compiled budget.
BUDGET_EXCEEDED = "budget_exceeded"

#: Bound name (as the plan and the error name it) -> counter attribute.
_BOUNDS = {
    "max_steps": "steps",
    "max_reads": "reads",
    "max_writes": "writes",
    "max_fanout": "fanout",
}


class BudgetExceeded(Exception):
    """A compiled bound was exhausted at runtime.

    Attributes:
        bound: the bound's plan name (``max_reads``, ``max_writes``, ``max_fanout``,
            ``max_steps``).
        limit: the compiled limit.
        attempted: the count the step tried to reach.
    """

    def __init__(self, bound: str, limit: int, attempted: int) -> None:
        super().__init__(f"the Flow exceeded its compiled {bound} budget ({attempted} > {limit})")
        self.bound = bound
        self.limit = limit
        self.attempted = attempted
        self.code = BUDGET_EXCEEDED


@dataclass
class BudgetMeter:
    """Counters of one step execution against its :class:`BoundSummary`."""

    bounds: BoundSummary
    steps: int = 0
    reads: int = 0
    writes: int = 0
    fanout: int = 0
    _limits: dict[str, int | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._limits = {name: getattr(self.bounds, name) for name in _BOUNDS}

    def limit(self, bound: str) -> int | None:
        """The compiled limit of ``bound`` (``None``: not enforced)."""
        return self._limits[bound]

    def _charge(self, bound: str, amount: int) -> None:
        attr = _BOUNDS[bound]
        value = int(getattr(self, attr)) + amount
        limit = self._limits[bound]
        if limit is not None and value > limit:
            raise BudgetExceeded(bound, limit, value)
        setattr(self, attr, value)

    def step(self) -> None:
        """One element execution."""
        self._charge("max_steps", 1)

    def read(self, records: int) -> None:
        """A query that returned ``records`` records (a miss still costs one read)."""
        self._charge("max_reads", max(records, 1))

    def write(self, records: int = 1) -> None:
        """``records`` record mutations."""
        self._charge("max_writes", records)

    def fan_out(self, items: int = 1) -> None:
        """``items`` loop-body entries, or a collection mutation of ``items`` records."""
        self._charge("max_fanout", items)

    def check_collection(self, size: int) -> None:
        """A collection processed at once must itself fit the fan-out bound."""
        limit = self._limits["max_fanout"]
        if limit is not None and size > limit:
            raise BudgetExceeded("max_fanout", limit, size)
