"""Start service processes as children on loopback and wait for them, with bounded loops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

SERVICE_MODULES = {
    "catalog": "catalog_svc",
    "runtime": "runtime_svc",
    "effect-owner": "effect_owner_svc",
}
PORT_VARS = {
    "catalog": "FLOW_CATALOG_PORT",
    "runtime": "FLOW_RUNTIME_PORT",
    "effect-owner": "FLOW_EFFECT_PORT",
}
DB_VARS = {
    "catalog": "FLOW_CATALOG_DB_URL",
    "runtime": "FLOW_RUNTIME_DB_URL",
    "effect-owner": "FLOW_EFFECT_DB_URL",
}

T = TypeVar("T")


class ChildExitedError(AssertionError):
    """A child process exited while a test waited for it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ChildExitedError:
            raise  # the process is gone: polling longer cannot help
        except Exception as exc:
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_exc!r}")


async def assert_eventually(
    predicate: Callable[[], object],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> None:
    """Async variant: ``predicate`` may be sync or return an awaitable."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        last = result
        if result:
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def health_status(port: int, service: str = "", timeout: float = 2.0) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return int(resp.status)


@dataclass
class ServiceProcess:
    """One service running as a child process."""

    name: str
    port: int
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: object = field(default=None, repr=False)

    def start(self, extra_env: Mapping[str, str] | None = None) -> ServiceProcess:
        env = dict(self.env)
        if extra_env:
            env.update(extra_env)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", SERVICE_MODULES[self.name], "serve"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_serving(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ChildExitedError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}"
                )
            return health_status(self.port) == health_pb2.HealthCheckResponse.SERVING

        wait_until(ready, timeout=timeout, what=f"{self.name} SERVING")

    def log_text(self) -> str:
        return (
            self.log_path.read_text(encoding="utf-8", errors="replace")
            if self.log_path.exists()
            else ""
        )

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._close()

    def _close(self) -> None:
        log = self._log
        if log is not None:
            with contextlib.suppress(Exception):
                log.close()  # type: ignore[attr-defined]
            self._log = None


def service_env(
    data_dir: Path,
    name: str,
    port: int,
    *,
    db_url: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env.update(
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(data_dir),
            "FLOW_LISTEN_HOST": "127.0.0.1",
            PORT_VARS[name]: str(port),
            "FLOW_OTEL_ENABLED": "true",
            "FLOW_SHUTDOWN_GRACE_S": "5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if db_url is not None:
        env[DB_VARS[name]] = db_url
    if extra:
        env.update(extra)
    return env


@contextlib.contextmanager
def running_service(
    data_dir: Path, name: str, *, db_url: str | None = None, extra: Mapping[str, str] | None = None
) -> Iterator[ServiceProcess]:
    port = free_port()
    sp = ServiceProcess(
        name,
        port,
        service_env(data_dir, name, port, db_url=db_url, extra=extra),
        data_dir / f"{name}.log",
    )
    sp.start()
    try:
        sp.wait_serving()
        yield sp
    finally:
        sp.kill()
