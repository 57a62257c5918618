"""Trusted identities: what a verified workload credential proves (ARCHITECTURE §3).

The verifier (:mod:`services.auth.credentials`) turns a credential into a
:class:`TrustedIdentity`; the interceptor makes it current for the RPC
(:func:`identity_context`) and servicers read it with :func:`current_identity`. Scope
components nest: org ⊇ app installation ⊇ runtime capability ⊇ binding digest.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from services.config import ServiceName
from services.digest import is_digest
from services.errors import PermissionDeniedError, UnauthenticatedError

__all__ = [
    "AuthFailure",
    "TrustedIdentity",
    "TrustedOrgContext",
    "TrustedRuntimeWorkScope",
    "WorkloadClaims",
    "current_identity",
    "identity_context",
    "opt_str",
    "refuse",
    "scope_from",
]


class AuthFailure(StrEnum):
    """Why a credential was refused; the value is the ``ErrorDetail.code`` sent back."""

    MISSING = "credential_missing"
    MALFORMED = "credential_malformed"
    UNKNOWN_KEY = "credential_unknown_key"
    BAD_SIGNATURE = "credential_bad_signature"
    EXPIRED = "credential_expired"
    NOT_YET_VALID = "credential_not_yet_valid"
    WRONG_AUDIENCE = "credential_wrong_audience"
    KEY_CONSTRAINTS = "credential_exceeds_key_constraints"


_FAILURE_MESSAGES: Mapping[AuthFailure, str] = {
    AuthFailure.MISSING: "workload credential missing",
    AuthFailure.MALFORMED: "workload credential malformed",
    AuthFailure.UNKNOWN_KEY: "workload credential signed by an untrusted key",
    AuthFailure.BAD_SIGNATURE: "workload credential signature invalid",
    AuthFailure.EXPIRED: "workload credential expired",
    AuthFailure.NOT_YET_VALID: "workload credential not yet valid",
    AuthFailure.WRONG_AUDIENCE: "workload credential not issued for this service",
    AuthFailure.KEY_CONSTRAINTS: "workload credential claims more than its signing key may sign",
}


def refuse(failure: AuthFailure) -> UnauthenticatedError:
    """The :class:`UnauthenticatedError` of ``failure`` (its safe message and reason)."""
    return UnauthenticatedError(_FAILURE_MESSAGES[failure], reason=failure.value)


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
        scope_from(
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


def opt_str(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


class _Scope(NamedTuple):
    org: TrustedOrgContext
    runtime_capability_id: str | None
    work_scope: TrustedRuntimeWorkScope | None


def scope_from(org_id: object, app: object, capability: object, binding_digest: object) -> _Scope:
    org_s = opt_str("org_id", org_id)
    if org_s is None:
        raise ValueError("org_id is required")
    app_s = opt_str("app_installation_id", app)
    cap_s = opt_str("runtime_capability_id", capability)
    digest_s = opt_str("runtime_work_binding_digest", binding_digest)
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
