"""Headless Chromium (Debian's ``chromium`` package) for tests that look at a page.

``.ci/run`` installs the package; a test that needs it calls :func:`chromium` and is
skipped locally when it is missing, failed under ``CI=true``. The flags keep Chromium off
the network (this machine has none; without them it keeps retrying Google's hosts) and
give every run its own throw-away profile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

__all__ = ["chromium", "dump_dom", "screenshot"]

_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--hide-scrollbars",
)
_TIMEOUT_S = 120


def chromium() -> str:
    """The Chromium binary; skip (locally) or fail (CI) when it is not installed."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI=true: .ci/run installs it")
        pytest.skip(message)
    return path


def _run(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run(
            [chromium(), *_FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )


def dump_dom(page: Path) -> str:
    """The page's DOM after its scripts ran (``--dump-dom``)."""
    result = _run(page, "--virtual-time-budget=5000", "--dump-dom")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def screenshot(page: Path, out: Path, *, width: int = 1400, height: int = 1600) -> Path:
    """A PNG of the page's first ``width`` x ``height`` pixels."""
    result = _run(page, f"--window-size={width},{height}", f"--screenshot={out}")
    assert result.returncode == 0 and out.exists(), result.stderr[-3000:]
    return out
