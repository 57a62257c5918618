"""The background-loop lifecycle: run until shutdown, idempotent shutdown, a failing
iteration backs off instead of ending the process, async with."""

from __future__ import annotations

import asyncio

from services.polling import BackgroundLoops, LoopTask, Wakeup


async def test_loops_run_until_shutdown_and_survive_a_failing_iteration() -> None:
    seen: list[str] = []
    calls = {"n": 0}

    async def work() -> bool:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("one bad iteration")
        seen.append("work")
        return calls["n"] < 5

    async def sweep() -> bool:
        seen.append("sweep")
        return False

    loops = BackgroundLoops(
        [LoopTask("work", work, 0.01), LoopTask("sweep", sweep, 0.01, interval=True)],
        stop_grace_s=2,
    )
    async with loops:
        for _ in range(400):
            if calls["n"] >= 6 and seen.count("sweep") >= 2:
                break
            await asyncio.sleep(0.01)
    assert calls["n"] >= 6 and "sweep" in seen
    await loops.stop()  # idempotent
    assert loops.stopping


async def test_run_returns_after_shutdown() -> None:
    async def idle() -> bool:
        return False

    loops = BackgroundLoops([LoopTask("idle", idle, 0.05)], stop_grace_s=2)
    runner = asyncio.create_task(loops.run())
    await asyncio.sleep(0.05)
    await loops.shutdown()
    await asyncio.wait_for(runner, 5)


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
    # An interval task waits its whole (hour-long) period after every pass.
    loops = BackgroundLoops([LoopTask("woken", body, 3600.0, interval=True, wake=wake)])
    async with loops:
        for _ in range(200):  # bounded: the first pass ran and the loop is idle
            if calls:
                break
            await asyncio.sleep(0.01)
        wake.notify()
        await asyncio.wait_for(ran.wait(), timeout=10)  # not the hour-long idle wait
    # A notify with nobody waiting is kept for the next wait.
    wake.notify()
    stop = asyncio.Event()
    assert await wake.wait(stop, 3600.0) is True
    assert await wake.wait(asyncio.Event(), 0.01) is False
