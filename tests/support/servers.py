"""The one harness behind every in-process server test: services started with the
production bootstrap (``services.grpc_server.start_server``: error mapping, real credential
verification, request-scope checks) in a background thread with its own event loop, so
tests call them with plain synchronous gRPC stubs exactly as any client would.

A harness subclasses :class:`BackgroundServers` and implements :meth:`~BackgroundServers.serve`:
create engines, start servers on port 0, record their ports, ``await self.serving()``
(which marks the harness ready and returns once :meth:`~BackgroundServers.stop` is called),
stop the servers, dispose the engines. ``start()`` waits (bounded) for readiness and
re-raises a start-up failure; ``stop()`` is idempotent.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.auth import WorkloadClaims, bearer_metadata, mint_credential
from services.config import ServiceConfig, ServiceName, load_config
from services.errors import ERROR_DETAIL_METADATA_KEY
from services.proto import common_v1

__all__ = [
    "START_TIMEOUT_S",
    "BackgroundServers",
    "Scope",
    "error_detail",
    "new_id",
    "workload_metadata",
]

#: How long :meth:`BackgroundServers.start` waits for the servers.
START_TIMEOUT_S = 60.0


class BackgroundServers:
    """Servers in a background event loop (see the module docstring).

    Args:
        data_dir: the services' ``FLOW_DATA_DIR``.
        env: further configuration variables (database URLs, …) of every service.
        name: the thread name.
    """

    def __init__(self, data_dir: Path, env: Mapping[str, str], *, name: str = "servers") -> None:
        self.data_dir = data_dir
        self._env = dict(env)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    async def serve(self) -> None:
        """Start the servers, ``await self.serving()``, stop them (subclasses)."""
        raise NotImplementedError

    async def serving(self) -> None:
        """Mark the servers ready; return once :meth:`stop` was called."""
        if self._stop is None:
            raise RuntimeError("serving() outside serve()")
        self._ready.set()
        await self._stop.wait()

    def cfg(self, service: ServiceName) -> ServiceConfig:
        """The configuration of ``service``: test env, port 0, OpenTelemetry off."""
        return load_config(
            service,
            {
                "FLOW_ENV": "test",
                "FLOW_DATA_DIR": str(self.data_dir),
                "FLOW_RUNTIME_PORT": "0",
                "FLOW_CATALOG_PORT": "0",
                "FLOW_EFFECT_PORT": "0",
                "FLOW_OTEL_ENABLED": "false",
                **self._env,
            },
        )

    def start(self) -> Self:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise AssertionError("servers did not start")
        if self._error is not None:
            raise AssertionError(f"servers failed: {self._error!r}") from self._error
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.serve()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


def new_id(prefix: str) -> str:
    """A fresh identifier (org, request, record …) with a readable prefix."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def error_detail(err: grpc.RpcError) -> common_v1.ErrorDetail:
    """The typed detail the error interceptor attaches to every non-OK status."""
    for key, value in err.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_DETAIL_METADATA_KEY:
            return common_v1.ErrorDetail.FromString(value)
    raise AssertionError("no error detail")


@dataclass(frozen=True)
class Scope:
    """A complete trusted work scope as the tests hold it."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str

    def proto(self) -> common_v1.TrustedRuntimeWorkScope:
        return common_v1.TrustedRuntimeWorkScope(
            org_id=self.org_id,
            app_installation_id=self.app_installation_id,
            runtime_capability_id=self.runtime_capability_id,
            runtime_work_binding_digest=self.runtime_work_binding_digest,
        )


def workload_metadata(
    private_key: Ed25519PrivateKey,
    key_id: str,
    audience: ServiceName,
    org: str,
    inst: str | None = None,
    cap: str | None = None,
    digest: str | None = None,
    *,
    subject: str = "test",
    roles: Sequence[str] = (),
) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying a fresh workload credential for the (partial) scope."""
    claims = WorkloadClaims(
        subject=subject,
        audiences=(audience,),
        org_id=org,
        app_installation_id=inst,
        runtime_capability_id=cap,
        runtime_work_binding_digest=digest,
        roles=tuple(roles),
    )
    return bearer_metadata(mint_credential(private_key, key_id, claims, ttl_s=300))
