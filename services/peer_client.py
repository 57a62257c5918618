"""Calling another service of this deployment: per-scope workload credentials, the
client channel, and the typed reason of a refused call.

* :class:`ScopedCredentials` — one credential per complete trusted work scope (the
  callee answers a call in another scope like a missing row), for a given audience,
  subject and roles; each is minted once and reused until near expiry.
* :func:`peer_channel` — the ``grpc.aio`` channel to a peer target, through the one
  inter-service channel factory (:func:`services.channels.client_channel`: client
  TLS/mTLS, message limits).
* :func:`rpc_error_reason` — the ``ErrorDetail.code`` a peer's error interceptor attached
  (``services.errors``), e.g. ``handoff_rejected``; ``""`` when absent;
  :data:`TRANSIENT_STATUS_CODES` — after which the same request may be sent again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.auth import (
    CredentialSource,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    load_signing_key,
)
from services.channels import client_channel
from services.config import ConfigError, ServiceConfig, ServiceName
from services.errors import ERROR_DETAIL_METADATA_KEY, UnavailableError

__all__ = ["TRANSIENT_STATUS_CODES", "ScopedCredentials", "peer_channel", "rpc_error_reason"]

_log = logging.getLogger(__name__)
_MAX_CACHED_SCOPES = 256

#: Status codes after which the *same* request may be sent again: the peer was not
#: reached, gave up, or its answer was lost (``UNKNOWN``, ``INTERNAL``); a peer not yet
#: implementing the RPC or not yet trusting our key may do so after a deployment.
TRANSIENT_STATUS_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.CANCELLED,
    }
)


class ScopedCredentials:
    """Mints (and reuses until near expiry) one credential per trusted work scope.

    Args:
        private_key: the signing key, or its PEM path (read on first use: a development
            server creates its keys only when it starts serving).
        key_id: the key id written into credentials.
        audience: the callee.
        subject: this workload's name.
        roles: roles every credential carries.
    """

    def __init__(
        self,
        private_key: Ed25519PrivateKey | Path,
        key_id: str,
        *,
        audience: ServiceName,
        subject: str,
        roles: Sequence[str] = (),
    ) -> None:
        self._key, self._kid = private_key, key_id
        self._audience, self._subject, self._roles = audience, subject, tuple(roles)
        self._sources: OrderedDict[TrustedRuntimeWorkScope, CredentialSource] = OrderedDict()

    @classmethod
    def from_config(
        cls, cfg: ServiceConfig, *, audience: ServiceName, subject: str, roles: Sequence[str] = ()
    ) -> ScopedCredentials:
        """Sign with this service's own key (``cfg.auth_service_key`` under
        ``cfg.auth_service_key_id``), whose trusted-keys entry limits it to the audiences
        and roles the service's calls need — never the operator key."""
        return cls(
            cfg.auth_service_key,
            cfg.auth_service_key_id,
            audience=audience,
            subject=subject,
            roles=roles,
        )

    def __call__(self, scope: TrustedRuntimeWorkScope) -> str:
        """A valid credential for ``scope``.

        Raises:
            UnavailableError: the service key cannot be read (a deployment fault, not the
                caller's: the peer is unusable until it is fixed).
        """
        if isinstance(self._key, Path):
            try:
                self._key = load_signing_key(self._key)
            except ConfigError as exc:
                _log.error("cannot read this service's signing key: %s", exc)
                raise UnavailableError(
                    f"this service cannot sign its calls to the {self._audience.value} service",
                    reason="service_key_unreadable",
                ) from exc
        source = self._sources.get(scope)
        if source is None:
            claims = WorkloadClaims(
                subject=self._subject,
                audiences=(self._audience,),
                org_id=scope.org_id,
                app_installation_id=scope.app_installation_id,
                runtime_capability_id=scope.runtime_capability_id,
                runtime_work_binding_digest=scope.runtime_work_binding_digest,
                roles=self._roles,
            )
            source = CredentialSource(self._key, self._kid, claims)
            self._sources[scope] = source
            while len(self._sources) > _MAX_CACHED_SCOPES:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(scope)
        return source()


def peer_channel(cfg: ServiceConfig, target: str, *, audience: ServiceName) -> grpc.aio.Channel:
    """The channel to the ``audience`` service at ``target`` (see the module docstring);
    credentials are per call (one per trusted work scope, :class:`ScopedCredentials`)."""
    return client_channel(target, cfg, audience=audience)


def rpc_error_reason(exc: grpc.aio.AioRpcError) -> str:
    """The peer's ``ErrorDetail.code`` of a failed call (``""`` when none was sent)."""
    try:
        from services.proto import common_v1
    except ImportError:  # pragma: no cover - generated code missing
        return ""
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_DETAIL_METADATA_KEY and isinstance(value, bytes):
            detail: Any = common_v1.ErrorDetail()
            try:
                detail.ParseFromString(value)
            except Exception:
                return ""
            return str(detail.code)
    return ""
