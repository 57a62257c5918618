"""The state store's write of a run's §17.1 identity columns (revision ``0012_identity``).

The identity of a run — initiating principal, execution-principal mode,
authorization-context digest — is written once, in the transaction that creates the run,
by the module boundary that owns ``flow_runs`` writes (this package). It touches no
lifecycle, fence or projection column: a write-once ``UPDATE … WHERE
initiating_principal_id IS NULL`` scoped by the trusted org. The values are computed by
:mod:`runtime_svc.identity` (ids and digests only, never a credential).
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.schema import flow_runs

__all__ = ["set_run_identity_txn"]


async def set_run_identity_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    *,
    initiating_principal_id: str,
    execution_principal_mode: str,
    authorization_context_digest: str,
) -> bool:
    """Store the identity of run ``(org_id, flow_run_id)`` unless it has one; ``True``
    when this call stored it."""
    r = flow_runs.c
    result = await conn.execute(
        update(flow_runs)
        .where(
            r.org_id == org_id,
            r.flow_run_id == flow_run_id,
            r.initiating_principal_id.is_(None),
        )
        .values(
            initiating_principal_id=initiating_principal_id,
            execution_principal_mode=execution_principal_mode,
            authorization_context_digest=authorization_context_digest,
        )
    )
    return result.rowcount == 1
