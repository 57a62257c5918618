"""``LocalWakeSeats`` (the pre-claimed wake's reservations, ADR 0007): in memory; a
reservation only for a lane a worker serves, with room, a cached plan and a clear binary
verdict, while the group runs; every reservation is settled once (delivered or given
back, its admission ticket released)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from runtime_svc.admission.events import Ticket
from runtime_svc.kernel import Candidate
from runtime_svc.worker.background import LocalWakeSeats


@dataclass
class _Worker:
    lanes: tuple[str, ...] = ("dependency_wakeup",)
    plans: dict[tuple[str, str], object] = field(default_factory=dict)

    def serves(self, lane: str) -> bool:
        return lane in self.lanes

    def preclaim_plan(self, org_id: str, plan_id: str) -> object | None:
        return self.plans.get((org_id, plan_id))


@dataclass
class _Admission:
    admit: bool = True
    released: list[tuple[Ticket, str]] = field(default_factory=list)

    def admit_now(self, org_id: str, candidate: Candidate, plan: Any = None) -> Ticket | None:
        return Ticket(org_id, candidate.queue_class, ("env",)) if self.admit else None

    def release(self, ticket: Ticket, outcome: str) -> None:
        self.released.append((ticket, outcome))


def _candidate(lane: str = "dependency_wakeup") -> Candidate:
    return Candidate("org", "run", "step", 1, 1, datetime.now(UTC), lane, plan_id="plan")


def _worker() -> _Worker:
    return _Worker(plans={("org", "plan"): object()})


def test_a_reservation_needs_a_serving_worker_with_the_plan() -> None:
    assert LocalWakeSeats([]).reserve("org", _candidate()) is None  # type: ignore[arg-type]
    mutations = _Worker(lanes=("durable_mutation",), plans={("org", "plan"): object()})
    assert LocalWakeSeats([mutations]).reserve("org", _candidate()) is None  # type: ignore[list-item]
    assert LocalWakeSeats([_Worker()]).reserve("org", _candidate()) is None  # type: ignore[list-item]
    assert LocalWakeSeats([_worker()]).reserve("org", _candidate()) is not None  # type: ignore[list-item]


def test_room_is_the_worker_count_and_a_stopping_group_refuses() -> None:
    stopping = [False]
    seats = LocalWakeSeats([_worker()], stopping=lambda: stopping[0])  # type: ignore[list-item]
    first = seats.reserve("org", _candidate())
    assert first is not None and seats.reserve("org", _candidate()) is None  # no room
    first.cancel()
    first.cancel()  # settled once
    assert seats.outstanding() == 0
    stopping[0] = True
    assert seats.reserve("org", _candidate()) is None


def test_admission_refuses_or_its_ticket_follows_the_reservation() -> None:
    refusing = _Admission(admit=False)
    seats = LocalWakeSeats([_worker()], admission=refusing)  # type: ignore[arg-type,list-item]
    assert seats.reserve("org", _candidate()) is None and seats.outstanding() == 0
    admission = _Admission()
    seats = LocalWakeSeats([_worker()], admission=admission)  # type: ignore[arg-type,list-item]
    given_back = seats.reserve("org", _candidate())
    assert given_back is not None
    given_back.cancel()  # nothing claimed or committed: the ticket is released at once
    assert [outcome for _, outcome in admission.released] == ["not_eligible"]
    kept = seats.reserve("org", _candidate())
    assert kept is not None
    wake: Any = object()
    kept.deliver(wake)
    kept.cancel()  # already settled: no effect
    assert len(admission.released) == 1  # the worker releases it when the chain ends
    taken = seats.take()
    assert taken is not None and taken[0] is wake and taken[1] is kept.ticket
    assert seats.take() is None and seats.outstanding() == 0
