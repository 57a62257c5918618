"""The one background-loop lifecycle (``services.background``) and the org rotation."""

from __future__ import annotations

import asyncio
import bisect
import random
from collections.abc import Callable

import pytest

from services.background import (
    BackgroundLoop,
    IdleBackoff,
    LoopGroup,
    OrgRotation,
    OrgSource,
    Wakeup,
)


class Counting(BackgroundLoop):
    def __init__(self, name: str, *, busy_for: int = 0, fail_first: int = 0) -> None:
        super().__init__(name, idle_s=0.02, grace_s=5)
        self.calls = 0
        self.busy_for = busy_for
        self.fail_first = fail_first
        self.ran = asyncio.Event()

    async def run_once(self) -> bool:
        self.calls += 1
        self.ran.set()
        if self.calls <= self.fail_first:
            raise RuntimeError("transient")
        return self.calls <= self.busy_for


async def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout)


async def test_a_loop_iterates_until_shutdown_and_survives_failing_iterations() -> None:
    loop = Counting("l", busy_for=5, fail_first=2)
    async with loop:
        await _until(lambda: loop.calls >= 8)
    calls = loop.calls
    await loop.shutdown()  # idempotent
    await asyncio.sleep(0.05)
    assert loop.calls == calls and loop.stopping


async def test_shutdown_before_start_and_a_body_loop() -> None:
    seen: list[int] = []

    async def body() -> bool:
        seen.append(1)
        return False

    loop = BackgroundLoop("b", idle_s=0.01, body=body)
    await loop.shutdown()
    await loop.run()  # already stopped: returns at once
    assert seen == []
    with pytest.raises(ValueError):
        BackgroundLoop("x", idle_s=0)
    with pytest.raises(NotImplementedError):
        await BackgroundLoop("y", idle_s=1).run_once()


async def test_a_group_runs_children_added_late_and_stops_them_all() -> None:
    a, b = Counting("a"), Counting("b")
    group = LoopGroup([a], grace_s=5)
    runner = asyncio.ensure_future(group.run())
    await asyncio.wait_for(a.ran.wait(), 30)
    group.add(b)
    await asyncio.wait_for(b.ran.wait(), 30)
    await group.stop()
    await asyncio.wait_for(runner, 30)
    assert a.stopping and b.stopping
    await group.shutdown()  # idempotent


async def test_a_child_that_dies_stops_the_group_first_exception() -> None:
    class Dying(BackgroundLoop):
        async def run(self) -> None:  # the loop machinery itself fails
            raise LookupError("broken loop")

    survivor = Counting("survivor")
    group = LoopGroup([survivor, Dying("dying", idle_s=1)], grace_s=5)
    with pytest.raises(LookupError):
        await asyncio.wait_for(group.run(), 30)
    assert survivor.stopping


async def test_spawn_keeps_the_process_hook_shape() -> None:
    done = asyncio.Event()

    async def body() -> bool:
        done.set()
        return False

    async with LoopGroup(grace_s=5) as group:
        group.spawn("w", body, 0.01)
        await asyncio.wait_for(done.wait(), 30)
    assert group.stopping


def test_idle_backoff_is_bounded_jittered_and_resets() -> None:
    b = IdleBackoff(0.5, random.Random(7))
    delays = [b.next_delay() for _ in range(12)]
    assert all(0 < d <= 0.5 for d in delays) and max(delays) > 0.2
    b.reset()
    assert b.next_delay() <= 0.01


def test_the_interval_period_is_jittered_within_its_bounds() -> None:
    b = IdleBackoff(2.0, random.Random(7))
    periods = [b.period() for _ in range(50)]
    assert all(1.0 <= p <= 2.0 for p in periods) and len(set(periods)) > 1


async def test_an_interval_loop_waits_its_period_even_after_a_busy_iteration() -> None:
    """A sweep or retention duty (``interval=True``) never spins, busy or not; shutdown
    interrupts the wait at once."""
    calls: list[int] = []
    ran = asyncio.Event()

    async def busy() -> bool:
        calls.append(1)
        ran.set()
        return True

    group = LoopGroup()
    group.spawn("sweep", busy, idle_s=3600, interval=True)
    async with group:
        await asyncio.wait_for(ran.wait(), 30)
        for _ in range(20):
            await asyncio.sleep(0)
    assert calls == [1]  # waiting its (half-hour or more) period, not spinning
    assert group.stopping


def _source(orgs: list[str]) -> OrgSource:
    async def source(after: str | None, limit: int) -> list[str]:
        ordered = sorted(orgs)
        start = 0 if after is None else bisect.bisect_right(ordered, after)
        return ordered[start : start + limit]

    return source


async def test_rotation_serves_every_one_of_500_orgs_within_five_batches() -> None:
    orgs = [f"org-{i:04d}" for i in range(500)]
    rotation = OrgRotation(_source(orgs), batch=100)
    served: list[str] = []
    for _ in range(5):
        batch = await rotation.next_batch()
        assert len(batch) == 100
        served.extend(batch)
    assert sorted(served) == orgs
    # It wraps around: the sixth batch starts again at the first org.
    assert (await rotation.next_batch())[0] == "org-0000"


async def test_rotation_wraps_mid_batch_and_never_repeats_an_org_in_one_batch() -> None:
    orgs = [f"org-{i:03d}" for i in range(250)]
    rotation = OrgRotation(_source(orgs), batch=100)
    b1, b2, b3 = [await rotation.next_batch() for _ in range(3)]
    assert b1 == orgs[:100] and b2 == orgs[100:200]
    # 50 from the tail, then 50 from the head: every batch holds distinct orgs.
    assert b3 == orgs[200:] + orgs[:50] and len(set(b3)) == 100
    assert (await rotation.next_batch()) == orgs[50:150]


async def test_rotation_with_fewer_orgs_than_a_batch_and_with_none() -> None:
    few = ["a", "b", "c"]
    rotation = OrgRotation(_source(few), batch=10)
    assert await rotation.next_batch() == few
    assert await rotation.next_batch() == few
    assert await OrgRotation(_source([]), batch=10).next_batch() == []
    with pytest.raises(ValueError):
        OrgRotation(_source(few), batch=0)


async def test_a_wakeup_ends_the_idle_wait_at_once_and_is_remembered_while_busy() -> None:
    ran = asyncio.Event()
    calls = 0

    async def body() -> bool:
        nonlocal calls
        calls += 1
        if calls > 1:
            ran.set()
        return False

    wake = Wakeup()
    # An interval loop waits its whole (hour-long) period after every pass.
    group = LoopGroup()
    group.spawn("woken", body, 3600.0, interval=True, wake=wake)
    async with group:
        for _ in range(200):  # bounded: the first pass ran and the loop is idle
            if calls:
                break
            await asyncio.sleep(0.01)
        wake.notify()
        await asyncio.wait_for(ran.wait(), timeout=10)  # not the hour-long idle wait
    # A notify with nobody waiting is kept for the next wait.
    wake.notify()
    assert await wake.wait(asyncio.Event(), 3600.0) is True
    assert await wake.wait(asyncio.Event(), 0.01) is False


async def test_a_wakeup_keeps_a_bounded_number_of_hints_oldest_dropped() -> None:
    wake = Wakeup(max_hints=2)
    for n in range(5):
        wake.notify(n)
    wake.notify()  # a plain nudge adds no hint
    assert wake.take_hints() == [3, 4]
    assert wake.take_hints() == []
    assert await wake.wait(asyncio.Event(), 3600.0) is True  # the nudge is remembered


def test_a_wakeup_reports_dropped_hints_once() -> None:
    wake = Wakeup(max_hints=2)
    wake.notify(1)
    wake.notify(2)
    assert wake.take_lost() is False  # at the bound, nothing dropped yet
    wake.notify(3)
    assert wake.take_hints() == [2, 3]
    assert wake.take_lost() is True
    assert wake.take_lost() is False


@pytest.mark.parametrize("wake_resets", [True, False])
async def test_a_wake_restarts_the_idle_backoff_only_when_the_loop_asks_for_it(
    monkeypatch: pytest.MonkeyPatch, wake_resets: bool
) -> None:
    """``wake_resets=False``: a wake ends the wait and runs the body, but the polls keep
    their backed-off schedule (the body served what the wake named)."""
    import services.background as background

    resets: list[int] = []

    class Recording(IdleBackoff):
        def reset(self) -> None:
            resets.append(1)
            super().reset()

    monkeypatch.setattr(background, "IdleBackoff", Recording)
    calls = 0
    second = asyncio.Event()

    async def body() -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:
            second.set()
        return False

    wake = Wakeup()
    loop = BackgroundLoop("named", idle_s=3600.0, body=body, wake=wake, wake_resets=wake_resets)
    task = loop.start()
    try:
        await _until(lambda: calls == 1)
        wake.notify("named work")
        await asyncio.wait_for(second.wait(), timeout=10)  # not the hour-long idle wait
    finally:
        await loop.shutdown()
    await task
    assert resets == ([1] if wake_resets else [])


def test_an_idle_floor_sets_the_first_delay_after_work_and_stays_under_the_cap() -> None:
    backoff = IdleBackoff(0.5, random.Random(1), min_s=0.125)
    first = backoff.next_delay()
    assert 0.0625 <= first <= 0.125
    for _ in range(10):
        assert backoff.next_delay() <= 0.5
    backoff.reset()
    assert 0.0625 <= backoff.next_delay() <= 0.125
    # A floor above the cap is the cap; below the minimum, the minimum.
    assert IdleBackoff(0.2, random.Random(1), min_s=5.0).next_delay() <= 0.2
    assert IdleBackoff(0.2, random.Random(1), min_s=0.0).next_delay() <= 0.01


async def _waiting(wake: Wakeup, count: int) -> list[asyncio.Task[bool]]:
    """``count`` loops idle on ``wake`` (hour-long waits), in start order."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(wake.wait(stop, 3600.0)) for _ in range(count)]
    for _ in range(100):  # bounded: let every task reach its wait
        await asyncio.sleep(0)
    assert not any(t.done() for t in tasks)
    return tasks


async def test_a_notify_wakes_one_waiting_loop_the_longest_waiting_first() -> None:
    wake = Wakeup()
    tasks = await _waiting(wake, 3)
    wake.notify("run-1")
    await asyncio.wait(tasks, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    for _ in range(100):  # the other two stay asleep (no discovery pass each)
        await asyncio.sleep(0)
    assert [t.done() for t in tasks] == [True, False, False]
    assert tasks[0].result() is True
    assert wake.take_hints() == ["run-1"]
    wake.notify()
    wake.notify()  # a second notification in a row wakes the next waiting loop
    await asyncio.wait_for(asyncio.gather(*tasks[1:]), timeout=5)
    assert [t.result() for t in tasks] == [True, True, True]
    # Nobody waits any more: the next notification is kept for the next wait.
    wake.notify()
    assert await wake.wait(asyncio.Event(), 3600.0) is True


async def test_a_picked_loop_cancelled_before_it_ran_hands_the_notification_on() -> None:
    wake = Wakeup()
    [task] = await _waiting(wake, 1)
    wake.notify("run-1")
    task.cancel()  # picked, then cancelled before it resumed
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wake.wait(asyncio.Event(), 3600.0) is True
    assert wake.take_hints() == ["run-1"]


async def test_a_loop_that_stopped_or_timed_out_is_not_picked() -> None:
    wake = Wakeup()
    stop = asyncio.Event()
    stopping = asyncio.create_task(wake.wait(stop, 3600.0))
    await asyncio.sleep(0)
    stop.set()
    assert await asyncio.wait_for(stopping, timeout=5) is False
    assert await wake.wait(asyncio.Event(), 0.01) is False  # timed out, not notified
    wake.notify()  # no waiter left behind to swallow it: the next wait gets it
    assert await wake.wait(asyncio.Event(), 3600.0) is True
