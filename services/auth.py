"""Trusted workload authentication (ARCHITECTURE §3).

A caller authenticates as a *workload* with a signed, expiring credential sent as
gRPC metadata ``authorization: Bearer <credential>``::

    nfw1.<b64url(header json)>.<b64url(claims json)>.<b64url(Ed25519 signature)>

    header  {"alg": "EdDSA", "kid": <issuer key id>}
    claims  {"sub": workload, "aud": ["catalog" | "runtime" | "effect-owner", ...],
             "iat": int, "exp": int, "org_id": str,
             "app_installation_id"?, "runtime_capability_id"?,
             "runtime_work_binding_digest"?, "roles"?: [str]}

The signature covers the ASCII text ``nfw1.<header>.<claims>``; JSON is canonical
(``services.digest.canonical_json``) and base64url has no padding. Scope claims nest:
``runtime_capability_id`` needs ``app_installation_id`` and
``runtime_work_binding_digest`` needs ``runtime_capability_id``.

Server side, :class:`AuthInterceptor` verifies the credential with a
:class:`CredentialVerifier` (its failures are :class:`UnauthenticatedError` with
distinct :class:`AuthFailure` reasons), then inspects every deserialized request
message before the servicer sees it (:func:`check_request_scope`). The rule is:

* a top-level non-repeated ``string org_id`` that is non-empty must equal the trusted org;
* a set top-level message field ``scope``: each of its non-empty string components
  ``org_id``, ``app_installation_id``, ``runtime_capability_id``,
  ``runtime_work_binding_digest`` must equal the trusted one; a component the
  credential does not carry cannot be confirmed and is therefore rejected too;
* a set top-level message field ``binding`` (a ``RuntimeWorkBinding``): the same rule
  for the components it has (``org_id``, ``app_installation_id``,
  ``runtime_capability_id``).

Any disagreement is ``PERMISSION_DENIED``; a body value is never *used* as scope.
Deeper fields are the servicer's job (it reads :func:`current_identity`). Streaming
requests are checked message by message, so request-streaming servicers must consume
the request iterator argument, not ``context.read()``.

Interceptor order: ``[ErrorMappingInterceptor(), AuthInterceptor(verifier)]`` — the
error interceptor is outermost, so the ``FlowError`` raised here is mapped by the one
mapping in ``services.errors``. Health and reflection are exempt (probes and grpcurl
must work without a credential); mTLS, when configured, still guards them.

Nothing here logs metadata or credentials.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import grpc.aio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.config import ConfigError, ServiceConfig, ServiceName
from services.digest import canonical_json, is_digest
from services.errors import (
    Behavior,
    Context,
    PermissionDeniedError,
    UnauthenticatedError,
    call_unary,
    iterate_responses,
    wrap_method_handler,
)

__all__ = [
    "CREDENTIAL_PREFIX",
    "DEV_SIGNING_KEY_FILE",
    "EXEMPT_METHOD_PREFIXES",
    "TRUSTED_KEYS_FILE",
    "AuthFailure",
    "AuthInterceptor",
    "CredentialCallCredentials",
    "CredentialSource",
    "CredentialVerifier",
    "DevKeyFiles",
    "TrustedIdentity",
    "TrustedOrgContext",
    "TrustedRuntimeWorkScope",
    "WorkloadClaims",
    "bearer_client_interceptors",
    "bearer_metadata",
    "channel_credentials",
    "check_request_scope",
    "current_identity",
    "ensure_dev_keys",
    "generate_keypair",
    "identity_context",
    "load_signing_key",
    "load_trusted_keys",
    "mint_credential",
    "server_credentials",
]

CREDENTIAL_PREFIX = "nfw1"
_ALG = "EdDSA"
_MAX_CREDENTIAL_CHARS = 8192
_B64URL_RE = re.compile(r"^[A-Za-z0-9_-]*$")

#: Methods reachable without a credential.
EXEMPT_METHOD_PREFIXES: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

DEV_SIGNING_KEY_FILE = "dev_signing_key.pem"
TRUSTED_KEYS_FILE = "trusted_keys.json"


class AuthFailure(StrEnum):
    """Why a credential was refused; the value is the ``ErrorDetail.code`` sent back."""

    MISSING = "credential_missing"
    MALFORMED = "credential_malformed"
    UNKNOWN_KEY = "credential_unknown_key"
    BAD_SIGNATURE = "credential_bad_signature"
    EXPIRED = "credential_expired"
    NOT_YET_VALID = "credential_not_yet_valid"
    WRONG_AUDIENCE = "credential_wrong_audience"


_FAILURE_MESSAGES: Mapping[AuthFailure, str] = {
    AuthFailure.MISSING: "workload credential missing",
    AuthFailure.MALFORMED: "workload credential malformed",
    AuthFailure.UNKNOWN_KEY: "workload credential signed by an untrusted key",
    AuthFailure.BAD_SIGNATURE: "workload credential signature invalid",
    AuthFailure.EXPIRED: "workload credential expired",
    AuthFailure.NOT_YET_VALID: "workload credential not yet valid",
    AuthFailure.WRONG_AUDIENCE: "workload credential not issued for this service",
}


def _refuse(failure: AuthFailure) -> UnauthenticatedError:
    return UnauthenticatedError(_FAILURE_MESSAGES[failure], reason=failure.value)


# --- trusted values ---------------------------------------------------------------


@dataclass(frozen=True)
class TrustedOrgContext:
    """The org (and optionally the app installation) the caller is trusted for."""

    org_id: str
    app_installation_id: str | None = None


@dataclass(frozen=True)
class TrustedRuntimeWorkScope:
    """A complete runtime work scope carried by the credential."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str


@dataclass(frozen=True)
class TrustedIdentity:
    """A verified workload credential.

    Scope components nest: org ⊇ app installation ⊇ runtime capability ⊇ binding
    digest; ``work_scope`` is set only when all four are carried.
    """

    subject: str
    audiences: tuple[str, ...]
    org: TrustedOrgContext
    runtime_capability_id: str | None
    work_scope: TrustedRuntimeWorkScope | None
    roles: frozenset[str]
    key_id: str
    issued_at: int
    expires_at: int

    @property
    def org_id(self) -> str:
        return self.org.org_id

    def scope_components(self) -> dict[str, str | None]:
        """The trusted value of each scope component (None when not carried)."""
        return {
            "org_id": self.org.org_id,
            "app_installation_id": self.org.app_installation_id,
            "runtime_capability_id": self.runtime_capability_id,
            "runtime_work_binding_digest": (
                self.work_scope.runtime_work_binding_digest if self.work_scope else None
            ),
        }

    def require_work_scope(self) -> TrustedRuntimeWorkScope:
        """The complete work scope, for servicers of work-scoped RPCs.

        Raises:
            PermissionDeniedError: the credential carries no complete work scope.
        """
        if self.work_scope is None:
            raise PermissionDeniedError(
                "the workload credential carries no runtime work scope", reason="scope_mismatch"
            )
        return self.work_scope


@dataclass(frozen=True)
class WorkloadClaims:
    """What a credential asserts, before it is signed (see module docstring).

    Raises:
        ValueError: on construction, when a claim is empty or the scope is partial.
    """

    subject: str
    audiences: tuple[ServiceName, ...]
    org_id: str
    app_installation_id: str | None = None
    runtime_capability_id: str | None = None
    runtime_work_binding_digest: str | None = None
    roles: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.subject:
            raise ValueError("subject must not be empty")
        if not self.audiences or not all(isinstance(a, ServiceName) for a in self.audiences):
            raise ValueError("audiences must be a non-empty tuple of ServiceName")
        _scope_from(
            self.org_id,
            self.app_installation_id,
            self.runtime_capability_id,
            self.runtime_work_binding_digest,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sub": self.subject,
            "aud": [a.value for a in self.audiences],
            "org_id": self.org_id,
        }
        for name in ("app_installation_id", "runtime_capability_id", "runtime_work_binding_digest"):
            value = getattr(self, name)
            if value:
                out[name] = value
        if self.roles:
            out["roles"] = list(self.roles)
        return out


def _opt_str(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


class _Scope(NamedTuple):
    org: TrustedOrgContext
    runtime_capability_id: str | None
    work_scope: TrustedRuntimeWorkScope | None


def _scope_from(org_id: object, app: object, capability: object, binding_digest: object) -> _Scope:
    org_s = _opt_str("org_id", org_id)
    if org_s is None:
        raise ValueError("org_id is required")
    app_s = _opt_str("app_installation_id", app)
    cap_s = _opt_str("runtime_capability_id", capability)
    digest_s = _opt_str("runtime_work_binding_digest", binding_digest)
    if cap_s is not None and app_s is None:
        raise ValueError("runtime_capability_id needs app_installation_id")
    if digest_s is None:
        return _Scope(TrustedOrgContext(org_s, app_s), cap_s, None)
    if cap_s is None or app_s is None:
        raise ValueError("runtime_work_binding_digest needs runtime_capability_id")
    if not is_digest(digest_s):
        raise ValueError("runtime_work_binding_digest is not a digest")
    work_scope = TrustedRuntimeWorkScope(org_s, app_s, cap_s, digest_s)
    return _Scope(TrustedOrgContext(org_s, app_s), cap_s, work_scope)


# --- keys -------------------------------------------------------------------------


def generate_keypair() -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """A fresh Ed25519 signing key and its public key."""
    private = Ed25519PrivateKey.generate()
    return private, private.public_key()


def _private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _public_pem(key: Ed25519PublicKey) -> str:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


def load_trusted_keys(path: Path) -> dict[str, Ed25519PublicKey]:
    """Read ``{key_id: public-key PEM}`` JSON.

    Raises:
        ConfigError: the file is missing, malformed, empty, or holds a non-Ed25519 key.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read trusted keys {path}: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"trusted keys {path} must be a non-empty JSON object")
    keys: dict[str, Ed25519PublicKey] = {}
    for kid, pem in raw.items():
        try:
            key = serialization.load_pem_public_key(str(pem).encode("ascii"))
        except ValueError as exc:
            raise ConfigError(f"trusted key {kid!r} in {path} is not a PEM public key") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"trusted key {kid!r} in {path} is not an Ed25519 key")
        keys[kid] = key
    return keys


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Read an unencrypted PKCS#8 PEM Ed25519 private key.

    Raises:
        ConfigError: the file is missing or not an Ed25519 private key.
    """
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        # The exception text never contains key material.
        raise ConfigError(f"cannot read signing key {path}: {type(exc).__name__}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is not an Ed25519 key")
    return key


class DevKeyFiles(NamedTuple):
    signing_key: Path
    trusted_keys: Path


def ensure_dev_keys(data_dir: Path, *, env: str, key_id: str = "dev") -> DevKeyFiles:
    """Create a development signing key and ``trusted_keys.json`` under ``<data_dir>/auth/``.

    Existing files are kept; a trusted-keys file lacking ``key_id`` gets it added. Safe
    when several services start at once on one data dir: the first writer wins and the
    others read its key. Files are created ``0600`` in a ``0700`` directory.

    Raises:
        ConfigError: ``env`` is ``production`` (production keys are provisioned, never
            generated), or the existing files disagree with each other.
    """
    if env == "production":
        raise ConfigError("refusing to generate development keys with FLOW_ENV=production")
    auth_dir = Path(data_dir) / "auth"
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, trusted_path = auth_dir / DEV_SIGNING_KEY_FILE, auth_dir / TRUSTED_KEYS_FILE
    if not key_path.exists():
        _create_exclusive(key_path, _private_pem(generate_keypair()[0]))
    public_pem = _public_pem(load_signing_key(key_path).public_key())
    if not trusted_path.exists():
        _create_exclusive(trusted_path, json.dumps({key_id: public_pem}, indent=2).encode())
    current = json.loads(trusted_path.read_text(encoding="utf-8"))
    if not isinstance(current, dict):
        raise ConfigError(f"{trusted_path} must be a JSON object")
    if current.get(key_id) is None:
        current[key_id] = public_pem
        _replace_file(trusted_path, json.dumps(current, indent=2).encode())
    elif current[key_id] != public_pem:
        raise ConfigError(f"{trusted_path} holds a different key for {key_id!r} than {key_path}")
    return DevKeyFiles(key_path, trusted_path)


def _write_temp(directory: Path, data: bytes) -> str:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")  # mkstemp creates 0600
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def _create_exclusive(path: Path, data: bytes) -> None:
    tmp = _write_temp(path.parent, data)
    try:
        os.link(tmp, path)  # atomic, fails if another process got there first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def _replace_file(path: Path, data: bytes) -> None:
    os.replace(_write_temp(path.parent, data), path)


# --- credentials --------------------------------------------------------------------


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
        trusted_keys: Mapping[str, Ed25519PublicKey],
        audience: ServiceName | str,
        *,
        clock_skew_s: float = 30.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._keys = dict(trusted_keys)
        self._audience = audience.value if isinstance(audience, ServiceName) else audience
        self._skew = clock_skew_s
        self._now = now

    @classmethod
    def from_config(cls, cfg: ServiceConfig) -> CredentialVerifier:
        """Trust ``cfg.auth_trusted_keys`` for audience ``cfg.service``."""
        return cls(
            load_trusted_keys(cfg.auth_trusted_keys),
            cfg.service,
            clock_skew_s=cfg.auth_clock_skew_s,
        )

    def verify(self, credential: str | None) -> TrustedIdentity:
        """Check ``credential`` and return the identity it proves.

        Raises:
            UnauthenticatedError: with the :class:`AuthFailure` value as ``reason``.
        """
        if not credential:
            raise _refuse(AuthFailure.MISSING)
        parts = credential.split(".")
        if len(credential) > _MAX_CREDENTIAL_CHARS or len(parts) != 4:
            raise _refuse(AuthFailure.MALFORMED)
        if parts[0] != CREDENTIAL_PREFIX:
            raise _refuse(AuthFailure.MALFORMED)
        try:
            header = _strict_json(_b64d(parts[1]))
            signature = _b64d(parts[3])
        except ValueError:
            raise _refuse(AuthFailure.MALFORMED) from None
        if not isinstance(header, dict) or header.get("alg") != _ALG:
            raise _refuse(AuthFailure.MALFORMED)
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise _refuse(AuthFailure.MALFORMED)
        key = self._keys.get(kid)
        if key is None:
            raise _refuse(AuthFailure.UNKNOWN_KEY)
        try:
            key.verify(signature, f"{parts[0]}.{parts[1]}.{parts[2]}".encode("ascii"))
        except InvalidSignature:
            raise _refuse(AuthFailure.BAD_SIGNATURE) from None
        try:
            identity = _identity_from_claims(_strict_json(_b64d(parts[2])), kid)
        except ValueError:
            raise _refuse(AuthFailure.MALFORMED) from None
        now = self._now()
        if now > identity.expires_at + self._skew:
            raise _refuse(AuthFailure.EXPIRED)
        if identity.issued_at > now + self._skew:
            raise _refuse(AuthFailure.NOT_YET_VALID)
        if self._audience not in identity.audiences:
            raise _refuse(AuthFailure.WRONG_AUDIENCE)
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
    sub = _opt_str("sub", claims.get("sub"))
    if sub is None:
        raise ValueError("sub is required")
    iat, exp = _int_claim(claims, "iat"), _int_claim(claims, "exp")
    if exp <= iat:
        raise ValueError("exp must be after iat")
    audiences = _str_list(claims.get("aud"), "aud")
    if not audiences:
        raise ValueError("aud must not be empty")
    scope = _scope_from(
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


# --- the current identity -----------------------------------------------------------

_CURRENT_IDENTITY: ContextVar[TrustedIdentity | None] = ContextVar(
    "nexus_flow_trusted_identity", default=None
)


def current_identity() -> TrustedIdentity:
    """The verified identity of the RPC being served.

    Raises:
        UnauthenticatedError: outside an authenticated call.
    """
    identity = _CURRENT_IDENTITY.get()
    if identity is None:
        raise UnauthenticatedError(
            "no trusted identity for this call", reason=AuthFailure.MISSING.value
        )
    return identity


@contextmanager
def identity_context(identity: TrustedIdentity) -> Iterator[TrustedIdentity]:
    """Make ``identity`` current for the block (the interceptor, and tests, use this)."""
    token = _CURRENT_IDENTITY.set(identity)
    try:
        yield identity
    finally:
        # An async generator may be finalised from another context; nothing to undo then.
        with suppress(ValueError):
            _CURRENT_IDENTITY.reset(token)


# --- request inspection -------------------------------------------------------------

_SCOPE_COMPONENTS = (
    "org_id",
    "app_installation_id",
    "runtime_capability_id",
    "runtime_work_binding_digest",
)
_SCOPE_CONTAINERS = ("scope", "binding")


def _string_field(message: Message, name: str) -> str:
    fd = message.DESCRIPTOR.fields_by_name.get(name)
    if fd is None or fd.type != FieldDescriptor.TYPE_STRING or fd.is_repeated:
        return ""
    value: str = getattr(message, name)
    return value


def _set_message_field(message: Message, name: str) -> Message | None:
    fd = message.DESCRIPTOR.fields_by_name.get(name)
    if fd is None or fd.type != FieldDescriptor.TYPE_MESSAGE or fd.is_repeated:
        return None
    if not message.HasField(name):
        return None
    sub: Message = getattr(message, name)
    return sub


def _require(value: str, trusted: str | None, field_path: str) -> None:
    if value and value != trusted:
        raise PermissionDeniedError(
            "request scope does not match the caller's credential",
            reason="scope_mismatch",
            field_path=field_path,
        )


def check_request_scope(request: object, identity: TrustedIdentity) -> None:
    """Reject a request whose body names a scope other than the trusted one.

    See the module docstring for the exact rule. Non-protobuf requests pass.

    Raises:
        PermissionDeniedError: with ``field_path`` naming the disagreeing field.
    """
    if not isinstance(request, Message):
        return
    _require(_string_field(request, "org_id"), identity.org_id, "org_id")
    trusted = identity.scope_components()
    for container in _SCOPE_CONTAINERS:
        sub = _set_message_field(request, container)
        if sub is None:
            continue
        for name in _SCOPE_COMPONENTS:
            _require(_string_field(sub, name), trusted[name], f"{container}.{name}")


async def _checked_stream(requests: Any, identity: TrustedIdentity) -> AsyncIterator[Any]:
    async for message in requests:
        check_request_scope(message, identity)
        yield message


def _bearer_credential(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        raise _refuse(AuthFailure.MISSING)
    if len(values) > 1 or not isinstance(values[0], str):
        raise _refuse(AuthFailure.MALFORMED)
    scheme, _, credential = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise _refuse(AuthFailure.MALFORMED)
    return credential.strip()


# --- the interceptor ----------------------------------------------------------------


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every non-exempt RPC and checks its request scope.

    Must sit *inside* ``services.errors.ErrorMappingInterceptor`` (see module docstring).
    """

    def __init__(
        self,
        verifier: CredentialVerifier,
        *,
        exempt_prefixes: Sequence[str] = EXEMPT_METHOD_PREFIXES,
    ) -> None:
        self._verifier = verifier
        self._exempt = tuple(exempt_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        try:
            identity = self._verifier.verify(
                _bearer_credential(handler_call_details.invocation_metadata)
            )
        except UnauthenticatedError as exc:
            return _refusing_handler(handler, exc)
        return wrap_method_handler(handler, _authenticated(identity))


def _authenticated(identity: TrustedIdentity) -> Callable[[Behavior, bool, bool], Behavior]:
    def checked(request: Any, request_streaming: bool) -> Any:
        if request_streaming:
            return _checked_stream(request, identity)
        check_request_scope(request, identity)
        return request

    def wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool) -> Behavior:
        if response_streaming:

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                with identity_context(identity):
                    req = checked(request, request_streaming)
                    async for item in iterate_responses(behavior, req, context):
                        yield item

            return stream

        async def unary(request: Any, context: Context) -> Any:
            with identity_context(identity):
                return await call_unary(behavior, checked(request, request_streaming), context)

        return unary

    return wrap


def _refusing_handler(
    handler: grpc.RpcMethodHandler, exc: UnauthenticatedError
) -> grpc.RpcMethodHandler:
    """A handler of the same shape that raises ``exc``.

    It has no request deserializer: an unauthenticated payload is never parsed.
    """

    async def unary(_request: Any, _context: Any) -> Any:
        raise exc

    async def stream(_request: Any, _context: Any) -> AsyncIterator[Any]:
        raise exc
        yield  # makes this an async generator

    ser = handler.response_serializer
    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, None, ser)
        return grpc.stream_unary_rpc_method_handler(unary, None, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, None, ser)
    return grpc.unary_unary_rpc_method_handler(unary, None, ser)


# --- client side --------------------------------------------------------------------


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


# --- TLS ------------------------------------------------------------------------------


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
