"""Bridge test support: routing statements signed by a test issuer, and a whole bridge
walk-through up to any gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import bridge
from runtime_svc.migration.authority import (
    ROUTING_ROLE,
    AuthorityUnproven,
    DeploymentOrgAuthority,
    resolve_authority,
)
from runtime_svc.schema_bridge import flow_interviews
from services import db
from services.auth import (
    CredentialVerifier,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    generate_keypair,
    mint_credential,
)
from services.config import ServiceName

__all__ = ["Issuer", "prebridge_rows"]


@dataclass
class Issuer:
    """A control-plane signing key the runtime trusts (kid ``cp``)."""

    key: Ed25519PrivateKey
    verifier: CredentialVerifier

    @classmethod
    def new(cls) -> Issuer:
        private, public = generate_keypair()
        return cls(private, CredentialVerifier({"cp": public}, ServiceName.RUNTIME))

    def statement(
        self,
        scope: TrustedRuntimeWorkScope,
        *,
        roles: tuple[str, ...] = (ROUTING_ROLE,),
        ttl_s: float = 600,
        key: Ed25519PrivateKey | None = None,
    ) -> str:
        claims = WorkloadClaims(
            subject="control-plane",
            audiences=(ServiceName.RUNTIME,),
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            roles=roles,
        )
        return mint_credential(key or self.key, "cp", claims, ttl_s=ttl_s)

    def authority(self, *statements: str) -> DeploymentOrgAuthority | AuthorityUnproven:
        return resolve_authority(list(statements), self.verifier)

    def proven(self, scope: TrustedRuntimeWorkScope) -> DeploymentOrgAuthority:
        found = self.authority(self.statement(scope))
        assert isinstance(found, DeploymentOrgAuthority), found
        return found


async def prebridge_rows(engine: AsyncEngine) -> dict[str, dict[str, Any]]:
    async with db.transaction(engine, readonly=True) as conn:
        return {
            r["interview_id"]: dict(r)
            for r in (await conn.execute(select(flow_interviews))).mappings()
        }


async def through_org_schema_gate(
    engine: AsyncEngine, issuer: Issuer, scope: TrustedRuntimeWorkScope
) -> None:
    """Drain (nothing running) and pass the org-schema gate."""
    await bridge.drain_begin(engine)
    await bridge.drain_verify(engine, settle_s=0)
    await bridge.org_schema_gate(engine, issuer.proven(scope), LegacyInterviewStore(engine))
