"""The three services as production wires them, in one background event loop, for the
descriptor-driven fuzz test.

Each service is built by its own ``build_services`` (``catalog_svc.app``,
``runtime_svc.app``, ``effect_owner_svc.app``) over its own migrated database and served
by :func:`services.grpc_server.start_server` with the *default* verifier — the trusted
keys of ``FLOW_DATA_DIR/auth`` that ``ensure_dev_keys`` writes — so credentials,
constraints, scope checks and error mapping are the production ones. The runtime reaches
the catalog over gRPC (``FLOW_CATALOG_TARGET``) with its own service key. No background
loops run: between two calls nothing but the call itself writes, so row counts taken
before and after a refused call must be equal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from sqlalchemy import MetaData, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

import catalog_svc.app
import effect_owner_svc.app
import runtime_svc.app
from catalog_svc.schema import metadata as catalog_metadata
from effect_owner_svc.schema import metadata as effect_metadata
from runtime_svc.schema import metadata as runtime_metadata
from services import db, migrate
from services.config import ServiceConfig, ServiceName, load_config
from services.grpc_server import RunningServer, start_server

__all__ = ["FuzzEnv", "ServiceStack"]

T = TypeVar("T")
_START_TIMEOUT_S = 120.0

_BUILD = {
    ServiceName.CATALOG: (catalog_svc.app.build_services, "catalog_svc", catalog_metadata),
    ServiceName.RUNTIME: (
        runtime_svc.app.RuntimeApp().build_services,
        "runtime_svc",
        runtime_metadata,
    ),
    ServiceName.EFFECT_OWNER: (
        effect_owner_svc.app.build_services,
        "effect_owner_svc",
        effect_metadata,
    ),
}
_DB_VARS = {
    ServiceName.CATALOG: "FLOW_CATALOG_DB_URL",
    ServiceName.RUNTIME: "FLOW_RUNTIME_DB_URL",
    ServiceName.EFFECT_OWNER: "FLOW_EFFECT_DB_URL",
}


class ServiceStack:
    """Catalog, runtime and effect owner on loopback port 0; :meth:`stop` is idempotent."""

    def __init__(self, db_urls: Mapping[ServiceName, str], data_dir: Path, max_bytes: int) -> None:
        self.db_urls = dict(db_urls)
        self.data_dir = data_dir
        self.max_bytes = max_bytes
        #: The configuration of each running service, ``port`` set to the bound port.
        self.configs: dict[ServiceName, ServiceConfig] = {}
        self._servers: dict[ServiceName, RunningServer] = {}
        self._engines: dict[ServiceName, AsyncEngine] = {}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-stack", daemon=True)

    def start(self) -> ServiceStack:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise AssertionError("the service stack did not start")
        if self._error is not None:
            raise AssertionError(f"the service stack failed: {self._error!r}") from self._error
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    def _env(self, catalog_port: int) -> dict[str, str]:
        env = {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(self.data_dir),
            "FLOW_LISTEN_HOST": "127.0.0.1",
            "FLOW_CATALOG_PORT": "0",
            "FLOW_RUNTIME_PORT": "0",
            "FLOW_EFFECT_PORT": "0",
            "FLOW_CATALOG_TARGET": f"127.0.0.1:{catalog_port}",
            "FLOW_GRPC_MAX_MESSAGE_BYTES": str(self.max_bytes),
            "FLOW_OTEL_ENABLED": "false",
            "FLOW_SHUTDOWN_GRACE_S": "1",
        }
        env.update({_DB_VARS[s]: url for s, url in self.db_urls.items()})
        return env

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            catalog_port = 0
            for service in (ServiceName.CATALOG, ServiceName.RUNTIME, ServiceName.EFFECT_OWNER):
                build, package, _ = _BUILD[service]
                cfg = load_config(service, self._env(catalog_port))
                await migrate.upgrade(cfg.db_url, package)
                engine = db.create_engine(cfg.db_url, pool_size=4)
                self._engines[service] = engine
                running = await start_server(cfg, await build(cfg, engine))
                self._servers[service] = running
                self.configs[service] = dataclasses.replace(cfg, port=running.port)
                if service is ServiceName.CATALOG:
                    catalog_port = running.port
            self._ready.set()
            await self._stop.wait()
        finally:
            for running in self._servers.values():
                await running.stop(0)
            for engine in self._engines.values():
                await engine.dispose()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the stack's event loop and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout=60)

    def target(self, service: ServiceName) -> str:
        return f"127.0.0.1:{self.configs[service].port}"

    def row_counts(self) -> dict[str, int]:
        """``{"<service>.<table>": rows}`` of every table of the three databases."""

        async def counts() -> dict[str, int]:
            out: dict[str, int] = {}
            for service, (_, _, metadata) in _BUILD.items():
                out.update(await _counts(self._engines[service], metadata, service.value))
            return out

        return self.call(counts)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)


async def _counts(engine: AsyncEngine, metadata: MetaData, prefix: str) -> dict[str, int]:
    tables = sorted(metadata.tables.values(), key=lambda t: t.name)
    # One round trip: SELECT (SELECT COUNT(*) FROM a), (SELECT COUNT(*) FROM b), ...
    query = select(
        *(select(func.count()).select_from(t).scalar_subquery().label(t.name) for t in tables)
    )
    async with engine.connect() as conn:
        row: Any = (await conn.execute(query)).one()
    return {f"{prefix}.{t.name}": int(row[i]) for i, t in enumerate(tables)}


@dataclass
class FuzzEnv:
    """A running, seeded stack and what a test needs to call it."""

    stack: ServiceStack
    metadata: tuple[tuple[str, str], ...]
    known: dict[str, list[Any]]
    special: dict[str, list[Message]]
    channels: dict[ServiceName, grpc.Channel]
