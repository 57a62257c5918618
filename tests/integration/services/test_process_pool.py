"""``services.process_pool.ProcessPool`` with real (trivial) child processes: it starts N,
restarts one that dies (with backoff), stops them all with SIGTERM — SIGKILL for one
that ignores it — and never leaves a process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from services.process_pool import ProcessPool, RestartPolicy
from tests.support.procs import assert_eventually

#: A child that lives until its stdin closes or it is signalled.
_UNTIL_EOF = [sys.executable, "-c", "import sys; sys.stdin.read()"]


def _stubborn(ready: Path) -> list[str]:
    """A child that ignores SIGTERM (the pool must SIGKILL it after the grace); it
    creates ``ready`` once the handler is installed."""
    return [
        sys.executable,
        "-c",
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)",
    ]


_FAST = RestartPolicy(base_s=0.05, max_s=0.2, stable_s=60.0)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_pool_starts_n_restarts_a_killed_one_and_stops_all() -> None:
    pool = await ProcessPool("child", _UNTIL_EOF, os.environ, 3, policy=_FAST).start()
    try:
        first = pool.pids()
        assert len(first) == 3 and all(_alive(p) for p in first)
        os.kill(first[1], signal.SIGKILL)
        await assert_eventually(
            lambda: pool.restarts == 1 and len(pool.pids()) == 3,
            timeout=30,
            what="the killed child restarted",
        )
        now = pool.pids()
        assert now[0] == first[0] and now[2] == first[2] and now[1] != first[1]
    finally:
        await pool.stop()
    assert pool.pids() == []
    assert not [p for p in {*first, *now} if _alive(p)]
    await pool.stop()  # idempotent


async def test_a_crash_looping_child_backs_off_and_stop_interrupts_the_backoff() -> None:
    policy = RestartPolicy(base_s=0.05, max_s=60.0, stable_s=60.0, jitter=0.0)
    pool = ProcessPool(
        "crasher", [sys.executable, "-c", "raise SystemExit(3)"], os.environ, 1, policy=policy
    )
    await pool.start()
    # Delays 0.05, 0.1, 0.2, … : a handful of restarts, then a long wait stop() cuts short.
    await assert_eventually(lambda: pool.restarts >= 3, timeout=60, what="three restarts")
    await asyncio.wait_for(pool.stop(), timeout=30)
    settled = pool.restarts
    await asyncio.sleep(0.3)
    assert pool.restarts == settled  # nothing restarted after stop


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    pool = await ProcessPool("stubborn", _stubborn(ready), os.environ, 1, stop_grace_s=1.0).start()
    [pid] = pool.pids()
    await assert_eventually(ready.exists, timeout=30, what="SIGTERM ignored")
    await asyncio.wait_for(pool.stop(), timeout=60)
    assert not _alive(pid)


def test_a_pool_needs_a_process() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ProcessPool("none", _UNTIL_EOF, os.environ, 0)


async def test_a_first_start_failure_is_reported_and_a_later_one_is_retried(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(RuntimeError, match="could not be started"):
        await ProcessPool("absent", [str(missing)], os.environ, 2, policy=_FAST).start()

    script = tmp_path / "child.sh"
    script.write_text("#!/bin/sh\nexec cat\n")  # lives until stdin closes
    script.chmod(0o755)
    pool = await ProcessPool("flaky", [str(script)], os.environ, 1, policy=_FAST).start()
    try:
        [first] = pool.pids()
        script.unlink()  # the restart cannot exec: logged and retried with backoff
        os.kill(first, signal.SIGKILL)
        await assert_eventually(lambda: pool.restarts >= 2, timeout=30, what="failed restarts")
        assert pool.pids() == []
        script.write_text("#!/bin/sh\nexec cat\n")
        script.chmod(0o755)
        await assert_eventually(lambda: len(pool.pids()) == 1, timeout=30, what="restarted")
        now = pool.pids()
    finally:
        await pool.stop()
    assert not [p for p in {first, *now} if _alive(p)]


def test_a_slot_is_crash_looping_after_unhealthy_after_short_lives_until_a_child_runs_stable() -> (
    None
):
    policy = RestartPolicy(stable_s=10.0, unhealthy_after=3)
    assert not policy.crash_looping(2, None)
    assert policy.crash_looping(3, None)  # no child running after the third exit
    assert policy.crash_looping(3, 9.9)  # restarted, not yet stable
    assert not policy.crash_looping(3, 10.0)  # ran stable_s: healthy again
    assert not policy.crash_looping(0, None)


async def test_a_crash_looping_pool_reports_unhealthy_and_recovers_when_a_child_stays_up(
    tmp_path: Path,
) -> None:
    """``unhealthy()`` names the slot whose child keeps dying right after start (what
    turns the supervisor's gRPC health NOT_SERVING), is None for a pool whose children
    stay up, and clears once a restarted child has run ``stable_s``."""
    fixed = tmp_path / "fixed"
    crash_until_fixed = [
        sys.executable,
        "-c",
        f"import pathlib, sys; pathlib.Path({str(fixed)!r}).exists() or sys.exit(3); "
        "sys.stdin.read()",
    ]
    policy = RestartPolicy(base_s=0.05, max_s=0.2, stable_s=1.0, jitter=0.0, unhealthy_after=2)
    healthy = await ProcessPool("steady", _UNTIL_EOF, os.environ, 1, policy=policy).start()
    pool = await ProcessPool("crasher", crash_until_fixed, os.environ, 2, policy=policy).start()
    try:
        await assert_eventually(
            lambda: (
                (pool.unhealthy() or "").startswith("crasher crash-looping: slot 0 (")
                and ", 1 (" in (pool.unhealthy() or "")
            ),
            timeout=60,
            what="the crash loop of both slots reported",
        )
        assert healthy.unhealthy() is None
        fixed.touch()
        await assert_eventually(
            lambda: pool.unhealthy() is None, timeout=60, what="healthy once a child ran stable_s"
        )
        assert len(pool.pids()) == 2
    finally:
        await pool.stop()
        await healthy.stop()
    assert pool.unhealthy() is None  # a stopped pool is not unhealthy


async def test_send_writes_message_lines_round_robin_to_live_children(tmp_path: Path) -> None:
    """``send`` hands each line to one child, alternating slots; a stopped pool sends
    nothing."""
    echo = [
        sys.executable,
        "-c",
        "import os, sys\nwith open(os.environ['ECHO_TO'], 'a') as f:\n"
        "    for line in sys.stdin:\n        f.write(line); f.flush()",
    ]

    def out(slot: int) -> dict[str, str]:
        return {"ECHO_TO": str(tmp_path / f"slot{slot}.txt")}

    pool = await ProcessPool("echo", echo, os.environ, 2, policy=_FAST, spawn_env=out).start()
    try:
        for i in range(4):
            assert pool.send(f"m{i}\n".encode())

        def received(slot: int) -> list[str]:
            path = tmp_path / f"slot{slot}.txt"
            return path.read_text().split() if path.exists() else []

        await assert_eventually(
            lambda: len(received(0)) + len(received(1)) == 4, timeout=30, what="4 lines echoed"
        )
        assert sorted([received(0), received(1)]) == [["m0", "m2"], ["m1", "m3"]]
    finally:
        await pool.stop()
    assert not pool.send(b"late\n")
