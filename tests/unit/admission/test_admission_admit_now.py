"""``AdmissionController.admit_now`` (the pre-claimed wake's admission, ADR 0007): the
rules of ``admit`` decided in memory, refusing — with nothing counted and no deferral
recorded — wherever ``admit`` would defer or would need I/O. Pure, no database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.budgets import AdmissionPolicy, Budget
from runtime_svc.admission.controller import AdmissionController
from runtime_svc.kernel import Candidate
from services import db

_LANE = "dependency_wakeup"


def _candidate(run: str = "r1", lane: str = _LANE) -> Candidate:
    return Candidate("org", run, f"{run}-s", 1, 1, datetime.now(UTC), lane)


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    # Never connected: the policy comes from the source of each controller.
    eng = db.create_engine("sqlite+aiosqlite:///:memory:")
    try:
        yield eng
    finally:
        await eng.dispose()


def _controller(
    engine: AsyncEngine,
    policy: AdmissionPolicy | None = None,
    *,
    budget: int = 4,
    clock: Callable[[], float] | None = None,
) -> AdmissionController:
    async def policies(org_id: str) -> AdmissionPolicy:
        return policy or AdmissionPolicy()

    if clock is None:
        return AdmissionController(engine, budget=budget, quantum=2, policies=policies)
    return AdmissionController(engine, budget=budget, quantum=2, policies=policies, clock=clock)


async def test_a_warm_org_is_admitted_counted_and_released(engine: AsyncEngine) -> None:
    ctl = _controller(engine)
    await ctl.lanes("org", [_LANE], 4)  # a visit: the policy is cached, credit earned
    ticket = ctl.admit_now("org", _candidate())
    assert ticket is not None and ticket.lane == _LANE
    assert ctl.inflight() == 1 and ctl.inflight(f"lane:{_LANE}") == 1
    ctl.release(ticket, "committed")
    assert ctl.inflight() == 0


async def test_no_cached_policy_refuses_without_counting(engine: AsyncEngine) -> None:
    ctl = _controller(engine)
    assert ctl.admit_now("org", _candidate()) is None
    assert ctl.inflight() == 0 and sum(ctl.decisions.values()) == 0


async def test_an_expired_cached_policy_refuses(engine: AsyncEngine) -> None:
    now = [0.0]
    ctl = _controller(engine, clock=lambda: now[0])
    await ctl.lanes("org", [_LANE], 4)
    now[0] = 60.0  # past the policy's TTL: admit would read it again
    assert ctl.admit_now("org", _candidate()) is None


async def test_the_environment_budget_and_the_credit_refuse(engine: AsyncEngine) -> None:
    ctl = _controller(engine, budget=1)
    await ctl.lanes("org", [_LANE], 4)
    first = ctl.admit_now("org", _candidate("r1"))
    assert first is not None
    assert ctl.admit_now("org", _candidate("r2")) is None  # the budget is full
    ctl.release(first, "committed")
    ctl = _controller(engine)
    await ctl.lanes("org", [_LANE], 4)  # credit 2 (quantum)
    assert ctl.admit_now("org", _candidate("r1")) is not None
    assert ctl.admit_now("org", _candidate("r2")) is not None
    assert ctl.admit_now("org", _candidate("r3")) is None  # no credit left


async def test_a_scope_budget_and_record_limits_refuse(engine: AsyncEngine) -> None:
    ctl = _controller(engine, AdmissionPolicy(lanes={_LANE: Budget(max_inflight=1)}))
    await ctl.lanes("org", [_LANE], 4)
    assert ctl.admit_now("org", _candidate("r1")) is not None
    assert ctl.admit_now("org", _candidate("r2")) is None  # the lane's budget is full
    ctl = _controller(engine, AdmissionPolicy(records={"Case": 1}))
    await ctl.lanes("org", [_LANE], 4)
    assert ctl.admit_now("org", _candidate()) is None  # a record slot needs I/O
