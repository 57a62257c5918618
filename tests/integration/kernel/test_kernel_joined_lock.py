"""The joined lock read of a fence's root, step and attempt (``docs/adr/0006``), on
SQLite and MariaDB: it returns the rows the three sequential ``SELECT … FOR UPDATE``
returned (and the full-width rows decode the same: the narrow projection drops only
columns no decoder reads), a missing root, step or attempt is the same stale-fence
error, and on MariaDB the one statement takes the row locks root first.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel import CheckpointInput, LeaseFence
from runtime_svc.kernel.store_codec import attempt_from_row, run_from_row, step_from_row
from runtime_svc.kernel.store_rows import (
    lock_fenced,
    lock_fenced_sequential,
    lock_run,
    lock_run_and_step,
    lock_step,
)
from runtime_svc.schema import flow_runs, flow_step_attempts, flow_step_executions
from services import db
from services.errors import FenceLostError
from tests.integration.kernel.conftest import World
from tests.integration.kernel.helpers import claim, next_step, start
from tests.support.statements import clock_reads, watched_statements


async def _running_fence(world: World) -> LeaseFence:
    run_id = await start(world)
    return await world.store.mark_running(world.org, await claim(world, run_id))


async def _full_rows(conn: AsyncConnection, org: str, fence: LeaseFence) -> tuple[object, ...]:
    """Root, step and attempt decoded from ``SELECT *`` (every column of the table)."""
    r, s, a = flow_runs.c, flow_step_executions.c, flow_step_attempts.c
    root = (
        (
            await conn.execute(
                select(flow_runs).where(r.org_id == org, r.flow_run_id == fence.flow_run_id)
            )
        )
        .mappings()
        .one()
    )
    step = (
        (
            await conn.execute(
                select(flow_step_executions).where(
                    s.org_id == org, s.step_execution_id == fence.step_execution_id
                )
            )
        )
        .mappings()
        .one()
    )
    attempt = (
        (
            await conn.execute(
                select(flow_step_attempts).where(a.org_id == org, a.attempt_id == fence.attempt_id)
            )
        )
        .mappings()
        .one()
    )
    return run_from_row(root), step_from_row(step), attempt_from_row(attempt)


async def test_the_joined_read_returns_the_rows_of_the_sequential_reads(world: World) -> None:
    fence = await _running_fence(world)
    async with db.transaction(world.engine) as conn:
        joined = await lock_fenced(conn, world.org, fence)
        sequential = await lock_fenced_sequential(conn, world.org, fence)
        full = await _full_rows(conn, world.org, fence)
    assert joined == sequential
    assert joined == full
    root, step, attempt = joined
    assert (root.flow_run_id, step.step_execution_id, attempt.attempt_id) == (
        fence.flow_run_id,
        fence.step_execution_id,
        fence.attempt_id,
    )


async def test_after_a_commit_the_joined_read_sees_the_moved_rows(world: World) -> None:
    """The rows a commit moved (step ``Succeeded``, attempt ``Committed``, root on the
    next step) come back from the joined read exactly as from the sequential reads."""
    fence = await _running_fence(world)
    await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step()
    )
    async with db.transaction(world.engine) as conn:
        joined = await lock_fenced(conn, world.org, fence)
        sequential = await lock_fenced_sequential(conn, world.org, fence)
    assert joined == sequential
    assert joined[0].state_version == fence.root_state_version + 1
    assert joined[1].state_version == fence.step_state_version + 1


def _stale(fence: LeaseFence, which: str) -> LeaseFence:
    if which == "root":
        return dataclasses.replace(fence, flow_run_id="run_missing")
    if which == "step":
        return dataclasses.replace(fence, step_execution_id="step_missing")
    if which == "attempt":
        return dataclasses.replace(fence, attempt_id="att_missing")
    return dataclasses.replace(fence, step_execution_id="step_missing", attempt_id="att_missing")


@pytest.mark.parametrize(
    ("which", "entity"),
    [
        ("root", "flow_runs"),
        ("step", "flow_step_executions"),
        ("attempt", "flow_step_attempts"),
        ("step_and_attempt", "flow_step_executions"),
    ],
)
async def test_a_missing_row_is_the_same_stale_fence_as_before(
    world: World, which: str, entity: str
) -> None:
    fence = _stale(await _running_fence(world), which)
    errors: list[FenceLostError] = []
    for lock in (lock_fenced, lock_fenced_sequential):
        async with db.transaction(world.engine) as conn:
            with pytest.raises(FenceLostError) as caught:
                await lock(conn, world.org, fence)
            errors.append(caught.value)
    joined, sequential = errors
    assert joined.attributes == sequential.attributes
    assert str(joined) == str(sequential)
    assert joined.found_version is None and joined.attributes["fence_reason"] == "missing"
    assert joined.attributes["entity"] == entity


async def test_another_orgs_rows_are_missing_to_the_joined_read(world: World) -> None:
    fence = await _running_fence(world)
    async with db.transaction(world.engine) as conn:
        with pytest.raises(FenceLostError):
            await lock_fenced(conn, "org_other", dataclasses.replace(fence, org_id="org_other"))


async def test_a_commit_whose_attempt_row_moved_to_another_step_loses_its_fence(
    world: World,
) -> None:
    """The step and attempt are looked up by their own keys (not through each other), so
    the joined read returns a mismatched pair exactly as the sequential reads did and
    the commit's revalidation refuses it — nothing is written."""
    first = await _running_fence(world)
    second = await _running_fence(world)
    crossed = dataclasses.replace(first, attempt_id=second.attempt_id)
    with pytest.raises(FenceLostError):
        await world.store.commit_step(
            world.org, crossed, output=CheckpointInput({"n": 1}), advance=next_step()
        )
    async with db.transaction(world.engine) as conn:
        _, step, attempt = await lock_fenced(conn, world.org, first)
    assert step.state_version == first.step_state_version
    assert attempt.attempt_state_version == first.attempt_state_version


async def _locked_nowait(conn: AsyncConnection, table: str, key: str, value: str) -> bool:
    """Whether ``conn`` could *not* lock the row at once (another transaction holds it)."""
    try:
        await conn.execute(
            text(f"SELECT 1 FROM {table} WHERE {key} = :v FOR UPDATE NOWAIT"), {"v": value}
        )
    except Exception:  # ER_LOCK_WAIT_TIMEOUT / ER_LOCK_NOWAIT: another holds it
        return True
    return False


async def test_the_joined_read_takes_the_root_row_lock_before_the_step(world: World) -> None:
    """Blocked on a held step row, the joined read already holds the root (root first);
    blocked on a held root, it holds neither step nor attempt (nothing before the root)."""
    if world.engine.dialect.name == "sqlite":
        pytest.skip("SQLite serialises writers with BEGIN IMMEDIATE; no row locks")
    fence = await _running_fence(world)
    cases = [
        ("flow_step_executions", "step_execution_id", fence.step_execution_id),
        ("flow_runs", "flow_run_id", fence.flow_run_id),
    ]
    for table, key, value in cases:
        async with world.engine.connect() as holder, world.engine.connect() as probe:
            await holder.execute(
                text(f"SELECT 1 FROM {table} WHERE {key} = :v FOR UPDATE"), {"v": value}
            )

            async def joined() -> None:
                async with db.transaction(world.engine) as conn:
                    await lock_fenced(conn, world.org, fence)

            reader = asyncio.create_task(joined())
            await asyncio.sleep(0.5)
            assert not reader.done()  # waiting for the holder's lock
            root_held = await _locked_nowait(probe, "flow_runs", "flow_run_id", fence.flow_run_id)
            await probe.rollback()
            step_held = await _locked_nowait(
                probe, "flow_step_executions", "step_execution_id", fence.step_execution_id
            )
            await probe.rollback()
            attempt_held = await _locked_nowait(
                probe, "flow_step_attempts", "attempt_id", fence.attempt_id
            )
            await probe.rollback()
            await holder.rollback()
            await asyncio.wait_for(reader, 10)
        assert root_held  # by the holder (second case) or by the waiting joined read
        assert step_held == (table == "flow_step_executions")
        assert not attempt_held


async def test_the_narrow_run_reads_decode_the_full_row(world: World) -> None:
    """``get_run`` and ``list_runs`` select only the decoder's columns; the record is the
    one decoded from every column of the table."""
    fence = await _running_fence(world)
    async with db.transaction(world.engine, readonly=True) as conn:
        full_root = (await _full_rows(conn, world.org, fence))[0]
    assert await world.store.get_run(world.org, fence.flow_run_id) == full_root
    page = await world.store.list_runs(world.org)
    assert full_root in page.runs


async def test_the_lock_read_carries_the_transitions_clock(world: World) -> None:
    """A heartbeat and a step commit lock first and then ask their clock: the joined
    read's clock column answers it (no clock statement of their own), and what they
    write carries that time, the test's clock offset included."""
    fence = await _running_fence(world)
    world.clock.advance(minutes=1)  # shifted: the offset still applies
    with watched_statements(world.engine) as seen:
        beat = await world.store.extend_lease(world.org, fence)
        await world.store.commit_step(
            world.org, beat, output=CheckpointInput(context={"done": True}), advance=next_step()
        )
    assert clock_reads(world.engine, seen) == []
    async with world.engine.connect() as conn:
        db_time = await db.db_now(conn)
        finished = (
            await conn.execute(
                select(flow_step_attempts.c.finished_at).where(
                    flow_step_attempts.c.org_id == world.org,
                    flow_step_attempts.c.attempt_id == fence.attempt_id,
                )
            )
        ).scalar_one()
    assert finished is not None and finished > db_time + timedelta(seconds=30)


async def test_the_claim_locks_root_and_step_with_its_clock_in_one_statement(
    world: World,
) -> None:
    run_id = await start(world)
    candidate = await world.store.candidate_for_run(world.org, run_id)
    assert candidate is not None
    async with db.transaction(world.engine) as conn:
        joined = await lock_run_and_step(conn, world.org, run_id, candidate.step_execution_id)
        assert joined == (
            await lock_run(conn, world.org, run_id),
            await lock_step(conn, world.org, candidate.step_execution_id),
        )
        assert await lock_run_and_step(conn, world.org, run_id, "step_missing") == (
            joined[0],
            None,
        )
        assert await lock_run_and_step(conn, world.org, "run_missing", "x") == (None, None)
    with watched_statements(world.engine) as seen:
        fence = await world.store.claim(world.org, candidate, lease_owner="w", running=True)
    # (the plan digest read is cached per store)
    selects = [s for s in seen if s.startswith("SELECT") and "execution_plans" not in s]
    assert isinstance(fence, LeaseFence)
    assert len(selects) == 1  # clock, root and step: one statement
    if world.engine.dialect.name != "sqlite":
        assert selects[0].startswith("SELECT STRAIGHT_JOIN")
