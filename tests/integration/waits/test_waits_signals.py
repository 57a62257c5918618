"""External-signal waits and the §14.2 resolution protocol on SQLite and MariaDB
(§22.4: notification before dependency commit, periodic reconciliation, duplicate and
stale notifications, deadline racing notification, work-scope isolation)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState
from runtime_svc.kernel.decisions import NoChange, NotEligible
from runtime_svc.kernel.store_waits import insert_dependency_txn
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import (
    DependencyState,
    ExpiryPolicyCode,
    NewDependency,
    SignalState,
)
from runtime_svc.schema import flow_dependencies, flow_step_attempts, flow_wake_signals
from services import db
from services.errors import ConflictError, FailedPreconditionError, NotFoundError
from tests.integration.waits.support import (
    WAIT_POLICY,
    World,
    approval,
    events_of,
    new_scope,
    signal_flow,
    signals,
    task_subjects,
    work_scope,
)


async def _waiting(world: World, key: str = "r1", version: int = 1, **flow: object) -> str:
    source = signal_flow(**flow)  # type: ignore[arg-type]
    source["version"] = version  # one org, two installations: two Flow versions
    await world.seed(source)
    run = await world.start("wait_signal", key=key)
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING
    return run.flow_run_id


async def test_signal_wakes_a_waiting_run_exactly_once(world: World) -> None:
    run_id = await _waiting(world)
    outcome = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    assert not outcome.duplicate and not outcome.stale
    # The producer-side match ran after the commit: consumed, run runnable.
    assert outcome.signal.state is SignalState.CONSUMED
    dep = await world.dependency(run_id)
    assert dep.state is DependencyState.RESOLVED
    assert outcome.signal.dependency_id == dep.dependency_id
    assert dep.wake_signal_id == outcome.signal.wake_signal_id and dep.wake_token == "t1"
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
    assert await events_of(world.engine, world.org, run_id) == 1


async def test_notification_arriving_before_the_dependency_commit_is_matched_by_the_wait(
    world: World,
) -> None:
    await world.seed(signal_flow())
    outcome = await world.rt.signals.submit(world.work, approval("r1", "early"))
    assert outcome.signal.state is SignalState.UNMATCHED  # no dependency exists yet
    run = await world.start("wait_signal", key="r1")
    # The wait commits its dependency; the fresh reconciliation right after sees the
    # committed signal and resolves.
    await world.drive(run.flow_run_id)
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.RESOLVED
    [signal] = await signals(world.engine, world.org)
    assert signal.state is SignalState.CONSUMED
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED


async def test_duplicate_notification_answers_the_same_receipt_and_wakes_once(
    world: World,
) -> None:
    run_id = await _waiting(world)
    first = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    again = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    assert again.duplicate and not again.stale
    assert again.signal.wake_signal_id == first.signal.wake_signal_id
    assert len(await signals(world.engine, world.org)) == 1
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]


async def test_a_token_reused_with_another_body_is_refused_and_writes_nothing(
    world: World,
) -> None:
    await world.rt.signals.submit(world.work, approval("r9", "t1", status="rejected"))
    with pytest.raises(FailedPreconditionError) as err:
        await world.rt.signals.submit(world.work, approval("r9", "t1", status="approved"))
    assert err.value.reason == "wake_token_reused"
    assert len(await signals(world.engine, world.org)) == 1


async def test_stale_wake_version_after_a_newer_one_is_a_no_op(world: World) -> None:
    newer = await world.rt.signals.submit(world.work, approval("r2", "v2", version=2))
    stale = await world.rt.signals.submit(world.work, approval("r2", "v1", version=1))
    assert stale.stale and not stale.duplicate
    assert stale.signal.wake_signal_id == newer.signal.wake_signal_id
    assert [s.wake_token for s in await signals(world.engine, world.org)] == ["v2"]
    # Equal version, another token: also stale.
    assert (await world.rt.signals.submit(world.work, approval("r2", "v2b", version=2))).stale
    # A newer one is accepted.
    assert not (await world.rt.signals.submit(world.work, approval("r2", "v3", version=3))).stale


async def test_a_retried_versioned_signal_is_a_duplicate_even_after_a_newer_one(
    world: World,
) -> None:
    """The acceptance's one read (token row first, else the newest version) answers a
    retry of an older token with its own receipt — a duplicate, not stale."""
    first = await world.rt.signals.submit(world.work, approval("r3", "a", version=1))
    await world.rt.signals.submit(world.work, approval("r3", "b", version=2))
    again = await world.rt.signals.submit(world.work, approval("r3", "a", version=1))
    assert again.duplicate and not again.stale
    assert again.signal.wake_signal_id == first.signal.wake_signal_id
    assert sorted(s.wake_token for s in await signals(world.engine, world.org)) == ["a", "b"]


async def test_a_signal_whose_condition_does_not_hold_leaves_the_run_waiting(
    world: World,
) -> None:
    run_id = await _waiting(world)
    rejected = await world.rt.signals.submit(world.work, approval("r1", "t1", status="held"))
    assert rejected.signal.state is SignalState.UNMATCHED
    assert (await world.run(run_id)).state is RunState.WAITING
    approved = await world.rt.signals.submit(world.work, approval("r1", "t2"))
    assert approved.signal.state is SignalState.CONSUMED
    assert (await world.dependency(run_id)).wake_token == "t2"


async def test_periodic_reconciler_matches_a_signal_whose_producer_crashed_before_matching(
    world: World,
) -> None:
    run_id = await _waiting(world)
    # The dependency's own probes are long over (a wait of days)...
    async with db.transaction(world.engine) as conn:
        d = flow_dependencies.c
        await conn.execute(
            update(flow_dependencies)
            .where(d.org_id == world.org, d.flow_run_id == run_id)
            .values(next_probe_at=None, reconciliation_attempts=12)
        )
    # ... and the producer committed its signal but died before its match (the same rows
    # ``SubmitWakeSignal`` commits before ``after_signal_commit``).
    from runtime_svc.kernel.store_waits import insert_signal_txn
    from runtime_svc.waits.evidence import validate_submission

    new = validate_submission(approval("r1", "lost"), world.rt.registry)
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        assert await insert_signal_txn(
            conn, world.work, new, now, expires_at=now + timedelta(days=31), match_at=now
        )
    assert (await world.run(run_id)).state is RunState.WAITING
    world.clock.advance(seconds=3)
    stats = await world.sweep()
    assert stats.signals_matched == 1
    assert (await world.dependency(run_id)).state is DependencyState.RESOLVED
    [signal] = await signals(world.engine, world.org)
    assert signal.state is SignalState.CONSUMED and signal.next_match_at is None


async def test_periodic_reconciler_matches_an_old_unmatched_signal_from_the_dependency_side(
    world: World,
) -> None:
    # The signal arrived long ago, its producer-side match found no dependency and was
    # settled; then the wait committed and its process died before the fresh
    # reconciliation: only the dependency's probe can still see the signal.
    await world.seed(signal_flow())
    await world.rt.signals.submit(world.work, approval("r5", "old"))
    world.clock.advance(days=2)
    run = await world.start("wait_signal", key="r5")
    steps = world.rt.steps
    reconcile = steps.after_commit

    async def crashed(_wait: object) -> None:
        return None  # the process "died": no fresh reconciliation

    steps.after_commit = crashed  # type: ignore[method-assign]
    try:
        await world.drive(run.flow_run_id)
    finally:
        steps.after_commit = reconcile  # type: ignore[method-assign]
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.PENDING
    world.clock.advance(minutes=1)
    stats = await world.sweep()
    assert stats.probes == 1 and stats.resolved == 1
    assert (await world.dependency(run.flow_run_id)).wake_token == "old"


async def test_deadline_and_notification_racing_from_two_connections_exactly_one_wins(
    world: World,
) -> None:
    await world.seed(signal_flow(deadline="PT1H"))
    runs = []
    for i in range(6):
        run = await world.start("wait_signal", key=f"race{i}")
        await world.drive(run.flow_run_id)
        runs.append(run.flow_run_id)
    world.clock.advance(hours=2)  # every deadline has passed
    # Insert the signals without their producer-side match, then race the expiry
    # transition against the resolution on separate connections.
    from runtime_svc.kernel.store_waits import insert_signal_txn
    from runtime_svc.waits.evidence import validate_submission

    for i in range(6):
        new = validate_submission(approval(f"race{i}", "t"), world.rt.registry)
        async with db.transaction(world.engine) as conn:
            now = await world.clock(conn)
            await insert_signal_txn(
                conn, world.work, new, now, expires_at=now + timedelta(days=1), match_at=None
            )
    for run_id in runs:
        dep = await world.dependency(run_id)
        resolve, expire = await asyncio.gather(
            world.rt.matcher.match_dependency(dep),
            world.rt.matcher.waits.expire(world.org, dep.dependency_id),
        )
        winners = [r for r in (resolve, expire) if isinstance(r, WaitTransition)]
        assert len(winners) == 1, (resolve, expire)
        loser = resolve if isinstance(expire, WaitTransition) else expire
        assert isinstance(loser, NoChange)  # the loser re-read the terminal fact
        final = await world.dependency(run_id)
        root = await world.run(run_id)
        if winners[0].outcome == "resolved":
            assert final.state is DependencyState.RESOLVED and root.state is RunState.RUNNABLE
        else:
            assert final.state is DependencyState.EXPIRED
            assert root.state is RunState.TERMINAL_FAILED
    consumed = [s for s in await signals(world.engine, world.org) if s.dependency_id]
    resolved = [r for r in runs if (await world.dependency(r)).state is DependencyState.RESOLVED]
    assert len(consumed) == len(resolved)


async def test_identical_kind_key_token_in_two_installations_and_two_orgs_never_cross(
    world: World,
) -> None:
    same_org = world.other(new_scope(world.org, installation="inst-crm-2"))
    other_org = world.other(new_scope())
    run_a = await _waiting(world, "shared")
    run_b = await _waiting(same_org, "shared", version=2)
    run_c = await _waiting(other_org, "shared")

    # Same kind/key/token in scope A: it cannot dedupe against, match, or consume B's.
    a = await world.rt.signals.submit(world.work, approval("shared", "tok"))
    assert a.signal.state is SignalState.CONSUMED
    assert (await world.dependency(run_a)).state is DependencyState.RESOLVED
    assert (await same_org.dependency(run_b)).state is DependencyState.PENDING
    assert (await other_org.dependency(run_c)).state is DependencyState.PENDING
    # The same token in B is not a duplicate of A's: its own signal, its own wake.
    b = await same_org.rt.signals.submit(same_org.work, approval("shared", "tok"))
    assert not b.duplicate and b.signal.wake_signal_id != a.signal.wake_signal_id
    assert (await same_org.dependency(run_b)).wake_signal_id == b.signal.wake_signal_id
    # No disclosure: B and the other org cannot read A's signal by id or natural key.
    for other in (same_org, other_org):
        with pytest.raises(NotFoundError):
            await other.rt.signals.get(other.work, wake_signal_id=a.signal.wake_signal_id)
    with pytest.raises(NotFoundError):
        await other_org.rt.signals.get(
            other_org.work, natural_key=("external.signal", "approval:shared", "tok")
        )
    assert (await other_org.dependency(run_c)).state is DependencyState.PENDING


async def test_a_step_has_at_most_one_active_dependency_per_work_scope(world: World) -> None:
    run_id = await _waiting(world)
    dep = await world.dependency(run_id)
    second = NewDependency(
        dependency_id="dep_second",
        flow_run_id=run_id,
        step_execution_id=dep.step_execution_id,
        producer_kind="external.signal",
        producer_key="approval:r1",
        condition_digest=dep.condition_digest,
        deadline=dep.deadline,
        next_probe_at=None,
        expiry_policy=ExpiryPolicyCode.QUARANTINE,
    )
    with pytest.raises(ConflictError):
        async with db.transaction(world.engine) as conn:
            await insert_dependency_txn(conn, world.work, second, await world.clock(conn))
    assert len([await world.dependency(run_id)]) == 1


async def test_signals_past_their_retention_expire_and_are_purged(world: World) -> None:
    await world.rt.signals.submit(world.work, approval("gone", "t"))
    world.clock.advance(days=32)
    stats = await world.sweep()
    assert stats.signals_expired == 1
    [signal] = await signals(world.engine, world.org)
    assert signal.state is SignalState.EXPIRED
    world.clock.advance(days=8)
    stats = await world.sweep()
    assert stats.purged == 1
    assert await signals(world.engine, world.org) == []


async def test_the_sweep_discovers_an_org_whose_only_work_is_signal_retention(
    world: World,
) -> None:
    # No waiting run, no owed match: only an unmatched signal past its retention bound.
    from runtime_svc.kernel.store_waits import insert_signal_txn
    from runtime_svc.waits.evidence import validate_submission
    from runtime_svc.waits.reconciler import orgs_with_waits

    new = validate_submission(approval("old", "t"), world.rt.registry)
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        await insert_signal_txn(
            conn,
            world.work,
            new,
            now - timedelta(days=40),
            expires_at=now - timedelta(days=1),
            match_at=None,
        )
    assert world.org in await orgs_with_waits(world.engine, after=world.org[:-1], limit=1000)
    stats = await world.sweeper.sweep_once(org_limit=1000)
    assert stats.signals_expired >= 1
    [signal] = await signals(world.engine, world.org)
    assert signal.state is SignalState.EXPIRED


async def test_the_wait_sweeps_serve_every_org_in_rotation(world: World) -> None:
    """Issue 10 item 1: the wait sweeps discover orgs through the shared
    ``services.background.OrgRotation`` — with 500 orgs owing signal retention and 100
    orgs per pass, each pass serves one bounded batch and every org is reached within
    ceil(orgs / 100) passes (the org discovery was paged before too: this guards it)."""
    from runtime_svc.kernel.store_waits import insert_signal_txn
    from runtime_svc.waits.evidence import validate_submission
    from runtime_svc.waits.reconciler import orgs_with_waits

    new = validate_submission(approval("old", "t"), world.rt.registry)
    orgs = [f"rot-{i:04d}" for i in range(500)]
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        for org in orgs:
            await insert_signal_txn(
                conn,
                work_scope(new_scope(org)),
                new,
                now - timedelta(days=40),
                expires_at=now - timedelta(days=1),
                match_at=None,
            )
    # Other tests of this module share the database: count every org with waits.
    total = len(await orgs_with_waits(world.engine, limit=100_000))
    assert total >= len(orgs)
    sweeper = world.rt.sweeper(batch=10, org_batch=100)

    async def expired() -> int:
        w = flow_wake_signals.c
        async with db.transaction(world.engine, readonly=True) as conn:
            query = select(func.count()).where(
                w.org_id.in_(orgs), w.resolution_state == SignalState.EXPIRED.code
            )
            return int((await conn.execute(query)).scalar_one())

    await sweeper.sweep_once()
    assert 0 < await expired() <= 100  # one bounded batch per pass
    for _ in range(-(-total // 100) - 1):
        await sweeper.sweep_once()
    assert await expired() == len(orgs)  # every org reached within ceil(orgs / batch)


async def test_a_wait_entered_on_the_last_attempt_resumes_and_finishes(
    engine: AsyncEngine,
) -> None:
    """Issue 10 item 4: the resume claim of a wait step is no retry (§12.1 step 3, §13.4).
    With a budget of one attempt, entering the wait spends it; the resolved step is
    ``Pending`` again and must still be claimed — neither stranded ``Runnable`` nor
    failed with ``retry_exhausted``."""
    world = World(engine, new_scope(), policy=dataclasses.replace(WAIT_POLICY, max_attempts=1))
    run_id = await _waiting(world)
    step = (await world.run(run_id)).current_step_execution_id
    outcome = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    assert outcome.signal.state is SignalState.CONSUMED
    done = await world.drive(run_id)
    assert done.state is RunState.SUCCEEDED, done
    assert await events_of(world.engine, world.org, run_id) == 1
    # The wait step's resume ran as its second attempt.
    async with db.transaction(engine, readonly=True) as conn:
        attempts = (
            await conn.execute(
                select(func.count()).where(
                    flow_step_attempts.c.org_id == world.org,
                    flow_step_attempts.c.step_execution_id == step,
                )
            )
        ).scalar_one()
    assert attempts == 2


async def test_a_resolution_names_the_run_and_a_worker_claims_it_from_that_hint(
    world: World,
) -> None:
    """The resolution's wakeup names the run it made runnable; the worker loop's hook
    claims that run's step directly (no org / queue discovery) — and a hint for a run
    with nothing due claims nothing."""
    from runtime_svc.waits.resolution import ResolvedRun
    from runtime_svc.worker.background import _run_resolved
    from services.background import Wakeup

    wake = Wakeup()
    world.rt.matcher._on_resolved = wake.notify  # the app wires the workers' wakeup here
    run_id = await _waiting(world)
    await world.rt.signals.submit(world.work, approval("r1", "t1"))
    hints = wake.take_hints()
    assert [(h.org_id, h.flow_run_id) for h in hints] == [(world.org, run_id)]
    # The hint carries the candidate the resolution committed (no read to claim it).
    resumed = hints[0].candidate
    assert resumed is not None and resumed.flow_run_id == run_id
    assert resumed == await world.store.candidate_for_run(world.org, run_id)

    async def no_discovery(*_args: object) -> list[object]:
        raise AssertionError("a hinted run must not need the discovery batch")

    async def no_candidate_read(*_args: object) -> object:
        raise AssertionError("a hint with the resolution's candidate needs no candidate read")

    world.worker.run_batch = no_discovery  # type: ignore[assignment,method-assign]
    real_read = world.store.candidate_for_run
    world.store.candidate_for_run = no_candidate_read  # type: ignore[assignment,method-assign]
    assert await _run_resolved(world.worker, hints) is True
    run = await world.run(run_id)
    assert run.state is not RunState.WAITING
    world.store.candidate_for_run = real_read  # type: ignore[method-assign]
    assert await _run_resolved(world.worker, [ResolvedRun(world.org, "no-such-run")]) is False
    assert await _run_resolved(world.worker, [object()]) is False


async def test_a_stale_hinted_candidate_claims_nothing(world: World) -> None:
    """A hint is only a shortcut: a candidate whose versions something else moved since
    the resolution (here another worker's claim, found by its own discovery) loses the
    fenced claim and writes nothing — no second attempt, no version bump."""
    from runtime_svc.worker.background import _run_resolved
    from services.background import Wakeup

    wake = Wakeup()
    world.rt.matcher._on_resolved = wake.notify
    run_id = await _waiting(world, key="r2")
    await world.rt.signals.submit(world.work, approval("r2", "t2"))
    hints = wake.take_hints()
    found = await world.store.candidate_for_run(world.org, run_id)
    assert found is not None and found == hints[0].candidate
    fence = await world.store.claim(world.org, found, lease_owner="other")
    assert not isinstance(fence, NotEligible)
    before = await world.run(run_id)
    assert await _run_resolved(world.worker, hints) is False
    after = await world.run(run_id)
    assert after.state_version == before.state_version  # the stale claim wrote nothing
    assert after.state is before.state


async def _woken_by_hint(world: World, key: str, workers: int, ready: Callable[[], bool]) -> None:
    """A run waits on ``key``; ``workers`` worker loops of one process idle on the
    process's wakeup with a ten-minute poll interval; once ``ready()`` (their start-up
    polls ran) the signal is submitted, and the run must finish."""
    from runtime_svc.worker import FixedViews, WorkerSettings, start_background
    from services.background import Wakeup
    from tests.integration.worker.support import record_view
    from tests.support.procs import assert_eventually

    wake = Wakeup()
    world.rt.matcher._on_resolved = wake.notify
    run_id = await _waiting(world, key=key)
    # The hinted path (a wake the process does not pre-claim, ADR 0007).
    settings = WorkerSettings(workers=workers, sweeps=False, idle_ms=600_000, preclaim_wake=False)
    bg = await start_background(
        None,
        world.engine,
        views=FixedViews(record_view()),
        settings=settings,
        waits=world.rt,
        work_wake=wake,
    )
    try:
        await assert_eventually(ready, timeout=30, what="the start-up polls")
        await world.rt.signals.submit(world.work, approval(key, f"t-{key}"))

        async def finished() -> bool:
            return (await world.run(run_id)).state is RunState.SUCCEEDED

        await assert_eventually(finished, timeout=60, what="the hinted run to finish")
    finally:
        await bg.stop()


async def test_a_worker_loop_idle_for_minutes_runs_a_resolved_run_from_its_hint(
    world: World,
) -> None:
    """Event-driven wake, not a poll: the process's worker loop idles with a poll
    interval of ten minutes (its floor after work is minutes too), yet a resolution in
    the process wakes it and it runs the resumed step to the end from the hint alone;
    the loop's polls besides its start-up passes all follow the wake with no sleep between
    (when admission defers the hinted candidate of an org this process has not visited
    yet — fair-share credit comes from a visit, §16 — the woken iteration falls back to
    one pass at once, and a pass that found work re-polls once), never a timed poll."""
    from runtime_svc.worker.loop import Outcome, StepWorker

    polls = 0
    startup: list[int] = []  # the passes the loop made before it first went idle
    real_run_once = StepWorker.run_once

    async def counted(self: StepWorker) -> Any:
        nonlocal polls
        polls += 1
        outcomes = await real_run_once(self)
        if not startup and all(o is Outcome.NOT_ELIGIBLE for o in outcomes):
            startup.append(polls)  # a pass that found nothing: the loop idles now
        return outcomes

    StepWorker.run_once = counted  # type: ignore[method-assign]
    try:
        # The signal is submitted once the loop idles: its start-up passes may find and
        # run other tests' leftover work in the shared database (and re-poll after it),
        # and a pass still running could find the resumed step itself.
        await _woken_by_hint(world, "r3", 1, lambda: bool(startup))
    finally:
        StepWorker.run_once = real_run_once  # type: ignore[method-assign]
    # After the wake: at most the woken fallback pass and its busy re-poll.
    assert polls - startup[0] <= 2


async def test_a_resolution_wakes_one_of_the_idle_workers_the_others_keep_sleeping(
    world: World,
) -> None:
    """Three worker loops of one process idle on the process's one wakeup (ten-minute
    poll interval); a resolution's hinted notify wakes ONE of them, which runs the run
    from the hint; the other two make no discovery pass for it (before: every idle
    worker woke and polled, N-1 extra polls per wake)."""
    from runtime_svc.worker.loop import Outcome, StepWorker

    polls: list[StepWorker] = []
    hinted: list[StepWorker] = []
    startup: list[int] = []
    real_run_once, real_found = StepWorker.run_once, StepWorker.process_found

    idle: set[StepWorker] = set()

    async def counted(self: StepWorker) -> Any:
        polls.append(self)
        outcomes = await real_run_once(self)
        if all(o is Outcome.NOT_ELIGIBLE for o in outcomes):
            idle.add(self)  # a pass that found nothing: this loop idles now
        return outcomes

    async def found(self: StepWorker, *args: Any, **kw: Any) -> Any:
        hinted.append(self)
        return await real_found(self, *args, **kw)

    def ready() -> bool:
        # Every loop idles: its start-up passes may run other tests' leftover work in
        # the shared database, and one still running could find the resumed step itself.
        if len(idle) < 3:
            return False
        startup.append(len(polls))
        return True

    StepWorker.run_once = counted  # type: ignore[method-assign]
    StepWorker.process_found = found  # type: ignore[method-assign]
    try:
        await _woken_by_hint(world, "r5", 3, ready)
    finally:
        StepWorker.run_once = real_run_once  # type: ignore[method-assign]
        StepWorker.process_found = real_found  # type: ignore[method-assign]
    assert hinted, "the run was not claimed from the hint"
    woken = hinted[0]
    # Only the woken worker polled after the wake (its fallback pass when admission
    # deferred the hint, and that pass's busy re-poll); the other two slept on.
    assert all(w is woken for w in polls[startup[0] :]), polls[startup[0] :]


def _submit_key(world: World, request_id: str, key: str, token: str) -> Any:
    from services.proto import runtime_v1
    from services.request_dedupe import DedupeScope, RequestKey

    request = runtime_v1.SubmitWakeSignalRequest(
        request_id=request_id, producer_kind="approval.decision", producer_key=key, wake_token=token
    )
    return RequestKey.of(DedupeScope.of_work_scope(world.work), "SubmitWakeSignal", request)


async def test_submit_wake_signal_completes_its_request_row_in_the_match_transaction(
    world: World,
) -> None:
    """``SubmitWakeSignal``'s request-ledger row commits with the signal (provisional)
    and is completed with the post-match answer inside the match+resolution
    transaction — two transactions per wake, not a third for the ledger — and a retry
    with the same request id replays that consumed answer."""
    from sqlalchemy import event

    from runtime_svc.api.signals import encode_submit_response
    from services.proto import runtime_v1

    run_id = await _waiting(world, key="r6")
    key = _submit_key(world, "req-r6", "r6", "t6")
    begun: list[int] = []

    def began(*_args: object) -> None:
        begun.append(1)

    event.listen(world.engine.sync_engine, "begin", began)
    try:
        data = await world.rt.signals.submit_once(
            world.work, approval("r6", "t6"), key, encode_submit_response
        )
    finally:
        event.remove(world.engine.sync_engine, "begin", began)
    assert len(begun) == 2
    answer = runtime_v1.SubmitWakeSignalResponse.FromString(data)
    assert answer.signal.resolution_state == SignalState.CONSUMED.value
    assert answer.signal.dependency_id and answer.signal.consumed_at.seconds > 0
    assert (await world.run(run_id)).state is RunState.RUNNABLE
    replay = await world.rt.signals.submit_once(
        world.work, approval("r6", "t6"), key, encode_submit_response
    )
    assert replay == data  # the completed (consumed) answer, not the provisional one


async def test_a_submission_whose_match_lost_its_race_still_completes_its_request_row(
    world: World,
) -> None:
    """When the fused match transaction rolls back (a concurrent transition won the
    compare-and-swap), nothing of it — the ledger completion included — is kept: the
    request row is completed in a transaction of its own and a retry replays it."""
    from runtime_svc.api.signals import encode_submit_response
    from runtime_svc.kernel.store_waits import WaitStore
    from services.errors import FenceLostError

    await _waiting(world, key="r7")
    key = _submit_key(world, "req-r7", "r7", "t7")
    real = WaitStore.resolve_in

    async def lost(self: WaitStore, *args: Any, **kw: Any) -> Any:
        await real(self, *args, **kw)
        raise FenceLostError("moved meanwhile", entity="flow_dependencies", key="r7")

    WaitStore.resolve_in = lost  # type: ignore[method-assign]
    try:
        data = await world.rt.signals.submit_once(
            world.work, approval("r7", "t7"), key, encode_submit_response
        )
    finally:
        WaitStore.resolve_in = real  # type: ignore[method-assign]
    from services.proto import runtime_v1

    answer = runtime_v1.SubmitWakeSignalResponse.FromString(data)
    assert not answer.signal.dependency_id  # unmatched: the resolution rolled back
    assert answer.signal.resolution_state == SignalState.UNMATCHED.value
    replay = await world.rt.signals.submit_once(
        world.work, approval("r7", "t7"), key, encode_submit_response
    )
    assert replay == data


async def test_two_waiters_of_one_key_take_the_two_transaction_match_one_wake_each(
    world: World,
) -> None:
    """Several pending dependencies of one key are not resolved in the fused
    transaction (one run's locks are never held while another's root is locked): the
    match falls back to discovery then resolution, and each signal wakes exactly one
    waiter, the oldest first."""
    first = await _waiting(world, key="r5")
    run = await world.start("wait_signal", key="r5")
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING
    second = run.flow_run_id
    await world.rt.signals.submit(world.work, approval("r5", "t5a"))
    assert (await world.run(first)).state is RunState.RUNNABLE
    assert (await world.run(second)).state is RunState.WAITING
    await world.rt.signals.submit(world.work, approval("r5", "t5b"))
    assert (await world.run(second)).state is RunState.RUNNABLE


async def test_a_fresh_versioned_submission_is_accepted_in_two_round_trips(
    world: World,
) -> None:
    """``SubmitWakeSignal`` of a new versioned notification (an effect receipt's shape):
    the ledger lookup also answers whether the acceptance read would find anything
    (``VersionedKeySeen``), so a fresh key skips that read, and the request ledger's row
    rides in the signal INSERT's round trip — the acceptance transaction is two round
    trips (lookup, batch) where the backend batches writes. A stale version and a
    retried token under another request id are still found and answered."""
    from sqlalchemy import event

    from runtime_svc.api.signals import encode_submit_response
    from services.db_batch import statements_of
    from services.proto import runtime_v1

    txns: list[list[list[str]]] = []

    def on_execute(*args: object) -> None:
        sql = str(args[2])
        if not sql.startswith("BEGIN"):  # SQLite's BEGIN IMMEDIATE
            txns[-1].append([" ".join(s.split()) for s in statements_of(sql)])

    def began(*_args: object) -> None:
        txns.append([])

    async def submit(request_id: str, token: str, version: int) -> Any:
        key = _submit_key(world, request_id, "r8", token)
        data = await world.rt.signals.submit_once(
            world.work, approval("r8", token, version=version), key, encode_submit_response
        )
        return runtime_v1.SubmitWakeSignalResponse.FromString(data)

    event.listen(world.engine.sync_engine, "before_cursor_execute", on_execute)
    event.listen(world.engine.sync_engine, "begin", began)
    try:
        first = await submit("req-r8-1", "v2", 2)
    finally:
        event.remove(world.engine.sync_engine, "before_cursor_execute", on_execute)
        event.remove(world.engine.sync_engine, "begin", began)
    acceptance = txns[0]
    assert "versioned_key_seen" in acceptance[0][0]  # the ledger lookup's extra column
    heads = [[s.split(" (")[0] for s in trip] for trip in acceptance]
    if db.strategy_for(world.engine.dialect).multi_statements:
        assert heads[1:] == [["INSERT INTO flow_wake_signals", "INSERT INTO runtime_requests"]]
    else:
        assert heads[1:] == [["INSERT INTO flow_wake_signals"], ["INSERT INTO runtime_requests"]]

    stale = await submit("req-r8-2", "v1", 1)
    assert stale.stale and stale.signal.wake_signal_id == first.signal.wake_signal_id
    again = await submit("req-r8-3", "v2", 2)  # the same token under another request id
    assert again.duplicate and again.signal.wake_signal_id == first.signal.wake_signal_id
    assert [s.wake_token for s in await signals(world.engine, world.org)] == ["v2"]
    assert (await submit("req-r8-1", "v2", 2)) == first  # the request's own replay


async def test_a_wait_steps_dependency_rides_in_its_commits_round_trip(world: World) -> None:
    """§14.2 step 3: the dependency commits with the wait transition and the checkpoint
    that is the resume point — after the commit's own writes, in their round trip where
    the backend batches writes (``CommitTail``, ADR 0010); one by one elsewhere."""
    from sqlalchemy import event

    from services.db_batch import statements_of

    trips: list[list[str]] = []

    def on_execute(*args: object) -> None:
        trips.append([" ".join(s.split()).split(" (")[0] for s in statements_of(str(args[2]))])

    event.listen(world.engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        run_id = await _waiting(world, key="r10")
    finally:
        event.remove(world.engine.sync_engine, "before_cursor_execute", on_execute)
    [dep] = [t for t in trips if "INSERT INTO flow_dependencies" in t]
    if db.strategy_for(world.engine.dialect).multi_statements:
        assert dep[0] == "INSERT INTO flow_checkpoints"
        assert dep[-1] == "INSERT INTO flow_dependencies"
    else:
        assert dep == ["INSERT INTO flow_dependencies"]
    assert (await world.dependency(run_id)).state is DependencyState.PENDING
