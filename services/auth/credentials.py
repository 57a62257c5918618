"""Workload credentials: minting and verification.

Format (see :mod:`services.auth`)::

    nfw1.<b64url(header json)>.<b64url(claims json)>.<b64url(Ed25519 signature)>

The signature covers the ASCII text ``nfw1.<header>.<claims>``; JSON is canonical
(``services.digest.canonical_json``) and base64url has no padding.

A verifier remembers the credentials it accepted (a bounded, least-recently-used map
from the exact credential text to the identity it proved): a caller reuses one credential
per scope until near its expiry (``services.peer_client.ScopedCredentials``), so the
signature of a byte-identical credential is checked once, not on every call. The time
checks (expiry, not-yet-valid) run on every use; everything else a verification decides
is a function of the credential text and the verifier's fixed trusted keys and audience.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from services.config import ServiceConfig, ServiceName
from services.digest import canonical_json

from .identity import AuthFailure, TrustedIdentity, WorkloadClaims, opt_str, refuse, scope_from
from .keys import load_trusted_keys
from .trust import TrustedKey

__all__ = ["CREDENTIAL_PREFIX", "CredentialVerifier", "mint_credential"]

CREDENTIAL_PREFIX = "nfw1"
_ALG = "EdDSA"
_MAX_CREDENTIAL_CHARS = 8192
#: Accepted credentials a verifier remembers (each at most ``_MAX_CREDENTIAL_CHARS``).
_REMEMBERED = 1024
_B64URL_RE = re.compile(r"^[A-Za-z0-9_-]*$")


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    if not _B64URL_RE.match(text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _strict_json(data: bytes) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise ValueError("duplicate key")
        return out

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not allowed")

    return json.loads(data, object_pairs_hook=no_duplicates, parse_constant=no_constants)


def mint_credential(
    private_key: Ed25519PrivateKey,
    key_id: str,
    claims: WorkloadClaims,
    *,
    ttl_s: float,
    now: float | None = None,
) -> str:
    """Sign ``claims`` into a credential valid from ``now`` for ``ttl_s`` seconds."""
    if not key_id:
        raise ValueError("key_id must not be empty")
    iat = int(time.time() if now is None else now)
    body = claims.to_json() | {"iat": iat, "exp": iat + max(1, int(ttl_s))}
    header = {"alg": _ALG, "kid": key_id}
    signing_input = ".".join(
        (CREDENTIAL_PREFIX, _b64e(canonical_json(header)), _b64e(canonical_json(body)))
    )
    return f"{signing_input}.{_b64e(private_key.sign(signing_input.encode('ascii')))}"


class CredentialVerifier:
    """Verifies credentials for one service audience against a set of trusted keys."""

    def __init__(
        self,
        trusted_keys: Mapping[str, TrustedKey | Ed25519PublicKey],
        audience: ServiceName | str,
        *,
        clock_skew_s: float = 30.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        # A bare public key (tests, the deprecated file form) is unconstrained.
        self._keys = {
            kid: key if isinstance(key, TrustedKey) else TrustedKey(key)
            for kid, key in trusted_keys.items()
        }
        self._audience = audience.value if isinstance(audience, ServiceName) else audience
        self._skew = clock_skew_s
        self._now = now
        #: Credential text → the identity it proved (see the module docstring).
        self._accepted: OrderedDict[str, TrustedIdentity] = OrderedDict()

    @classmethod
    def from_config(cls, cfg: ServiceConfig) -> CredentialVerifier:
        """Trust ``cfg.auth_trusted_keys`` for audience ``cfg.service`` (the deprecated
        unconstrained file form only outside production)."""
        return cls(
            load_trusted_keys(cfg.auth_trusted_keys, allow_unconstrained=not cfg.is_production),
            cfg.service,
            clock_skew_s=cfg.auth_clock_skew_s,
        )

    def verify(self, credential: str | None) -> TrustedIdentity:
        """Check ``credential`` and return the identity it proves.

        Raises:
            UnauthenticatedError: with the :class:`AuthFailure` value as ``reason``.
        """
        if not credential:
            raise refuse(AuthFailure.MISSING)
        known = self._accepted.get(credential)
        if known is not None:
            self._check_times(known, credential)
            self._accepted.move_to_end(credential)
            return known
        identity = self._verify(credential)
        self._accepted[credential] = identity
        if len(self._accepted) > _REMEMBERED:
            self._accepted.popitem(last=False)
        return identity

    def _check_times(self, identity: TrustedIdentity, credential: str) -> None:
        now = self._now()
        if now > identity.expires_at + self._skew:
            self._accepted.pop(credential, None)
            raise refuse(AuthFailure.EXPIRED)
        if identity.issued_at > now + self._skew:
            raise refuse(AuthFailure.NOT_YET_VALID)

    def _verify(self, credential: str) -> TrustedIdentity:
        parts = credential.split(".")
        if len(credential) > _MAX_CREDENTIAL_CHARS or len(parts) != 4:
            raise refuse(AuthFailure.MALFORMED)
        if parts[0] != CREDENTIAL_PREFIX:
            raise refuse(AuthFailure.MALFORMED)
        try:
            header = _strict_json(_b64d(parts[1]))
            signature = _b64d(parts[3])
        except ValueError:
            raise refuse(AuthFailure.MALFORMED) from None
        if not isinstance(header, dict) or header.get("alg") != _ALG:
            raise refuse(AuthFailure.MALFORMED)
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise refuse(AuthFailure.MALFORMED)
        trusted = self._keys.get(kid)
        if trusted is None:
            raise refuse(AuthFailure.UNKNOWN_KEY)
        try:
            trusted.public_key.verify(
                signature, f"{parts[0]}.{parts[1]}.{parts[2]}".encode("ascii")
            )
        except InvalidSignature:
            raise refuse(AuthFailure.BAD_SIGNATURE) from None
        try:
            identity = _identity_from_claims(_strict_json(_b64d(parts[2])), kid)
        except ValueError:
            raise refuse(AuthFailure.MALFORMED) from None
        self._check_times(identity, credential)
        if self._audience not in identity.audiences:
            raise refuse(AuthFailure.WRONG_AUDIENCE)
        exceeded = trusted.constraints.exceeded_by(
            identity.org_id, identity.audiences, identity.roles
        )
        if exceeded:
            error = refuse(AuthFailure.KEY_CONSTRAINTS)
            error.attributes["claim"] = exceeded
            raise error
        return identity


def _str_list(value: object, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name} must be a list of non-empty strings")
    return tuple(value)


def _int_claim(claims: dict[str, Any], name: str) -> int:
    value = claims.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer")
    return value


def _identity_from_claims(claims: Any, kid: str) -> TrustedIdentity:
    if not isinstance(claims, dict):
        raise ValueError("claims must be an object")
    sub = opt_str("sub", claims.get("sub"))
    if sub is None:
        raise ValueError("sub is required")
    iat, exp = _int_claim(claims, "iat"), _int_claim(claims, "exp")
    if exp <= iat:
        raise ValueError("exp must be after iat")
    audiences = _str_list(claims.get("aud"), "aud")
    if not audiences:
        raise ValueError("aud must not be empty")
    scope = scope_from(
        claims.get("org_id"),
        claims.get("app_installation_id"),
        claims.get("runtime_capability_id"),
        claims.get("runtime_work_binding_digest"),
    )
    return TrustedIdentity(
        subject=sub,
        audiences=audiences,
        org=scope.org,
        runtime_capability_id=scope.runtime_capability_id,
        work_scope=scope.work_scope,
        roles=frozenset(_str_list(claims.get("roles", []), "roles")),
        key_id=kid,
        issued_at=iat,
        expires_at=exp,
    )
