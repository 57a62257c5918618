"""The ``make run`` stack (``python -m flowctl.devstack``) as a test fixture.

Starts the dev stack on free loopback ports under a temporary data dir, waits (bounded)
for its banner, and hands the test the demo summary (``demo.json``) and the environment
a client (flowctl, grpcurl) needs to reach it. On exit it stops the stack with SIGTERM
and SIGKILLs anything left behind, so a failed test never leaks service processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.procs import ROOT, free_port, wait_until

__all__ = ["BANNER", "DemoStack", "demo_stack"]

BANNER = "Nexus Flow Runtime is up"


@dataclass
class DemoStack:
    """A running dev stack and how to reach it."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    ports: dict[str, int]
    env: dict[str, str]
    out: Path
    err: Path
    demo: dict[str, Any] = field(default_factory=dict)

    @property
    def runtime_target(self) -> str:
        return f"127.0.0.1:{self.ports['runtime']}"

    @property
    def catalog_target(self) -> str:
        return f"127.0.0.1:{self.ports['catalog']}"

    @property
    def effect_target(self) -> str:
        return f"127.0.0.1:{self.ports['effect-owner']}"

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def children(self) -> list[int]:
        """PIDs whose parent is the dev stack (Linux ``/proc``)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process went away while we looked
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids


def _env(
    data_dir: Path, ports: Mapping[str, int], extra: Mapping[str, str] | None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env.update(
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(data_dir),
            "FLOW_CATALOG_PORT": str(ports["catalog"]),
            "FLOW_RUNTIME_PORT": str(ports["runtime"]),
            "FLOW_EFFECT_PORT": str(ports["effect-owner"]),
            "FLOW_CATALOG_TARGET": f"127.0.0.1:{ports['catalog']}",
            "FLOW_SHUTDOWN_GRACE_S": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


@contextmanager
def demo_stack(base: Path, *, extra_env: Mapping[str, str] | None = None) -> Iterator[DemoStack]:
    """Run the dev stack under ``base`` until the block ends (module docstring).

    Args:
        base: an empty directory; the data dir and the stack's output go below it.
        extra_env: more variables for the stack (and its three services).
    """
    data_dir = base / "data"
    ports = {"catalog": free_port(), "runtime": free_port(), "effect-owner": free_port()}
    env = _env(data_dir, ports, extra_env)
    out, err = base / "devstack.out", base / "devstack.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowctl.devstack"], cwd=ROOT, env=env, stdout=o, stderr=e
        )
    stack = DemoStack(proc, data_dir, ports, env, out, err)
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"devstack exited with {proc.returncode}:\n{stack.output()[-4000:]}"
                )
            text = out.read_text(errors="replace")
            return BANNER in text and "Summary:" in text

        wait_until(up, timeout=120, interval=0.2, what="the devstack banner")
        stack.demo = json.loads((data_dir / "demo.json").read_text(encoding="utf-8"))
        yield stack
    finally:
        children = stack.children()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        for pid in children:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
