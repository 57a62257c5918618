"""The one factory of client channels between the services (ARCHITECTURE §3, §4).

Every inter-service call — runtime → catalog today, runtime → effect owner and effect
owner → runtime as they land — dials through :func:`client_channel`, so each honours the
same client-side TLS/mTLS settings and message limits::

    channel = client_channel(cfg.catalog_target, cfg, audience=ServiceName.CATALOG)
    channel = client_channel(target, cfg, audience=ServiceName.RUNTIME, credentials=source)

``cfg`` (:class:`~services.config.ServiceConfig` of the *calling* process) decides:

* **TLS** when ``FLOW_CLIENT_TLS`` is true or a client CA/certificate is configured:
  the server certificate is verified against ``FLOW_CLIENT_TLS_CA`` (system roots when
  unset) and, when set, ``FLOW_CLIENT_TLS_SERVER_NAME`` is the name expected in it;
* **mTLS** when ``FLOW_CLIENT_TLS_CERT``/``FLOW_CLIENT_TLS_KEY`` are set: that
  certificate is presented to servers that require client certificates
  (``FLOW_TLS_CLIENT_CA`` on their side);
* **plaintext** otherwise (development, loopback, or a mesh that provides mTLS);
* message limits both ways: ``FLOW_GRPC_MAX_MESSAGE_BYTES``;
* tracing (``FLOW_OTEL_ENABLED``): OpenTelemetry client interceptors, so every call is a
  CLIENT span and carries the W3C trace context to the callee (:func:`tracing_interceptors`).

``credentials`` (optional) is a credential source (``services.auth.CredentialSource``
or any ``() -> str``) sent as ``authorization: Bearer`` on every call: as call
credentials over TLS, as client interceptors on plaintext channels (gRPC refuses call
credentials on insecure channels). Callers that need one credential *per call* (the
runtime mints one per trusted work scope) leave it out and pass metadata per call.

``audience`` names the service being dialled. It selects nothing today beyond the
error text, but it is part of the API so that per-audience settings (a server name or
CA per target service) can be added without touching the callers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from services.auth import bearer_client_interceptors, channel_credentials
from services.config import ConfigError, ServiceConfig, ServiceName
from services.telemetry import configure_tracing

__all__ = ["channel_options", "client_channel", "tracing_interceptors", "uses_tls"]


def uses_tls(cfg: ServiceConfig) -> bool:
    """Whether channels built from ``cfg`` are TLS channels."""
    return cfg.client_tls


def channel_options(cfg: ServiceConfig) -> list[tuple[str, Any]]:
    """The channel arguments every inter-service channel of ``cfg`` carries."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", cfg.grpc_max_message_bytes),
        ("grpc.max_receive_message_length", cfg.grpc_max_message_bytes),
    ]
    if cfg.client_tls and cfg.client_tls_server_name:
        options.append(("grpc.ssl_target_name_override", cfg.client_tls_server_name))
    return options


def client_channel(
    target: str,
    cfg: ServiceConfig,
    *,
    audience: ServiceName,
    credentials: Callable[[], str] | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel from this process to the ``audience`` service at ``target``.

    Args:
        target: ``host:port`` of the service.
        cfg: the calling process's configuration (TLS, mTLS, message limits).
        audience: the service dialled.
        credentials: a credential source attached to every call (see module docstring).
        options: extra channel arguments (appended after the standard ones).

    Raises:
        ConfigError: a configured CA, certificate or key file cannot be read.
    """
    if not target:
        raise ConfigError(f"no target configured for the {audience.value} service")
    all_options = [*channel_options(cfg), *options]
    traced = tracing_interceptors(cfg)
    if not cfg.client_tls:
        bearer = bearer_client_interceptors(credentials) if credentials else []
        interceptors = [*traced, *bearer] or None
        return grpc.aio.insecure_channel(target, options=all_options, interceptors=interceptors)
    try:
        tls = channel_credentials(
            root_ca=cfg.client_tls_ca,
            client_cert=cfg.client_tls_cert,
            client_key=cfg.client_tls_key,
            call_credentials=credentials,
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot read the client TLS material for the {audience.value} channel: "
            f"{type(exc).__name__} ({getattr(exc, 'filename', '')})"
        ) from exc
    return grpc.aio.secure_channel(target, tls, options=all_options, interceptors=traced or None)


def tracing_interceptors(cfg: ServiceConfig) -> list[Any]:
    """The OpenTelemetry client interceptors of ``cfg`` (none when tracing is off): one
    CLIENT span per call whose W3C ``traceparent`` travels in the call's metadata, so the
    callee's server span continues the caller's trace."""
    provider = configure_tracing(cfg)
    if provider is None:
        return []
    return list(aio_client_interceptors(tracer_provider=provider))  # type: ignore[no-untyped-call]
