"""Sparse orgs first (§16.2, §22.7; DRR++ / fq_codel "new flows"): pure, no database.

An org whose last visit left no due work behind is served ahead of the backlogged orgs
of the same pass; the pass still visits every org (only the order changes), and an org
is backlogged exactly while a visit leaves work behind (more candidates than it took, a
deferral, a lane given no allowance).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.budgets import AdmissionPolicy
from runtime_svc.admission.controller import AdmissionController
from runtime_svc.admission.scheduler import DeficitScheduler
from runtime_svc.kernel import Candidate
from services import db


def test_sparse_orgs_go_first_and_every_org_stays_in_the_pass() -> None:
    sched = DeficitScheduler(quantum=1)
    rotation = ["a-hot", "b-cold", "c-warm", "d-new"]
    assert sched.order(rotation) == rotation  # nothing known: the rotation's order
    sched.finished("a-hot", backlogged=True)
    sched.finished("c-warm", backlogged=True)
    sched.finished("b-cold", backlogged=False)
    assert sched.order(rotation) == ["b-cold", "d-new", "a-hot", "c-warm"]
    assert sched.backlogged("a-hot") and not sched.backlogged("b-cold")
    # A visit that drains a backlogged org makes it sparse again; an idle org is sparse.
    sched.finished("a-hot", backlogged=False)
    sched.idle("c-warm")
    assert sched.order(rotation) == rotation
    assert sorted(sched.order(rotation[::-1])) == sorted(rotation)


def test_the_backlog_memory_is_bounded() -> None:
    sched = DeficitScheduler(quantum=1, max_orgs=3)
    for i in range(10):
        sched.finished(f"o{i}", backlogged=True)
    assert [o for o in (f"o{i}" for i in range(10)) if sched.backlogged(o)] == ["o7", "o8", "o9"]


def _candidate(run: str) -> Candidate:
    return Candidate("hot", run, f"{run}-s", 1, 1, datetime.now(UTC), "durable_mutation")


@pytest.fixture
async def controller() -> AsyncIterator[AdmissionController]:
    # The engine is never connected: the policy comes from the source below.
    engine: AsyncEngine = db.create_engine("sqlite+aiosqlite:///:memory:")

    async def policies(org_id: str) -> AdmissionPolicy:
        return AdmissionPolicy()

    try:
        yield AdmissionController(engine, budget=4, quantum=1, policies=policies)
    finally:
        await engine.dispose()


async def test_a_visit_that_leaves_more_than_it_took_backlogs_the_org(
    controller: AdmissionController,
) -> None:
    await controller.lanes("hot", ["durable_mutation"], 20)
    controller.finished_org("hot", 1, more=True)
    await controller.lanes("cold", ["durable_mutation"], 20)
    controller.finished_org("cold", 1)
    assert controller.order(["hot", "cold"]) == ["cold", "hot"]
    # An empty visit drops the bank and the backlog.
    await controller.lanes("hot", ["durable_mutation"], 20)
    controller.finished_org("hot", 0)
    assert controller.order(["hot", "cold"]) == ["hot", "cold"]
    assert controller.scheduler.credit("hot") == 0


async def test_a_deferred_candidate_backlogs_the_org_until_a_visit_drains_it(
    controller: AdmissionController,
) -> None:
    await controller.lanes("hot", ["durable_mutation"], 20)
    first = await controller.admit("hot", _candidate("r1"))
    assert first is not None  # its quantum (1) is spent ...
    assert await controller.admit("hot", _candidate("r2")) is None  # ... so r2 is deferred
    controller.release(first, "committed")
    controller.finished_org("hot", 2)  # found no more than it took, but left one behind
    assert controller.scheduler.backlogged("hot")
    # The deferral belonged to that visit: the next one, if it drains the org, clears it.
    await controller.lanes("hot", ["durable_mutation"], 20)
    controller.finished_org("hot", 1)
    assert not controller.scheduler.backlogged("hot")
