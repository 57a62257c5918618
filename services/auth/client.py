"""The client side: bearer metadata, cached credential sources, call credentials and
client interceptors that attach a credential to every call of a channel."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.config import ServiceConfig

from .credentials import mint_credential
from .identity import WorkloadClaims
from .keys import load_signing_key

__all__ = [
    "CredentialCallCredentials",
    "CredentialSource",
    "bearer_client_interceptors",
    "bearer_metadata",
]


def bearer_metadata(credential: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``credential``."""
    return (("authorization", f"Bearer {credential}"),)


class CredentialSource:
    """Mints credentials for one set of claims and reuses each until it nears expiry.

    Call it to get a credential: ``source()``.
    """

    def __init__(
        self,
        private_key: Ed25519PrivateKey,
        key_id: str,
        claims: WorkloadClaims,
        *,
        ttl_s: float = 300.0,
        refresh_margin_s: float = 60.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        if refresh_margin_s >= ttl_s:
            raise ValueError("refresh_margin_s must be smaller than ttl_s")
        self._key, self._kid, self._claims = private_key, key_id, claims
        self._ttl, self._margin, self._now = ttl_s, refresh_margin_s, now
        self._credential = ""
        self._refresh_at = 0.0

    @classmethod
    def from_config(
        cls, cfg: ServiceConfig, claims: WorkloadClaims, **kwargs: Any
    ) -> CredentialSource:
        """Sign with ``cfg.auth_signing_key`` under ``cfg.auth_signing_key_id``."""
        key = load_signing_key(cfg.auth_signing_key)
        return cls(key, cfg.auth_signing_key_id, claims, **kwargs)

    def __call__(self) -> str:
        now = self._now()
        if now >= self._refresh_at:
            self._credential = mint_credential(
                self._key, self._kid, self._claims, ttl_s=self._ttl, now=now
            )
            self._refresh_at = now + self._ttl - self._margin
        return self._credential


class CredentialCallCredentials(grpc.AuthMetadataPlugin):  # type: ignore[misc]
    """``grpc.metadata_call_credentials(CredentialCallCredentials(source))`` for TLS channels."""

    def __init__(self, source: Callable[[], str]) -> None:
        self._source = source

    def __call__(self, context: Any, callback: Any) -> None:
        try:
            callback(bearer_metadata(self._source()), None)
        except Exception as exc:  # reported to the call as UNAVAILABLE by grpc
            callback((), exc)


class _BearerInterceptor:
    def __init__(self, source: Callable[[], str]) -> None:
        self._source = source

    def _details(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata.from_tuple(
            (*tuple(details.metadata or ()), *bearer_metadata(self._source()))
        )
        return details._replace(metadata=metadata)


class _UnaryUnary(_BearerInterceptor, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_BearerInterceptor, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_BearerInterceptor, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStream(_BearerInterceptor, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def bearer_client_interceptors(source: Callable[[], str]) -> list[Any]:
    """Client interceptors adding ``authorization: Bearer`` to every call of a channel.

    Works on insecure loopback channels too (call credentials need TLS):
    ``grpc.aio.insecure_channel(target, interceptors=bearer_client_interceptors(source))``.
    One object per call shape, because a ``grpc.aio`` channel files each interceptor
    under the first shape it implements only.
    """
    return [_UnaryUnary(source), _UnaryStream(source), _StreamUnary(source), _StreamStream(source)]
