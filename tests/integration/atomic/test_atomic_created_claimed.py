"""A Bounded Atomic run created already claimed and Running for its runner
(``docs/adr/0005-bounded-atomic-created-claimed.md``), on SQLite and MariaDB:

* the run costs two write transactions — create+claim, then the business transaction —
  with no candidate read, claim transaction or preparation read in between;
* the creating transaction leaves the step durably Running under a lease and a started
  attempt, so a runner that dies before its business transaction strands nothing: no
  other runner can take the step while the lease holds, lease expiry recovers it like any
  claimed step, the dead runner's fence is refused afterwards, and the run's business
  writes happen exactly once;
* an idempotent replay of the creating request claims nothing and answers the same run.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.durable_bench import _count
from runtime_svc.kernel import (
    CheckpointInput,
    FlowRunStateStore,
    RunState,
    StartRunRequest,
)
from runtime_svc.runs.resolve import first_step_of
from runtime_svc.worker import Outcome
from services import db
from services.db import strategy_for
from services.errors import FenceLostError
from tests.integration.atomic.support import (
    ATOMIC_POLICY,
    AtomicSeeded,
    Business,
    business_rows,
    evidence,
    make_runner,
    seed_atomic,
    seed_business,
)
from tests.integration.kernel.conftest import ShiftedClock
from tests.support.databases import status_counters


@pytest.fixture
def clock() -> ShiftedClock:
    return ShiftedClock()


@pytest.fixture
def shifted_store(engine: AsyncEngine, clock: ShiftedClock) -> FlowRunStateStore:
    return FlowRunStateStore(engine, policy=ATOMIC_POLICY, clock=clock)


def _request(seeded: AtomicSeeded, biz: Business, *, key: str | None = None) -> StartRunRequest:
    first = first_step_of(seeded.plan, seeded.plan.profile.value)
    variables: dict[str, Any] = {"oppId": biz.opp_id, "lineId": biz.line_id, "label": "won"}
    return StartRunRequest(
        plan_id=seeded.plan_id,
        first_step=first,
        input=CheckpointInput(
            context={"variables": variables}, plan_cursor={"step": first.plan_step_key}
        ),
        idempotency_key=key,
    )


async def test_a_run_created_claimed_commits_in_two_write_transactions(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    runner = make_runner(engine, store)
    # A first run loads the immutable plan into the runner's cache (one read, once).
    _, warm = await runner.start(seeded.scope, _request(seeded, biz), 20.0)
    assert warm.state is RunState.SUCCEEDED
    counters = _count(engine)

    created, run = await runner.start(seeded.scope, _request(seeded, biz), 20.0)

    # create+claim, then the business transaction: nothing else, not even a read.
    assert counters.snapshot()[:2] == (2, 2)
    # Where statements share a round trip, both transactions' last writes carry their
    # COMMIT: the creating transaction's inserts (ADR 0013) and the business
    # transaction's writes, its fenced UPDATEs guarded on the server first (ADR 0014).
    batched = strategy_for(engine.dialect).multi_statements
    assert counters.commits == (0 if batched else 2)
    assert created.created and created.claimed is not None
    assert created.claimed.fence.attempt_number == 1
    assert run.state is RunState.SUCCEEDED
    assert runner.outcomes == [Outcome.COMMITTED, Outcome.COMMITTED]
    assert run == await store.get_run(seeded.org, run.flow_run_id)
    ev = await evidence(engine, seeded.org, run.flow_run_id)
    [step] = ev.step_rows
    assert step["state"] == "Succeeded" and step["attempt_count"] == 1
    [attempt] = ev.attempts
    assert attempt["attempt_id"] == created.claimed.fence.attempt_id
    assert attempt["transaction_outcome"] == "Committed"
    # The input checkpoint the creating transaction wrote is the run's first (sequence
    # 1, written without reading the run's last sequence), the final one the second.
    assert [c["sequence"] for c in ev.checkpoints] == [1, 2]
    assert len((await business_rows(engine, seeded.org))["Task"]) == 2  # one per run


async def test_a_run_created_claimed_whose_runner_died_is_recovered_by_lease_expiry(
    engine: AsyncEngine, shifted_store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    store = shifted_store
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    # The creating transaction commits; its runner then dies before the business
    # transaction (nothing executes the step) — the window of after_create_claimed.
    created = await store.create_run_claimed(
        seeded.scope, _request(seeded, biz), lease_owner="atomic-dead"
    )
    assert created.claimed is not None
    dead = created.claimed.fence
    run_id = created.run.flow_run_id
    ev = await evidence(engine, seeded.org, run_id)
    [step] = ev.step_rows
    # Durable before any business work: Running, leased, one started attempt.
    assert step["state"] == "Running" and step["lease_token"] is not None
    assert step["lease_owner"] == "atomic-dead" and step["attempt_count"] == 1
    [attempt] = ev.attempts
    assert attempt["attempt_id"] == dead.attempt_id
    assert (await store.get_run(seeded.org, run_id)).state is RunState.RUNNING

    # While the lease holds, no other runner may take the step.
    other = make_runner(engine, store)
    held = await other.run(seeded.org, run_id, 0.2)
    assert held.state is RunState.RUNNING and other.outcomes == []
    assert await store.recover_expired(seeded.org) == []

    # Lease expiry hands it on like any claimed step ...
    clock.advance(milliseconds=ATOMIC_POLICY.lease_duration_ms + 1_000)
    assert len(await store.recover_expired(seeded.org)) == 1
    # ... the dead runner's fence is refused from now on ...
    with pytest.raises(FenceLostError):
        await store.extend_lease(seeded.org, dead)
    # ... and a live runner finishes the run, its business writes exactly once.
    done = await other.run(seeded.org, run_id, 20.0)
    assert done.state is RunState.SUCCEEDED
    assert other.outcomes == [Outcome.COMMITTED]
    rows = await business_rows(engine, seeded.org)
    assert len(rows["Task"]) == 1
    assert rows["OpportunityLineItem"][0]["fields"]["Quantity"] == 2
    ev = await evidence(engine, seeded.org, run_id)
    [step] = ev.step_rows
    assert step["state"] == "Succeeded" and step["attempt_count"] == 2
    committed = [a for a in ev.attempts if a["transaction_outcome"] == "Committed"]
    assert [a["attempt_number"] for a in committed] == [2]
    assert ev.audit_count == 3


async def test_an_idempotent_replay_claims_nothing_and_answers_the_same_run(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    runner = make_runner(engine, store)
    first, run = await runner.start(seeded.scope, _request(seeded, biz, key="k1"), 20.0)
    assert first.claimed is not None and run.state is RunState.SUCCEEDED

    again, replayed = await runner.start(seeded.scope, _request(seeded, biz, key="k1"), 20.0)

    assert not again.created and again.claimed is None
    assert replayed.flow_run_id == run.flow_run_id and replayed.state is RunState.SUCCEEDED
    assert runner.outcomes == [Outcome.COMMITTED]  # nothing executed a second time
    assert len((await business_rows(engine, seeded.org))["Task"]) == 1


async def _temporary_tables(engine: AsyncEngine) -> tuple[int, int]:
    """The server's (in-memory + on-disk, on-disk) temporary tables created so far."""
    async with db.transaction(engine, readonly=True) as conn:
        status = await status_counters(conn, "GLOBAL")
    return status["Created_tmp_tables"], status["Created_tmp_disk_tables"]


async def test_a_runs_multi_table_updates_keep_their_temporary_tables_in_memory(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    # MariaDB's multi-table UPDATE keeps the row ids (and new values) of each table it
    # does not update on the fly in a temporary table, on disk when a key passes 512
    # bytes or a value is text (ADR 0015): the ids are ASCII columns and a table setting
    # a text column (the attempt's metrics summary) is the one named first.
    if not strategy_for(engine.dialect).multi_table_update:
        pytest.skip("no multi-table UPDATE on this backend")
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    runner = make_runner(engine, store)
    _, warm = await runner.start(seeded.scope, _request(seeded, biz), 20.0)
    assert warm.state is RunState.SUCCEEDED
    tables, on_disk = await _temporary_tables(engine)

    # Two record updates (record + history row) and the final fence (root, step and
    # attempt): three multi-table UPDATEs, three temporary tables at least.
    _, run = await runner.start(seeded.scope, _request(seeded, biz), 20.0)

    assert run.state is RunState.SUCCEEDED
    tables_after, on_disk_after = await _temporary_tables(engine)
    assert tables_after - tables >= 3
    assert on_disk_after == on_disk
