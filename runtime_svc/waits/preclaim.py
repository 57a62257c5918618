"""The pre-claimed wake (``docs/adr/0007-pre-claimed-wake.md``): a resolution that makes
a run runnable claims the resumed step, in its own transaction, for a worker of this
process that has room — instead of publishing a wakeup hint that worker then claims in a
transaction of its own.

The waits side only asks and hands over; the decisions stay the kernel's
(:meth:`~runtime_svc.kernel.store.FlowRunStateStore.claim_woken_txn`) and room and
admission the worker side's (:class:`WakeSeats`, ``runtime_svc.worker.background``):

1. inside the resolution's transaction, after its writes and still holding root and
   step, :meth:`PreClaims.claim_txn` asks the seats for a reservation for the resumed
   step's lane (synchronous and in memory: a local worker serving it with room and, with
   admission configured, an admission ticket — decided *before* anything is written);
   with one, the kernel claims the step ``Running`` for the seat's lease owner;
2. a transaction attempt that is retried, rolls back or loses its fence gives every
   reservation back (:meth:`PreClaims.rolled_back`);
3. after ``COMMIT`` the fence is delivered to the seat (:meth:`PreClaims.deliver`): a
   worker executes the step through its ordinary path. A delivery that never runs (the
   process stops or dies) leaves the step ``Running`` under a lease nobody renews:
   lease expiry recovers it (§12.4).

No seats (an API-only process, 0 workers): nothing is ever pre-claimed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.decisions import NotEligible
from runtime_svc.kernel.model import LeaseFence, RunRecord, StepRecord
from runtime_svc.kernel.store import FlowRunStateStore
from runtime_svc.kernel.store_reads import Candidate
from runtime_svc.kernel.store_rows import execute_deferred
from runtime_svc.kernel.store_waits import resumed_candidate
from services.db_batch import Write
from services.telemetry import trace_id_of

__all__ = ["PreClaimedWake", "PreClaimer", "PreClaims", "WakeSeat", "WakeSeats"]


@dataclass(frozen=True)
class PreClaimedWake:
    """A woken step claimed ``Running`` by its resolution's transaction (committed):
    what the worker needs to execute it through its ordinary path."""

    org_id: str
    fence: LeaseFence
    #: The resumed step (lane, kind, profile, trace context) for the attempt's watch.
    candidate: Candidate
    plan_step_key: str


class WakeSeat(Protocol):
    """One reserved place for a pre-claimed step at a local worker."""

    @property
    def lease_owner(self) -> str:
        """The lease owner the claim is written for."""
        ...

    def deliver(self, wake: PreClaimedWake) -> None:
        """The claim committed: hand it to the worker (never blocks)."""
        ...

    def cancel(self) -> None:
        """Nothing was claimed (or it did not commit): give the reservation back."""
        ...


class WakeSeats(Protocol):
    """This process's workers as takers of pre-claimed wakes."""

    def reserve(self, org_id: str, candidate: Candidate) -> WakeSeat | None:
        """A reservation for ``candidate`` — a local worker serves its lane, has room,
        and admission admits it — or ``None``. Synchronous and in memory: it is asked
        inside the resolution's transaction."""
        ...


class PreClaims:
    """The pre-claims of one resolution transaction (the kernel's ``WokenClaim`` hook):
    at most one reservation per transaction attempt is held until :meth:`deliver` or
    :meth:`rolled_back`."""

    def __init__(self, store: FlowRunStateStore, seats: WakeSeats) -> None:
        self._store = store
        self._seats = seats
        self._held: tuple[WakeSeat, PreClaimedWake] | None = None

    async def claim_txn(
        self,
        conn: AsyncConnection,
        root: RunRecord,
        step: StepRecord,
        now: datetime,
        *,
        first: Sequence[Write] = (),
        last: Write | None = None,
    ) -> LeaseFence | None:
        """Reserve a seat, then claim ``step`` for it (see the module docstring);
        ``first`` and ``last`` as
        :meth:`~runtime_svc.kernel.store_waits.WokenClaim.claim_txn`'s."""
        self.rolled_back()
        # The candidate as it stands after the resolution's writes (its versions are the
        # resolved rows'): the admission subject, and the worker's watch.
        candidate = resumed_candidate(root, step, now)
        candidate = replace(
            candidate,
            root_state_version=root.state_version,
            step_state_version=step.state_version,
        )
        seat = self._seats.reserve(root.org_id, candidate)
        if seat is None:
            await execute_deferred(conn, first, last)
            return None
        try:
            claimed = await self._store.claim_woken_txn(
                conn,
                root.org_id,
                root,
                step,
                now,
                lease_owner=seat.lease_owner,
                trace_id=trace_id_of(root.trace_context),
                first=first,
                last=last,
            )
        except BaseException:
            seat.cancel()
            raise
        if isinstance(claimed, NotEligible):
            seat.cancel()
            return None
        self._held = (seat, PreClaimedWake(root.org_id, claimed, candidate, step.plan_step_key))
        return claimed

    def rolled_back(self) -> None:
        """Give back the reservation of an attempt that did not commit (idempotent)."""
        held, self._held = self._held, None
        if held is not None:
            held[0].cancel()

    def deliver(self, fence: LeaseFence | None) -> bool:
        """The transaction committed with ``fence`` pre-claimed (``None``: it claimed
        nothing): hand it to its seat; any other reservation is given back."""
        held, self._held = self._held, None
        if held is None:
            return False
        seat, wake = held
        if fence is None or wake.fence.attempt_id != fence.attempt_id:
            seat.cancel()
            return False
        seat.deliver(wake)
        return True


class PreClaimer:
    """This process's pre-claimed wake: the kernel store that claims and the seats that
    take the claims. One :class:`PreClaims` per resolution transaction."""

    def __init__(self, store: FlowRunStateStore, seats: WakeSeats) -> None:
        self.store = store
        self.seats = seats

    def begin(self) -> PreClaims:
        return PreClaims(self.store, self.seats)
