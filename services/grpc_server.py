"""The one gRPC server bootstrap shared by the three services (STYLE 11).

:func:`start_server` builds a ``grpc.aio`` server with, outermost first::

    OpenTelemetry (when cfg.otel_enabled)  one span per RPC, sees the final status; the
                                           span continues the caller's W3C traceparent
                                           (``services.telemetry`` sets the provider up)
    ErrorMappingInterceptor                FlowError / anything else -> status (+ detail);
                                           malformed request -> INVALID_ARGUMENT, response
                                           over the message limit -> OUT_OF_RANGE
    AuthInterceptor                        credential -> identity, request-scope check
    RequestLimitsInterceptor               documented lengths, enums, times, nesting

so every ``FlowError`` — from a servicer or from authentication — is mapped by the one
function in ``services.errors``, and the span records the status the client sees.
It registers the standard health service (``""`` and every service SERVING) and
server reflection (v1alpha, the protocol grpcio-reflection serves), applies the
message-size limit both ways, binds ``cfg.listen_host:cfg.port`` (port 0 picks a free
port, read back from :attr:`RunningServer.port`) with TLS or mTLS when configured, and
refuses to start in production while a fault hook is set.

Shutdown (:meth:`RunningServer.stop`, SIGTERM/SIGINT via
:func:`install_signal_handlers`) first flips health to NOT_SERVING, so load balancers
stop routing, then stops accepting RPCs and gives in-flight ones ``grace`` seconds.

Outside production, when the trusted-keys file is the default one under
``FLOW_DATA_DIR``, development keys are generated or completed
(``services.auth.ensure_dev_keys``) so that ``make run`` needs no set-up.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor

from services import faults
from services.auth import (
    TRUSTED_KEYS_FILE,
    AuthInterceptor,
    CredentialVerifier,
    ensure_dev_keys,
    server_credentials,
)
from services.config import ServiceConfig
from services.errors import ErrorMappingInterceptor
from services.request_limits import RequestLimitsInterceptor
from services.telemetry import configure_tracing

__all__ = [
    "RunningServer",
    "ServiceRegistration",
    "install_signal_handlers",
    "serve_forever",
    "start_server",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceRegistration:
    """One gRPC service to serve.

    Attributes:
        name: full service name (``nexus.flow.runtime.v1.RuntimeService``), used for
            health and reflection.
        add_to_server: the generated ``add_<Service>Servicer_to_server`` (or any
            ``(servicer, server) -> None`` that registers handlers).
        servicer: the servicer instance.
    """

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


@dataclass
class RunningServer:
    """A started server; :meth:`stop` is idempotent."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    shutdown_grace_s: float
    _stopping: asyncio.Task[None] | None = field(default=None, repr=False)

    async def stop(self, grace: float | None = None) -> None:
        """Flip health to NOT_SERVING, then stop with ``grace`` seconds for in-flight RPCs.

        Args:
            grace: seconds in-flight RPCs may take (default ``cfg.shutdown_grace_s``;
                0 cancels them at once). Later calls wait for the first one.
        """
        if self._stopping is None:
            self._stopping = asyncio.create_task(
                self._drain(self.shutdown_grace_s if grace is None else grace)
            )
        await asyncio.shield(self._stopping)

    async def _drain(self, grace: float) -> None:
        # Permanently NOT_SERVING for "" and every service, watchers are notified.
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        """Return once the server has stopped."""
        await self.server.wait_for_termination()


def _verifier(cfg: ServiceConfig) -> CredentialVerifier:
    default = cfg.data_dir / "auth" / TRUSTED_KEYS_FILE
    if not cfg.is_production and cfg.auth_trusted_keys == default:
        # Creates the development keys on first start and migrates a trusted-keys file an
        # earlier version wrote (services.auth.trust); idempotent.
        ensure_dev_keys(cfg.data_dir, env=cfg.env, key_id=cfg.auth_signing_key_id)
    return CredentialVerifier.from_config(cfg)


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


async def start_server(
    cfg: ServiceConfig,
    services: Sequence[ServiceRegistration],
    *,
    verifier: CredentialVerifier | None = None,
) -> RunningServer:
    """Build, bind and start the server for ``services`` (see module docstring).

    Args:
        cfg: the service configuration.
        services: the services to register.
        verifier: credential verifier; default trusts ``cfg.auth_trusted_keys`` for the
            audience ``cfg.service``.

    Raises:
        faults.FaultHookError: production with a fault hook set.
        services.config.ConfigError: trusted keys or TLS files cannot be read.
        RuntimeError: the address cannot be bound.
    """
    faults.assert_hooks_allowed(cfg.env, crash_at=cfg.crash_at)
    names = tuple(s.name for s in services)
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate service names in {names}")

    interceptors: list[grpc.aio.ServerInterceptor] = []
    provider = configure_tracing(cfg)
    if provider is not None:
        interceptors.append(aio_server_interceptor(tracer_provider=provider))  # type: ignore[no-untyped-call]
    interceptors += [
        ErrorMappingInterceptor(max_response_bytes=cfg.grpc_max_message_bytes),
        AuthInterceptor(verifier or _verifier(cfg)),
        RequestLimitsInterceptor(),
    ]

    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", cfg.grpc_max_message_bytes),
            ("grpc.max_receive_message_length", cfg.grpc_max_message_bytes),
            # A second process on the same fixed port must fail, not share the traffic.
            ("grpc.so_reuseport", 0),
        ],
    )
    for registration in services:
        registration.add_to_server(registration.servicer, server)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    address = _address(cfg.listen_host, cfg.port)
    tls = server_credentials(cfg)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls)
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    await server.start()
    faults.crash_point(faults.CrashPoint.SERVER_STARTED)
    return RunningServer(server, port, health_servicer, names, cfg.shutdown_grace_s)


def install_signal_handlers(
    loop: asyncio.AbstractEventLoop, running: RunningServer, grace: float
) -> None:
    """Drain ``running`` gracefully on SIGTERM or SIGINT."""
    tasks: set[asyncio.Task[None]] = set()

    def on_signal(sig: signal.Signals) -> None:
        _log.info("%s received; draining with %.1fs grace", sig.name, grace)
        task = loop.create_task(running.stop(grace))
        tasks.add(task)  # keep a reference until done
        task.add_done_callback(tasks.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def serve_forever(
    cfg: ServiceConfig,
    services: Sequence[ServiceRegistration],
    on_started: Callable[[RunningServer], Awaitable[None] | None] | None = None,
) -> None:
    """Start, log ``"<service> serving on host:port"``, and run until stopped by a signal.

    Args:
        cfg: the service configuration.
        services: the services to register.
        on_started: called (and awaited, if it returns an awaitable) once serving.
    """
    running = await start_server(cfg, services)
    loop = asyncio.get_running_loop()
    _log.info("%s serving on %s", cfg.service.value, _address(cfg.listen_host, running.port))
    install_signal_handlers(loop, running, cfg.shutdown_grace_s)
    try:
        if on_started is not None:
            result = on_started(running)
            if inspect.isawaitable(result):
                await result
        await running.wait_for_termination()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await running.stop()
