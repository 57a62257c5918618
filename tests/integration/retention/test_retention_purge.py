"""Physical retention (§10.1 DeleteFlowInterview step 7, §22.2 "physical retention refuses
a non-terminal run or any live dependent/outbox reference"), on SQLite and MariaDB.

Runs are created and driven to terminal through ``FlowRunStateStore``; the rows the
kernel does not own yet (dependencies, wake signals, outbox, effect links, business and
audit evidence) are seeded through the schema. Every test has its own org, so per-org row
counts are exact. Time never passes for real: the retention clock is the database clock
plus an explicit offset.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Table, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import CheckpointInput, FinishRun, RunState, store_create
from runtime_svc.kernel.store_retention import (
    PurgeSkip,
    RetentionSweep,
    SkipReason,
    purge_expired_runs,
    purge_run,
    set_legal_hold,
)
from runtime_svc.schema import (
    audit_records,
    business_events,
    flow_checkpoints,
    flow_dependencies,
    flow_effect_links,
    flow_runs,
    flow_step_attempts,
    flow_step_executions,
    flow_wake_signals,
    records,
    runtime_outbox,
)
from services import db
from tests.integration.kernel.conftest import World
from tests.integration.kernel.helpers import claim, next_step, start
from tests.integration.retention.conftest import make_world

RETENTION = timedelta(days=30)
LINEAGE = (
    flow_runs,
    flow_step_executions,
    flow_step_attempts,
    flow_checkpoints,
    flow_dependencies,
    flow_wake_signals,
    flow_effect_links,
)


# --- helpers -----------------------------------------------------------------------------


async def db_time(engine: AsyncEngine) -> datetime:
    async with db.transaction(engine, readonly=True) as conn:
        return await db.db_now(conn)


async def past_retention(engine: AsyncEngine) -> datetime:
    return await db_time(engine) + RETENTION + timedelta(days=1)


async def org_count(engine: AsyncEngine, table: Table, org_id: str) -> int:
    async with db.transaction(engine, readonly=True) as conn:
        stmt = select(func.count()).select_from(table).where(table.c.org_id == org_id)
        return int((await conn.execute(stmt)).scalar_one())


async def lineage_counts(engine: AsyncEngine, org_id: str) -> dict[str, int]:
    return {t.name: await org_count(engine, t, org_id) for t in LINEAGE}


async def finish(world: World, run_id: str) -> None:
    """Two committed steps, the second finishing the run (``Succeeded``)."""
    fence = await claim(world, run_id)
    fence = await world.store.mark_running(world.org, fence)
    await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step()
    )
    fence = await claim(world, run_id)
    fence = await world.store.mark_running(world.org, fence)
    result = await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"n": 2}), advance=FinishRun()
    )
    assert result.run_state is RunState.SUCCEEDED


async def terminal_run(world: World) -> str:
    run_id = await start(world)
    await finish(world, run_id)
    return run_id


async def first_step_id(world: World, run_id: str) -> str:
    async with db.transaction(world.engine, readonly=True) as conn:
        s = flow_step_executions.c
        stmt = (
            select(s.step_execution_id)
            .where(s.org_id == world.org, s.flow_run_id == run_id)
            .order_by(s.created_at, s.step_execution_id)
        )
        return str((await conn.execute(stmt)).scalars().first())


def _scope(world: World) -> dict[str, str]:
    return {
        "org_id": world.scope.org_id,
        "app_installation_id": world.scope.app_installation_id,
        "runtime_capability_id": world.scope.runtime_capability_id,
        "runtime_work_binding_digest": world.scope.runtime_work_binding_digest,
    }


async def seed_dependency(world: World, run_id: str, *, state: str) -> str:
    """A dependency of the run's first step (with a wake signal it consumed when
    resolved)."""
    now = await db_time(world.engine)
    step_id = await first_step_id(world, run_id)
    dep_id = f"dep_{uuid.uuid4().hex[:12]}"
    digest = "sha256:" + "0" * 64
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            flow_dependencies.insert().values(
                **_scope(world),
                dependency_id=dep_id,
                flow_run_id=run_id,
                step_execution_id=step_id,
                producer_kind="effect",
                producer_key=f"key_{dep_id}",
                condition_digest=digest,
                state=state,
                active_slot=1 if state == "Pending" else None,
                state_version=1,
                deadline=now + timedelta(days=1),
                expiry_policy="TerminalFailure",
                created_at=now,
                updated_at=now,
            )
        )
        if state != "Pending":
            await conn.execute(
                flow_wake_signals.insert().values(
                    **_scope(world),
                    wake_signal_id=f"wake_{dep_id}",
                    producer_kind="effect",
                    producer_key=f"key_{dep_id}",
                    wake_token="tok",
                    evidence_digest=digest,
                    received_at=now,
                    expires_at=now + timedelta(days=1),
                    resolution_state="Consumed",
                    dependency_id=dep_id,
                    state_version=1,
                )
            )
    return dep_id


async def seed_outbox(world: World, run_id: str, *, delivery_state: str) -> str:
    """A handoff message of the run and its effect link."""
    now = await db_time(world.engine)
    step_id = await first_step_id(world, run_id)
    msg_id = f"msg_{uuid.uuid4().hex[:12]}"
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            runtime_outbox.insert().values(
                **_scope(world),
                runtime_outbox_message_id=msg_id,
                message_family="flow.effect.submit",
                effect_handoff_key=f"hk_{msg_id}",
                effect_owner_kind="integration",
                payload_schema_version=1,
                payload_digest="sha256:" + "1" * 64,
                payload="{}",
                flow_run_id=run_id,
                step_execution_id=step_id,
                submission_attempt_id="att_x",
                delivery_state=delivery_state,
                delivery_attempts=0,
                next_attempt_at=now,
                state_version=1,
                created_at=now,
                updated_at=now,
            )
        )
        await conn.execute(
            flow_effect_links.insert().values(
                **_scope(world),
                effect_link_id=f"link_{msg_id}",
                flow_run_id=run_id,
                step_execution_id=step_id,
                effect_owner_kind="integration",
                runtime_outbox_message_id=msg_id,
                effect_handoff_key=f"hk_{msg_id}",
                submission_attempt_id="att_x",
                created_at=now,
            )
        )
    return msg_id


async def set_outbox_state(world: World, msg_id: str, delivery_state: str) -> None:
    async with db.transaction(world.engine) as conn:
        o = runtime_outbox.c
        await conn.execute(
            update(runtime_outbox)
            .where(o.org_id == world.org, o.runtime_outbox_message_id == msg_id)
            .values(delivery_state=delivery_state)
        )


async def seed_evidence(world: World, run_id: str) -> None:
    """A business record, a business event and an audit record naming the run."""
    now = await db_time(world.engine)
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            records.insert().values(
                org_id=world.org,
                object_name="Account",
                record_id="acc_1",
                record_version=1,
                fields="{}",
                created_at=now,
                updated_at=now,
            )
        )
        await conn.execute(
            business_events.insert().values(
                org_id=world.org,
                event_id=f"ev_{run_id}",
                object_name="Account",
                record_id="acc_1",
                history_sequence=1,
                event_type="updated",
                payload="{}",
                flow_run_id=run_id,
                occurred_at=now,
            )
        )
        await conn.execute(
            audit_records.insert().values(
                org_id=world.org,
                audit_record_id=f"aud_{run_id}",
                actor_kind="Flow",
                actor_id="w",
                action="record.update",
                flow_run_id=run_id,
                details="{}",
                occurred_at=now,
            )
        )


# --- tests -------------------------------------------------------------------------------


async def test_terminal_run_past_retention_is_purged_with_all_its_lineage(world: World) -> None:
    run_id = await terminal_run(world)
    await seed_dependency(world, run_id, state="Resolved")
    await seed_outbox(world, run_id, delivery_state="Delivered")
    await seed_evidence(world, run_id)
    before = await lineage_counts(world.engine, world.org)
    assert before == {
        "flow_runs": 1,
        "flow_step_executions": 2,
        "flow_step_attempts": 2,
        "flow_checkpoints": 3,
        "flow_dependencies": 1,
        "flow_wake_signals": 1,
        "flow_effect_links": 1,
    }

    report = await purge_expired_runs(
        world.engine, world.org, retention=RETENTION, now=await past_retention(world.engine)
    )

    assert report.purged == (run_id,) and report.skipped == ()
    assert dict(report.rows_deleted) == before
    assert report.next_after is None
    assert await lineage_counts(world.engine, world.org) == dict.fromkeys(before, 0)
    # Business/audit evidence and the transport row stay; the purge is itself audited.
    assert await org_count(world.engine, records, world.org) == 1
    assert await org_count(world.engine, business_events, world.org) == 1
    assert await org_count(world.engine, runtime_outbox, world.org) == 1
    async with db.transaction(world.engine, readonly=True) as conn:
        a = audit_records.c
        actions = sorted(
            (await conn.execute(select(a.action).where(a.org_id == world.org))).scalars()
        )
    assert actions == ["flow_run.purged", "record.update"]
    # Idempotent: nothing left to purge.
    again = await purge_expired_runs(
        world.engine, world.org, retention=RETENTION, now=await past_retention(world.engine)
    )
    assert again.purged == () and again.skipped == ()


async def test_cancelled_and_deleted_run_is_purged_after_its_delete_window(world: World) -> None:
    run_id = await start(world)
    await world.store.delete_run(world.org, run_id)
    await world.store.complete_cancel(world.org, run_id)
    run = await world.store.get_run(world.org, run_id, include_deleted=True)
    assert run.state is RunState.CANCELLED and run.is_deleted

    inside = await purge_run(
        world.engine, world.org, run_id, retention=RETENTION, now=await db_time(world.engine)
    )
    assert inside == PurgeSkip(run_id, SkipReason.WITHIN_RETENTION)

    assert (
        await purge_run(
            world.engine,
            world.org,
            run_id,
            retention=RETENTION,
            now=await past_retention(world.engine),
        )
        is None
    )
    assert await lineage_counts(world.engine, world.org) == dict.fromkeys(
        (t.name for t in LINEAGE), 0
    )


async def test_non_terminal_run_is_refused(world: World) -> None:
    runnable = await start(world)
    running = await start(world)
    fence = await claim(world, running)
    await world.store.mark_running(world.org, fence)
    before = await lineage_counts(world.engine, world.org)
    now = await past_retention(world.engine)

    report = await purge_expired_runs(world.engine, world.org, retention=RETENTION, now=now)
    assert report.purged == ()  # never even a candidate
    for run_id in (runnable, running):
        skip = await purge_run(world.engine, world.org, run_id, retention=RETENTION, now=now)
        assert skip == PurgeSkip(run_id, SkipReason.NOT_TERMINAL)
    assert await lineage_counts(world.engine, world.org) == before


async def test_terminal_run_inside_the_window_is_kept(world: World) -> None:
    run_id = await terminal_run(world)
    before = await lineage_counts(world.engine, world.org)
    inside = await db_time(world.engine) + RETENTION - timedelta(hours=1)

    report = await purge_expired_runs(world.engine, world.org, retention=RETENTION, now=inside)
    assert report.purged == ()
    skip = await purge_run(world.engine, world.org, run_id, retention=RETENTION, now=inside)
    assert skip == PurgeSkip(run_id, SkipReason.WITHIN_RETENTION)
    # The default clock is the database's: a just-finished run is inside the window.
    assert (await purge_expired_runs(world.engine, world.org, retention=RETENTION)).purged == ()
    assert await lineage_counts(world.engine, world.org) == before


@pytest.mark.parametrize("live_state", ["Pending", "AcceptanceReconciling", "AcceptanceUnknown"])
async def test_run_with_a_live_outbox_message_is_refused_until_delivery_ends(
    world: World, live_state: str
) -> None:
    run_id = await terminal_run(world)
    msg_id = await seed_outbox(world, run_id, delivery_state=live_state)
    before = await lineage_counts(world.engine, world.org)
    now = await past_retention(world.engine)

    report = await purge_expired_runs(world.engine, world.org, retention=RETENTION, now=now)
    assert report.purged == ()
    assert report.skipped == (PurgeSkip(run_id, SkipReason.LIVE_OUTBOX),)
    assert await lineage_counts(world.engine, world.org) == before

    await set_outbox_state(world, msg_id, "DeadLettered")
    report = await purge_expired_runs(world.engine, world.org, retention=RETENTION, now=now)
    assert report.purged == (run_id,)


async def test_run_with_a_live_dependency_is_refused(world: World) -> None:
    run_id = await terminal_run(world)
    await seed_dependency(world, run_id, state="Pending")
    before = await lineage_counts(world.engine, world.org)

    report = await purge_expired_runs(
        world.engine, world.org, retention=RETENTION, now=await past_retention(world.engine)
    )
    assert report.skipped == (PurgeSkip(run_id, SkipReason.LIVE_DEPENDENCY),)
    assert await lineage_counts(world.engine, world.org) == before


async def test_legal_hold_is_refused_until_released(world: World) -> None:
    run_id = await terminal_run(world)
    await set_legal_hold(world.engine, world.org, run_id, hold=True)
    await set_legal_hold(world.engine, world.org, run_id, hold=True)  # idempotent
    version = (await world.store.get_run(world.org, run_id)).state_version
    before = await lineage_counts(world.engine, world.org)
    now = await past_retention(world.engine)

    report = await purge_expired_runs(world.engine, world.org, retention=RETENTION, now=now)
    assert report.purged == ()
    skip = await purge_run(world.engine, world.org, run_id, retention=RETENTION, now=now)
    assert skip == PurgeSkip(run_id, SkipReason.LEGAL_HOLD)
    assert await lineage_counts(world.engine, world.org) == before
    # A hold is not a lifecycle transition: it never advances the root version.
    assert (await world.store.get_run(world.org, run_id)).state_version == version

    await set_legal_hold(world.engine, world.org, run_id, hold=False)
    report = await purge_expired_runs(world.engine, world.org, retention=RETENTION, now=now)
    assert report.purged == (run_id,)


async def test_purging_one_org_never_touches_another_orgs_identical_run_ids(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = await make_world(world.engine)
    # Same run, first-step and input-checkpoint ids in both orgs.
    monkeypatch.setattr(store_create, "new_run_id", lambda: "run_shared")
    monkeypatch.setattr(store_create, "new_id", lambda prefix: f"{prefix}_shared")
    ids = [await start(w) for w in (world, other)]
    assert ids == ["run_shared", "run_shared"]
    monkeypatch.undo()
    for w in (world, other):
        await finish(w, "run_shared")
    theirs = await lineage_counts(world.engine, other.org)
    assert theirs["flow_runs"] == 1

    report = await purge_expired_runs(
        world.engine, world.org, retention=RETENTION, now=await past_retention(world.engine)
    )

    assert report.purged == ("run_shared",)
    assert (await lineage_counts(world.engine, world.org))["flow_runs"] == 0
    assert await lineage_counts(world.engine, other.org) == theirs
    assert (await other.store.get_run(other.org, "run_shared")).state is (RunState.SUCCEEDED)


async def test_batches_are_bounded_and_resume_after_refused_runs(world: World) -> None:
    held = [await terminal_run(world) for _ in range(2)]
    for run_id in held:
        await seed_outbox(world, run_id, delivery_state="Pending")
    free = [await terminal_run(world) for _ in range(3)]
    now = await past_retention(world.engine)

    purged: list[str] = []
    skipped: list[str] = []
    after: str | None = None
    for _ in itertools.count():
        report = await purge_expired_runs(
            world.engine, world.org, retention=RETENTION, now=now, limit=2, after=after
        )
        assert len(report.purged) + len(report.skipped) <= 2
        purged += report.purged
        skipped += [s.flow_run_id for s in report.skipped]
        after = report.next_after
        if after is None:
            break
    assert sorted(purged) == sorted(free)
    assert sorted(skipped) == sorted(held)


async def test_retention_sweep_lifecycle(world: World) -> None:
    run_id = await start(world)
    await world.store.request_cancel(world.org, run_id)
    await world.store.complete_cancel(world.org, run_id)

    async def orgs(after: str | None, limit: int) -> list[str]:
        return [world.org] if after is None else []

    # A tiny window: the run's completion is already older than it.
    sweep = RetentionSweep(
        world.engine, retention=timedelta(microseconds=1), orgs=orgs, interval_s=0.01
    )
    async with sweep:
        for _ in range(500):
            if await org_count(world.engine, flow_runs, world.org) == 0:
                break
            await asyncio.sleep(0.01)
    assert sweep.stopping
    await sweep.shutdown()  # idempotent
    assert await lineage_counts(world.engine, world.org) == dict.fromkeys(
        (t.name for t in LINEAGE), 0
    )


async def test_invalid_arguments_are_rejected(world: World) -> None:
    with pytest.raises(ValueError, match="retention"):
        await purge_expired_runs(world.engine, world.org, retention=timedelta(0))
    with pytest.raises(ValueError, match="limit"):
        await purge_expired_runs(world.engine, world.org, retention=RETENTION, limit=0)
