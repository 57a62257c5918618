"""The persisted principal directory and the run identity columns (§17, revision
``0012_identity``).

Why a runtime table: the catalog service publishes capabilities, bindings and metadata
views but no principals or permission grants (``catalog_svc`` has no principal
authority), and a workload credential proves only who *called* — not whether that
principal is still enabled when a run resumes hours later. ``flow_principals`` is the
narrow authority the runtime needs: per (org, principal) an enabled/disabled status and
the digest of its permission state, written by the org's identity sync (or an operator)
through :class:`PrincipalDirectory`, every change fenced by ``version``.

Every method takes the trusted org; rows hold ids and digests only — never a credential.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler.plan import ExecutionPlan
from runtime_svc.kernel.store_identity import set_run_identity_txn
from runtime_svc.schema import flow_principals, flow_runs
from services.auth import current_identity
from services.db import cas_update, insert_if_absent, transaction
from services.errors import (
    FenceLostError,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
)

from .rules import (
    PrincipalState,
    PrincipalStatus,
    RunIdentity,
    authorization_context_digest,
    permission_digest,
    run_principal_mode,
)

__all__ = [
    "MAX_PRINCIPAL_ID",
    "PrincipalDirectory",
    "current_principal_id",
    "principal_states_txn",
    "read_run_identity_txn",
    "record_initiator_txn",
    "record_run_identity_txn",
    "run_identities_txn",
]

#: ``flow_principals.principal_id`` / ``flow_runs.initiating_principal_id``.
MAX_PRINCIPAL_ID = 128


class _RunRow(Protocol):
    @property
    def flow_run_id(self) -> str: ...


class _Created(Protocol):
    """A kernel ``StartRunResult`` (structurally: the kernel is not imported here)."""

    @property
    def run(self) -> _RunRow: ...

    @property
    def created(self) -> bool: ...


def _check_id(principal_id: str) -> None:
    if not principal_id or len(principal_id) > MAX_PRINCIPAL_ID:
        raise InvalidArgumentError(
            f"principal_id must be 1..{MAX_PRINCIPAL_ID} characters",
            field_path="principal_id",
        )


async def principal_states_txn(
    conn: AsyncConnection, org_id: str, principal_ids: Iterable[str]
) -> dict[str, PrincipalState]:
    """Directory rows of ``principal_ids`` in ``org_id`` (absent ids are missing)."""
    ids = sorted(set(principal_ids))
    if not ids:
        return {}
    p = flow_principals.c
    rows = await conn.execute(
        select(p.principal_id, p.status, p.permission_digest).where(
            p.org_id == org_id, p.principal_id.in_(ids)
        )
    )
    return {
        r.principal_id: PrincipalState(
            r.principal_id, PrincipalStatus(r.status), r.permission_digest
        )
        for r in rows
    }


async def record_run_identity_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    principal_id: str,
    plan: ExecutionPlan,
) -> RunIdentity:
    """Store the §17.1 identity of the run just created in this transaction: the
    initiating principal, the plan's execution-principal mode and the digest of the
    principal's authorization context now. Written once (``IS NULL`` guard)."""
    _check_id(principal_id)
    states = await principal_states_txn(conn, org_id, [principal_id])
    identity = RunIdentity(
        principal_id,
        run_principal_mode(plan),
        authorization_context_digest(principal_id, states.get(principal_id)),
    )
    # The state store owns every flow_runs write (the module-boundary gate).
    await set_run_identity_txn(
        conn,
        org_id,
        flow_run_id,
        initiating_principal_id=principal_id,
        execution_principal_mode=identity.execution_principal_mode or "",
        authorization_context_digest=identity.authorization_context_digest or "",
    )
    return identity


async def read_run_identity_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str
) -> RunIdentity:
    """The stored identity of run ``(org_id, flow_run_id)``.

    Raises:
        NotFoundError: no such run in the org.
    """
    r = flow_runs.c
    row = (
        await conn.execute(
            select(
                r.initiating_principal_id,
                r.execution_principal_mode,
                r.authorization_context_digest,
            ).where(r.org_id == org_id, r.flow_run_id == flow_run_id)
        )
    ).one_or_none()
    if row is None:
        raise NotFoundError("flow_run", flow_run_id)
    return RunIdentity(
        row.initiating_principal_id, row.execution_principal_mode, row.authorization_context_digest
    )


def current_principal_id() -> str | None:
    """The verified subject of the RPC being served — the principal a run it starts is
    initiated by — or ``None`` outside an authenticated call (in-process callers)."""
    try:
        subject = current_identity().subject
    except UnauthenticatedError:
        return None
    return subject[:MAX_PRINCIPAL_ID]


async def record_initiator_txn(
    conn: AsyncConnection, org_id: str, result: _Created, plan: ExecutionPlan
) -> RunIdentity | None:
    """:func:`record_run_identity_txn` for a run ``result`` just created in this
    transaction by the current RPC's principal; nothing for an idempotent replay (the
    run keeps its first initiator) or outside an authenticated call."""
    principal = current_principal_id()
    if not result.created or principal is None:
        return None
    return await record_run_identity_txn(conn, org_id, result.run.flow_run_id, principal, plan)


async def run_identities_txn(
    conn: AsyncConnection, org_id: str, flow_run_ids: Iterable[str]
) -> dict[str, RunIdentity]:
    """The stored identities of ``flow_run_ids`` in ``org_id`` (runs with none recorded
    are missing)."""
    ids = sorted(set(flow_run_ids))
    if not ids:
        return {}
    r = flow_runs.c
    rows = await conn.execute(
        select(
            r.flow_run_id,
            r.initiating_principal_id,
            r.execution_principal_mode,
            r.authorization_context_digest,
        ).where(
            r.org_id == org_id,
            r.flow_run_id.in_(ids),
            r.initiating_principal_id.is_not(None),
        )
    )
    return {
        row.flow_run_id: RunIdentity(
            row.initiating_principal_id,
            row.execution_principal_mode,
            row.authorization_context_digest,
        )
        for row in rows
    }


class PrincipalDirectory:
    """Writes and reads of ``flow_principals`` (the identity sync's and operators' API).

    Args:
        engine: the runtime database.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def get(self, org_id: str, principal_id: str) -> PrincipalState | None:
        """The principal's directory state, or ``None`` when the directory lacks it."""
        async with transaction(self._engine, readonly=True) as conn:
            return (await principal_states_txn(conn, org_id, [principal_id])).get(principal_id)

    async def put(
        self,
        org_id: str,
        principal_id: str,
        *,
        enabled: bool,
        grants: Iterable[str],
    ) -> PrincipalState:
        """Register or update a principal: its status and permission grants (permission,
        FLS and RLS grant names; stored only as their digest). A concurrent writer makes
        the fenced update lose and the call retries from a fresh read (bounded)."""
        _check_id(principal_id)
        state = PrincipalState(
            principal_id,
            PrincipalStatus.ENABLED if enabled else PrincipalStatus.DISABLED,
            permission_digest(grants),
        )
        for _ in range(5):
            async with transaction(self._engine) as conn:
                if await self._write_txn(conn, org_id, state):
                    return state
        raise NotFoundError("flow_principal", principal_id)  # pragma: no cover - live-lock

    async def set_enabled(self, org_id: str, principal_id: str, enabled: bool) -> PrincipalState:
        """Enable or disable a registered principal (permissions unchanged).

        Raises:
            NotFoundError: the principal is not in the directory.
        """
        for _ in range(5):
            async with transaction(self._engine) as conn:
                current = await self._row_txn(conn, org_id, principal_id)
                if current is None:
                    raise NotFoundError("flow_principal", principal_id)
                state = PrincipalState(
                    principal_id,
                    PrincipalStatus.ENABLED if enabled else PrincipalStatus.DISABLED,
                    current[0].permission_digest,
                )
                if await self._write_txn(conn, org_id, state):
                    return state
        raise NotFoundError("flow_principal", principal_id)  # pragma: no cover - live-lock

    async def _row_txn(
        self, conn: AsyncConnection, org_id: str, principal_id: str
    ) -> tuple[PrincipalState, int] | None:
        p = flow_principals.c
        row = (
            await conn.execute(
                select(p.status, p.permission_digest, p.version).where(
                    p.org_id == org_id, p.principal_id == principal_id
                )
            )
        ).one_or_none()
        if row is None:
            return None
        return (
            PrincipalState(principal_id, PrincipalStatus(row.status), row.permission_digest),
            int(row.version),
        )

    async def _write_txn(self, conn: AsyncConnection, org_id: str, state: PrincipalState) -> bool:
        now = datetime.now(UTC)
        current = await self._row_txn(conn, org_id, state.principal_id)
        if current is None:
            return await insert_if_absent(
                conn,
                flow_principals,
                {
                    "org_id": org_id,
                    "principal_id": state.principal_id,
                    "status": state.status.value,
                    "permission_digest": state.permission_digest,
                    "version": 1,
                    "updated_at": now,
                },
            )
        try:
            await cas_update(
                conn,
                flow_principals,
                org_id=org_id,
                key={"principal_id": state.principal_id},
                expected_version=current[1],
                values={
                    "status": state.status.value,
                    "permission_digest": state.permission_digest,
                    "updated_at": now,
                },
                version_column="version",
            )
        except FenceLostError:
            return False
        return True
