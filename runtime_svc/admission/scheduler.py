"""Deficit round-robin over orgs: fair as well as complete (§16.2, §22.7): pure.

:class:`~services.background.OrgRotation` makes org selection *complete* — every org with
due work is reached within ``ceil(orgs / batch)`` passes. This makes it *fair*: each time
an org is visited it earns ``quantum * weight`` admissions of credit, spends one per step
it is admitted for, and can bank at most one extra quantum. A hot tenant with ten times
the load therefore gets no more admissions per visit than its weight allows, and a cold
tenant is served at every visit — its queue age is bounded by one rotation of the orgs
with work, not by the hot tenant's backlog. An org found without due work loses its bank
(classic DRR: credit is only kept while there is a queue to spend it on).

The weight is the org's ``admission.org.weight`` in its runtime policy (default 1).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["DeficitScheduler"]


class DeficitScheduler:
    """Per-org deficit counters (bounded: at most ``max_orgs`` are remembered).

    Args:
        quantum: admissions an org of weight 1 earns per visit.
        max_orgs: orgs whose deficit is remembered (least recently visited forgotten).
    """

    def __init__(self, quantum: int = 4, *, max_orgs: int = 10_000) -> None:
        if quantum < 1:
            raise ValueError("quantum must be >= 1")
        self.quantum = quantum
        self._max = max_orgs
        self._deficit: OrderedDict[str, int] = OrderedDict()

    def visit(self, org_id: str, weight: int = 1) -> int:
        """The org's credit for this visit (earned quantum plus what it banked)."""
        earned = self.quantum * max(1, weight)
        credit = min(self._deficit.pop(org_id, 0) + earned, 2 * earned)
        self._deficit[org_id] = credit
        while len(self._deficit) > self._max:
            self._deficit.popitem(last=False)
        return credit

    def credit(self, org_id: str) -> int:
        return self._deficit.get(org_id, 0)

    def charge(self, org_id: str, amount: int = 1) -> None:
        """``amount`` admissions were spent by ``org_id``."""
        if org_id in self._deficit:
            self._deficit[org_id] = max(0, self._deficit[org_id] - amount)

    def idle(self, org_id: str) -> None:
        """``org_id`` had no due work at its visit: its bank is dropped."""
        self._deficit.pop(org_id, None)
