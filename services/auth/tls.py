"""TLS and mutual TLS credentials of servers and client channels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc

from services.config import ServiceConfig

from .client import CredentialCallCredentials

__all__ = ["channel_credentials", "server_credentials"]


def server_credentials(cfg: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS server credentials from ``cfg`` (None when TLS is off).

    With ``cfg.tls_client_ca`` the server requires and verifies client certificates
    (mTLS). The workload credential is still required on top: mTLS proves the peer
    is a workload of this deployment, the credential says which one and for what org.
    """
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    pair = [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())]
    if cfg.tls_client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(
        pair, root_certificates=cfg.tls_client_ca.read_bytes(), require_client_auth=True
    )


def channel_credentials(
    *,
    root_ca: Path | None = None,
    client_cert: Path | None = None,
    client_key: Path | None = None,
    call_credentials: Callable[[], str] | None = None,
) -> grpc.ChannelCredentials:
    """Client TLS (optionally mTLS) credentials, optionally with a credential source.

    Args:
        root_ca: CA bundle that signed the server certificate (None: system roots).
        client_cert: client certificate PEM for mTLS (with ``client_key``).
        client_key: client private key PEM.
        call_credentials: a credential source (e.g. :class:`CredentialSource`) sent as
            the bearer credential on every call.
    """
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key must be given together")
    creds = grpc.ssl_channel_credentials(
        root_certificates=root_ca.read_bytes() if root_ca else None,
        private_key=client_key.read_bytes() if client_key else None,
        certificate_chain=client_cert.read_bytes() if client_cert else None,
    )
    if call_credentials is None:
        return creds
    return grpc.composite_channel_credentials(
        creds, grpc.metadata_call_credentials(CredentialCallCredentials(call_credentials))
    )
