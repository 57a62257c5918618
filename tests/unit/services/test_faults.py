"""Fault hooks: parsing, inertness, the production refusal and real SIGKILLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services import faults
from services.errors import CommitOutcomeUnknownError
from services.faults import CrashPoint, CrashSpec, FaultHookError, parse_crash_at

ROOT = Path(__file__).resolve().parents[3]


def test_parse() -> None:
    assert parse_crash_at("") is None
    assert parse_crash_at("  ") is None
    assert parse_crash_at("after_claim") == CrashSpec(CrashPoint.AFTER_CLAIM_COMMIT)
    assert parse_crash_at("after_step_commit:send:invoice") == CrashSpec(
        CrashPoint.AFTER_STEP_COMMIT, "send:invoice"
    )


@pytest.mark.parametrize("raw", ["after_stpe_commit", "AFTER_CLAIM", "after_step_commit:", ":x"])
def test_parse_rejects(raw: str) -> None:
    with pytest.raises(FaultHookError):
        parse_crash_at(raw)


def test_matching_is_exact() -> None:
    any_step = CrashSpec(CrashPoint.AFTER_STEP_COMMIT)
    one_step = CrashSpec(CrashPoint.AFTER_STEP_COMMIT, "abc")
    assert any_step.matches(CrashPoint.AFTER_STEP_COMMIT, "whatever")
    assert one_step.matches(CrashPoint.AFTER_STEP_COMMIT, "abc")
    assert not one_step.matches(CrashPoint.AFTER_STEP_COMMIT, "abcd")
    assert not one_step.matches(CrashPoint.AFTER_STEP_COMMIT, None)
    assert not one_step.matches(CrashPoint.BEFORE_STEP_COMMIT, "abc")


def test_unset_hooks_are_inert() -> None:
    assert os.environ.get("FLOW_CRASH_AT", "") == ""
    assert faults.active_crash_spec() is None
    for point in CrashPoint:
        faults.crash_point(point)
        faults.crash_point(point, "abc")
        faults.raise_connection_lost_after_commit(point, "abc")


def test_production_refuses_hooks() -> None:
    faults.assert_hooks_allowed("production")
    faults.assert_hooks_allowed("development", crash_at="after_claim")
    with pytest.raises(FaultHookError, match="production"):
        faults.assert_hooks_allowed("production", crash_at="after_claim")
    with pytest.raises(FaultHookError):
        faults.assert_hooks_allowed("development", crash_at="no_such_point")
    with (
        faults.connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT),
        pytest.raises(FaultHookError),
    ):
        faults.assert_hooks_allowed("production")


def test_connection_lost_after_commit_fires_once_at_the_armed_point() -> None:
    with faults.connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, "abc"):
        faults.raise_connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, "xyz")
        faults.raise_connection_lost_after_commit(CrashPoint.AFTER_CLAIM_COMMIT, "abc")
        with pytest.raises(CommitOutcomeUnknownError) as info:
            faults.raise_connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, "abc")
        assert info.value.retryable is False
        faults.raise_connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, "abc")  # disarmed
    with faults.connection_lost_after_commit(CrashPoint.AFTER_OUTBOX_ENQUEUE):
        pass
    faults.raise_connection_lost_after_commit(CrashPoint.AFTER_OUTBOX_ENQUEUE)  # disarmed on exit


def _run(crash_at: str, qualifier: str, marker: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "from services.faults import CrashPoint, crash_point\n"
        "crash_point(CrashPoint.BEFORE_STEP_COMMIT, 'abc')\n"
        f"crash_point(CrashPoint.AFTER_STEP_COMMIT, {qualifier!r})\n"
        "print('survived')\n"
    )
    env = os.environ | {"FLOW_CRASH_AT": crash_at, "FLOW_CRASH_MARKER_FILE": str(marker)}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_sigkill_at_the_exact_point(tmp_path: Path) -> None:
    marker = tmp_path / "crash.marker"
    proc = _run("after_step_commit:abc", "abc", marker)
    assert proc.returncode == -signal.SIGKILL
    assert "survived" not in proc.stdout
    assert "SIGKILL at after_step_commit:abc" in proc.stderr
    assert marker.read_text() == "after_step_commit:abc\n"


def test_other_qualifier_survives(tmp_path: Path) -> None:
    marker = tmp_path / "crash.marker"
    proc = _run("after_step_commit:abc", "xyz", marker)
    assert proc.returncode == 0, proc.stderr
    assert "survived" in proc.stdout
    assert not marker.exists()


def test_unknown_point_fails_at_import(tmp_path: Path) -> None:
    proc = _run("after_step_comit", "abc", tmp_path / "m")
    assert proc.returncode == 1
    assert "unknown point 'after_step_comit'" in proc.stderr
    assert "survived" not in proc.stdout


def test_the_step_entry_counter_appends_one_line_per_entry_and_is_refused_in_production(
    tmp_path: Path,
) -> None:
    entries = tmp_path / "entries.txt"
    code = (
        "from services.faults import FaultHookError, assert_hooks_allowed, step_entered\n"
        "step_entered('bump1', 'step_a', 1)\n"
        "step_entered('bump1', 'step_a', 2)\n"
        "assert_hooks_allowed('test')\n"
        "try:\n"
        "    assert_hooks_allowed('production')\n"
        "except FaultHookError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_CRASH")}
    env["FLOW_CRASH_STEP_ENTRY_FILE"] = str(entries)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert entries.read_text() == "bump1 step_a 1\nbump1 step_a 2\n"
    assert "refused: FLOW_CRASH_STEP_ENTRY_FILE is set" in proc.stdout


def test_the_step_entry_counter_is_inert_without_its_file() -> None:
    faults.step_entered("bump1", "step_a", 1)  # no file configured in the test process
