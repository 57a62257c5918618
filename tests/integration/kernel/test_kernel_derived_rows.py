"""The rows step continuation derives in memory instead of reading back (ADR 0002,
``runtime_svc.kernel.applied``) are the rows the database holds, on SQLite and MariaDB:
the root and next step a final commit leaves, the root, step and attempt a claim leaves,
and the root and first step a run's creation inserts (ADR 0005). A derivation that
drifted from the stored row would make the continuation's conditional UPDATEs miss and
roll whole commits back; these tests pin it field by field.
"""

from __future__ import annotations

import dataclasses

from runtime_svc.kernel import CheckpointInput, LeaseFence, StartRunRequest
from runtime_svc.kernel.policy import new_lease_token
from runtime_svc.kernel.store import EMPTY_LOCK_PLAN_DIGEST, _claimed_rows
from runtime_svc.kernel.store_rows import lock_fenced, lock_run, lock_step
from services import db
from tests.integration.kernel.conftest import World
from tests.integration.kernel.helpers import FIRST, claim, next_step, start


class _Rollback(Exception):
    """Ends a test transaction without committing it."""


async def test_a_commit_derives_the_root_and_next_step_it_stored(world: World) -> None:
    run_id = await start(world)
    fence = await world.store.mark_running(world.org, await claim(world, run_id))
    async with db.transaction(world.engine) as conn:
        result = await world.store.commit_step_txn(
            conn, world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step()
        )
        assert result.next_step_execution_id is not None
        stored_root = await lock_run(conn, world.org, run_id)
        stored_step = await lock_step(conn, world.org, result.next_step_execution_id)

    assert result.root is not None and result.next_step is not None
    assert result.root == stored_root
    assert result.next_step == stored_step


async def test_a_claim_on_held_rows_derives_the_rows_it_stored(world: World) -> None:
    run_id = await start(world)
    try:
        async with db.transaction(world.engine) as conn:
            now = await db.db_now(conn)
            root = await lock_run(conn, world.org, run_id)
            assert root is not None and root.current_step_execution_id is not None
            step = await lock_step(conn, world.org, root.current_step_execution_id)
            assert step is not None
            claimed = await world.store._claim_txn(
                conn,
                world.org,
                run_id,
                step.step_execution_id,
                now=now,
                token="t" * 43,
                lease_owner="w1",
                lock_plan_digest=world.plan_digest,
                trace_id=None,
                expected_root_version=None,
                expected_step_version=None,
                held=(root, step),
            )
            assert isinstance(claimed, tuple), claimed
            fence, transition = claimed
            assert isinstance(fence, LeaseFence) and transition is not None
            derived = _claimed_rows(world.org, root, step, transition, now)
            stored = await lock_fenced(conn, world.org, fence)
            assert derived == stored
            raise _Rollback
    except _Rollback:
        pass


async def test_a_created_run_derives_the_root_and_step_it_stored(world: World) -> None:
    """``create_run`` answers with the root and first step its INSERTs wrote (ADR 0005:
    no read-back; a created-claimed run's claim decides on exactly these rows)."""
    request = StartRunRequest(
        plan_id=world.plan_id, first_step=FIRST, input=CheckpointInput(context={"n": 0})
    )
    result = await world.store.create_run(world.scope, request)
    assert result.created and result.step is not None
    async with db.transaction(world.engine, readonly=True) as conn:
        stored_root = await lock_run(conn, world.org, result.run.flow_run_id)
        stored_step = await lock_step(conn, world.org, result.step.step_execution_id)
    assert result.run == stored_root
    assert result.step == stored_step


_PER_RUN = {
    # ids, tokens and times of one run; everything else must be equal
    "flow_run_id",
    "current_step_execution_id",
    "current_checkpoint_id",
    "step_execution_id",
    "input_checkpoint_id",
    "attempt_id",
    "lease_token_digest",
    "lease_until",
    "run_after",
    "started_at",
    "created_at",
    "updated_at",
    "trace_context",
    "trace_id",
    "recovery_backoff_floor_ms",  # jittered by step id
}


def _shape(record: object) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(record).items() if k not in _PER_RUN}  # type: ignore[call-overload]


async def test_a_created_claimed_run_stores_what_the_claims_updates_stored(world: World) -> None:
    """ADR 0005, round 7: the root and first step INSERTed already claimed and
    ``Running`` are, field by field, the rows the former path (insert, then the fused
    claim's root and step UPDATEs) stored — and the fence carries their versions."""
    request = StartRunRequest(
        plan_id=world.plan_id, first_step=FIRST, input=CheckpointInput(context={"n": 0})
    )
    async with db.transaction(world.engine) as conn:
        created = await world.store.create_run_txn(conn, world.scope, request)
        assert created.step is not None
        claimed = await world.store._claim_txn(
            conn,
            world.org,
            created.run.flow_run_id,
            created.step.step_execution_id,
            now=created.step.created_at,
            token=new_lease_token(),
            lease_owner="w1",
            lock_plan_digest=EMPTY_LOCK_PLAN_DIGEST,
            trace_id=None,
            expected_root_version=None,
            expected_step_version=None,
            held=(created.run, created.step),
            running=True,
        )
    assert isinstance(claimed, tuple), claimed
    updated_fence = claimed[0]
    inserted = await world.store.create_run_claimed(world.scope, request, lease_owner="w1")
    assert inserted.claimed is not None
    inserted_fence = inserted.claimed.fence
    async with db.transaction(world.engine, readonly=True) as conn:
        by_update = await lock_fenced(conn, world.org, updated_fence)
        by_insert = await lock_fenced(conn, world.org, inserted_fence)
    assert [_shape(r) for r in by_insert] == [_shape(r) for r in by_update]
    root, step, attempt = by_insert
    assert (root.state_version, step.state_version, attempt.attempt_state_version) == (
        inserted_fence.root_state_version,
        inserted_fence.step_state_version,
        inserted_fence.attempt_state_version,
    )
    assert root.current_step_execution_id == step.step_execution_id == attempt.step_execution_id
    assert step.lease_token_digest == attempt.lease_token_digest == inserted_fence.token_digest
    assert step.lease_until == inserted_fence.lease_until
    assert root.started_at == root.created_at == step.created_at == attempt.started_at
    # The creation answers with the rows as created before the claim, as before.
    assert inserted.run.state_version == 0 and inserted.step is not None
