"""The trusted single-org deployment authority of the OrgID backfill (§20.2).

"A repeatable migration reads the one authorized deployment org from trusted
controlplane/Catalog routing, never from a Flow row or payload." Here that routing is a
**deployment routing statement**: a workload credential signed by an issuer the runtime
trusts (``FLOW_AUTH_TRUSTED_KEYS`` — the same trust root every RPC is verified against),
for the ``runtime`` audience, carrying the role :data:`ROUTING_ROLE` and the complete
``RuntimeWorkBinding`` scope the pre-bridge deployment serves. ``flowctl deploy routing
mint`` issues one with the control plane's signing key.

:func:`resolve_authority` proves exactly one authoritative org and scope from the
statements it is given, or says why it cannot; the backfill then quarantines the rollout
rather than guess. Nothing from ``flow_interviews`` is ever an input.

Pure apart from signature verification (no I/O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from services.auth import ROUTING_ROLE, CredentialVerifier, TrustedRuntimeWorkScope
from services.digest import versioned_digest
from services.errors import UnauthenticatedError

__all__ = [
    "ROUTING_ROLE",
    "AuthorityUnproven",
    "DeploymentOrgAuthority",
    "resolve_authority",
]


@dataclass(frozen=True)
class DeploymentOrgAuthority:
    """The proven deployment org and work scope, and the digest of their proof."""

    scope: TrustedRuntimeWorkScope
    digest: str

    @property
    def org_id(self) -> str:
        return self.scope.org_id


@dataclass(frozen=True)
class AuthorityUnproven:
    """Exactly one authoritative org could not be proven (the rollout quarantines)."""

    reason: str
    orgs: tuple[str, ...] = ()


def resolve_authority(
    statements: Sequence[str], verifier: CredentialVerifier
) -> DeploymentOrgAuthority | AuthorityUnproven:
    """Verify every routing statement and demand exactly one org and work scope.

    Reasons: ``no_routing_statement``, ``routing_statement_invalid.<auth failure>``,
    ``routing_statement_not_authorized`` (role missing),
    ``routing_statement_without_work_scope``, ``ambiguous_orgs``, ``ambiguous_scopes``.
    """
    texts = [s.strip() for s in statements if s.strip()]
    if not texts:
        return AuthorityUnproven("no_routing_statement")
    scopes: list[TrustedRuntimeWorkScope] = []
    proofs = []
    for credential in texts:
        try:
            identity = verifier.verify(credential)
        except UnauthenticatedError as exc:
            return AuthorityUnproven(f"routing_statement_invalid.{exc.reason}")
        if ROUTING_ROLE not in identity.roles:
            return AuthorityUnproven("routing_statement_not_authorized")
        if identity.work_scope is None:
            return AuthorityUnproven("routing_statement_without_work_scope")
        scopes.append(identity.work_scope)
        proofs.append(
            {
                **dataclasses.asdict(identity.work_scope),
                "key_id": identity.key_id,
                "subject": identity.subject,
                "issued_at": identity.issued_at,
                "expires_at": identity.expires_at,
            }
        )
    orgs = tuple(sorted({s.org_id for s in scopes}))
    if len(orgs) != 1:
        return AuthorityUnproven("ambiguous_orgs", orgs)
    if len(set(scopes)) != 1:
        return AuthorityUnproven("ambiguous_scopes", orgs)
    proofs.sort(key=lambda p: (p["key_id"], p["issued_at"], p["subject"]))
    digest = versioned_digest("deployment-org-authority", {"statements": proofs})
    return DeploymentOrgAuthority(scopes[0], digest)
