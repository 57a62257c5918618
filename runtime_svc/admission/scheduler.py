"""Deficit round-robin over orgs: fair as well as complete (§16.2, §22.7): pure.

:class:`~services.background.OrgRotation` makes org selection *complete* — every org with
due work is reached within ``ceil(orgs / batch)`` passes. This makes it *fair*: each time
an org is visited it earns ``quantum * weight`` admissions of credit, spends one per step
it is admitted for, and can bank at most one extra quantum. A hot tenant with ten times
the load therefore gets no more admissions per visit than its weight allows, and a cold
tenant is served at every visit — its queue age is bounded by one rotation of the orgs
with work, not by the hot tenant's backlog. An org found without due work loses its bank
(classic DRR: credit is only kept while there is a queue to spend it on).

Sparse orgs first (DRR++ / fq_codel's "new flows" list): an org whose last visit left
no due work behind — or that was never visited — is *sparse*; :meth:`order` puts the
sparse orgs of a pass ahead of the *backlogged* ones (those whose last visit left work:
more candidates than their credit, a deferral, or a lane without allowance). So a cold
tenant's new run waits behind no hot tenant's quantum, whatever the org order; the
backlogged orgs are still visited in the same pass (only the order within the pass
changes), so completeness and the per-visit quantum are unchanged, and an org cannot
stay sparse while it keeps a backlog.

The weight is the org's ``admission.org.weight`` in its runtime policy (default 1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

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
        self._backlogged: OrderedDict[str, None] = OrderedDict()

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
        """``org_id`` had no due work at its visit: its bank is dropped (and it is sparse)."""
        self._deficit.pop(org_id, None)
        self._backlogged.pop(org_id, None)

    def finished(self, org_id: str, *, backlogged: bool) -> None:
        """``org_id``'s visit ended; ``backlogged``: it left due work behind."""
        self._backlogged.pop(org_id, None)
        if backlogged:
            self._backlogged[org_id] = None
            while len(self._backlogged) > self._max:
                self._backlogged.popitem(last=False)

    def backlogged(self, org_id: str) -> bool:
        """Did ``org_id``'s last visit leave due work behind?"""
        return org_id in self._backlogged

    def order(self, orgs: Sequence[str]) -> list[str]:
        """The pass's orgs, sparse ones first; each group keeps the rotation's order."""
        sparse = [o for o in orgs if o not in self._backlogged]
        return sparse + [o for o in orgs if o in self._backlogged]
