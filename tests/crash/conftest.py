"""Crash-proof harness: a real runtime process (``python -m runtime_svc serve`` — the
runtime's gRPC services plus its background workers and sweeps) is a child on a
shared, migrated test database; ``FLOW_CRASH_AT`` makes it SIGKILL itself at a named
point and append that point to ``FLOW_CRASH_MARKER_FILE``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore
from services import db, migrate
from tests.integration.worker.support import view_file
from tests.support.procs import free_port, service_env

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_MODULE = "runtime_svc"
#: Child timings: a 1 s lease and 50-400 ms backoffs so recovery is quick.
CHILD_ENV = {
    "FLOW_RUNTIME_WORKERS": "1",
    "FLOW_RUNTIME_SWEEPS": "true",
    "FLOW_RUNTIME_LEASE_MS": "1000",
    "FLOW_RUNTIME_RETRY_BASE_MS": "50",
    "FLOW_RUNTIME_RETRY_MAX_MS": "400",
    "FLOW_RUNTIME_IDLE_MS": "100",
    "FLOW_RUNTIME_SWEEP_MS": "200",
    "FLOW_LOG_LEVEL": "WARNING",
    "FLOW_OTEL_ENABLED": "false",
}


@dataclass
class Child:
    """One runtime child process."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    _log: object = field(repr=False, default=None)
    port: int = 0

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    async def wait_exit(self, timeout_s: float) -> int | None:
        for _ in range(int(timeout_s / 0.05)):
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.05)
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        log = self._log
        if log is not None:
            log.close()  # type: ignore[attr-defined]


@dataclass
class Harness:
    tmp: Path
    db_url: str
    children: list[Child] = field(default_factory=list)

    @property
    def marker(self) -> Path:
        return self.tmp / "crash_marker.txt"

    @property
    def entries_file(self) -> Path:
        """The children's step-entry counter (``FLOW_CRASH_STEP_ENTRY_FILE``)."""
        return self.tmp / "step_entries.txt"

    def entries(self, step_key: str) -> int:
        """How often any child entered plan step ``step_key`` (before and after kills)."""
        if not self.entries_file.exists():
            return 0
        lines = self.entries_file.read_text().splitlines()
        return sum(1 for line in lines if line.split(" ", 1)[0] == step_key)

    def spawn(
        self,
        crash_at: str | None = None,
        env: dict[str, str] | None = None,
        command: str = "serve",
    ) -> Child:
        extra = dict(CHILD_ENV)
        extra["FLOW_RUNTIME_VIEW_FILE"] = view_file(self.tmp)
        extra["FLOW_DB_AUTO_MIGRATE"] = "false"
        extra["FLOW_CRASH_STEP_ENTRY_FILE"] = str(self.entries_file)
        extra.update(env or {})
        if crash_at:
            extra["FLOW_CRASH_AT"] = crash_at
            extra["FLOW_CRASH_MARKER_FILE"] = str(self.marker)
        port = free_port()
        child_env = service_env(self.tmp, "runtime", port, db_url=self.db_url, extra=extra)
        log_path = self.tmp / f"child{len(self.children)}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in Child.stop()
        proc = subprocess.Popen(
            [sys.executable, "-m", RUNTIME_MODULE, command],
            cwd=ROOT,
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        child = Child(proc, log_path, log, port)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in self.children:
            child.stop()


@pytest.fixture
def crash_db_url(db_url: str) -> str:
    """The test database (``sqlite`` and ``mariadb``), migrated."""
    if db_url.startswith("sqlite"):
        Path(db_url.split("///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(migrate.upgrade(db_url, "runtime_svc"))
    return db_url


@pytest.fixture
def harness(tmp_path: Path, crash_db_url: str) -> Iterator[Harness]:
    h = Harness(tmp_path, crash_db_url)
    try:
        yield h
    finally:
        h.stop_all()


@pytest.fixture
async def engine(crash_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(crash_db_url, pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
def store(engine: AsyncEngine) -> FlowRunStateStore:
    return FlowRunStateStore(engine)


__all__ = ["Child", "Harness", "os"]
