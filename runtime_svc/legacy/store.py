"""``LegacyInterviewStore``: the typed write boundary of ``LegacyInterpreter`` interviews
in ``flow_runs`` (§10.1 "a legacy transition must compare (ExecutionOwner=
LegacyInterpreter, OwnershipEpoch=0, StateVersion)"; §20.3 6-8).

Exactly two statements write ``flow_runs`` here, and every legacy path goes through
them (``tests/unit/kernel/test_kernel_write_boundary.py`` checks it):

* :func:`_insert_legacy_row` — creation paths (``CreateInterview``/StartRun routed to the
  legacy owner, after-save admission, adoption of a pre-bridge row). It writes the
  trusted ``OrgID`` and ``LegacyInterpreter``/0 explicitly; it never relies on the
  column defaults, which exist only for pre-bridge binaries.
* :func:`_legacy_cas` — every mutator: ``UPDATE … SET state_version = state_version + 1
  WHERE org_id = :trusted AND flow_run_id = :id AND execution_owner = 'LegacyInterpreter'
  AND ownership_epoch = 0 AND state_version = :expected [AND legacy_claimed_by = :token]``
  whose row count must be 1, after the row was locked ``FOR UPDATE`` by
  ``(OrgID, FlowRunId)`` and rechecked by the pure ``decide_*`` functions of
  :mod:`runtime_svc.legacy.model`. The values are restricted to the legacy-owned field
  set before any SQL.

Reads are org-scoped and owner-filtered too: the due list filters ``(OrgID,
LegacyInterpreter, 0, Paused, RunAfter <= now)``, so a V2 run projected as ``Paused`` is
never listed. Nothing here imports the V2 kernel's write paths.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import and_, distinct, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.states import CompatibilityStatus
from runtime_svc.legacy.interpreter import Segment
from runtime_svc.legacy.model import (
    LEGACY_EPOCH,
    LEGACY_MUTABLE_FIELDS,
    LEGACY_OWNER,
    LEGACY_PROFILE,
    LEGACY_QUEUE,
    LegacyClaim,
    LegacyInterview,
    Rejected,
    Rejection,
    decide_cancel,
    decide_claim,
    decide_commit,
    decide_delete,
    decide_stale_recovery,
    legacy_runtime_state,
)
from runtime_svc.legacy.state import LegacyState
from runtime_svc.schema import flow_runs
from services.auth import TrustedRuntimeWorkScope
from services.db import cas_update, db_now, insert_if_absent, run_in_transaction, transaction
from services.errors import ConflictError, FailedPreconditionError, NotFoundError
from services.invariants import InvariantError

__all__ = [
    "DueInterview",
    "LegacyInterviewStore",
    "LegacyRejectedError",
    "NewInterview",
]

T = TypeVar("T")
Clock = Callable[[AsyncConnection], Awaitable[datetime]]
_DEFAULT_LEASE = timedelta(seconds=60)


class LegacyRejectedError(FailedPreconditionError):
    """A legacy mutator refused the row (owner, epoch, version, status, deletion)."""

    def __init__(self, rejection: Rejection, flow_run_id: str) -> None:
        super().__init__(
            f"the legacy interpreter may not change run {flow_run_id}: {rejection.value}",
            reason=f"legacy.{rejection.value}",
            attributes={"flow_run_id": flow_run_id},
        )
        self.rejection = rejection


@dataclass(frozen=True)
class NewInterview:
    """An interview to create (explicit trusted scope; owner/epoch/version are implied)."""

    scope: TrustedRuntimeWorkScope
    flow_version_id: str
    state: LegacyState
    idempotency_key: str | None = None
    request_digest: str | None = None
    flow_run_id: str | None = None


@dataclass(frozen=True)
class DueInterview:
    """One due-list entry."""

    flow_run_id: str
    state_version: int
    run_after: datetime | None


def _check_values(values: Mapping[str, Any]) -> None:
    outside = set(values) - LEGACY_MUTABLE_FIELDS
    if outside:
        raise ValueError(f"a legacy transition may not write {sorted(outside)}")


async def _insert_legacy_row(conn: AsyncConnection, values: Mapping[str, Any]) -> bool:
    """Insert a legacy-owned root: owner and epoch are forced, never defaulted."""
    row = {
        **values,
        "execution_owner": LEGACY_OWNER,
        "ownership_epoch": LEGACY_EPOCH,
        "plan_id": None,
        "execution_profile": LEGACY_PROFILE,
        "queue_class": LEGACY_QUEUE,
    }
    if not row.get("org_id"):
        raise ValueError("a legacy interview needs its trusted OrgID")
    return await insert_if_absent(conn, flow_runs, row)


async def _legacy_cas(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    expected_version: int,
    values: Mapping[str, Any],
    *,
    claim_token: str | None = None,
) -> int:
    """The one legacy compare-and-swap (see the module docstring).

    Raises:
        FenceLostError: the predicate matched no row.
        ValueError: ``values`` leaves the legacy-owned field set (before SQL).
    """
    _check_values(values)
    t = flow_runs.c
    predicates = [t.execution_owner == LEGACY_OWNER, t.ownership_epoch == LEGACY_EPOCH]
    if claim_token is not None:
        predicates.append(t.legacy_claimed_by == claim_token)
    return await cas_update(
        conn,
        flow_runs,
        org_id=org_id,
        key={"flow_run_id": flow_run_id},
        expected_version=expected_version,
        values=values,
        extra_predicates=predicates,
    )


async def _lock(conn: AsyncConnection, org_id: str, flow_run_id: str) -> LegacyInterview | None:
    """The row ``(org_id, flow_run_id)`` locked ``FOR UPDATE`` (any owner: the recheck
    names why a V2 row is refused)."""
    t = flow_runs.c
    stmt = (
        select(flow_runs).where(t.org_id == org_id, t.flow_run_id == flow_run_id).with_for_update()
    )
    row = (await conn.execute(stmt)).mappings().first()
    return None if row is None else LegacyInterview.from_row(row)


class LegacyInterviewStore:
    """Typed, fenced transitions and reads of legacy interviews (module docstring).

    Args:
        engine: the runtime database.
        lease: how long a legacy claim holds before stale-claim recovery may take it.
        clock: the durable clock (``db_now``; tests shift it).
    """

    def __init__(
        self, engine: AsyncEngine, *, lease: timedelta = _DEFAULT_LEASE, clock: Clock = db_now
    ) -> None:
        self._engine = engine
        self.lease = lease
        self._clock = clock

    async def now(self, conn: AsyncConnection) -> datetime:
        return await self._clock(conn)

    async def _tx(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        return await run_in_transaction(self._engine, fn)

    # --- creation -----------------------------------------------------------------------

    async def create_txn(
        self, conn: AsyncConnection, new: NewInterview, *, claimer: str | None
    ) -> tuple[LegacyInterview, LegacyClaim | None, bool]:
        """Create an interview in the caller's transaction.

        With ``claimer`` the row is born ``Running`` and claimed (the creating call runs
        the first segment); without, it is born ``Paused`` and due now (the legacy
        scheduler runs it). A repeated ``idempotency_key`` with the same request digest
        returns the existing interview (``created`` False).

        Raises:
            ConflictError: the key names a different request.
        """
        now = await self.now(conn)
        if new.idempotency_key is not None:
            existing = await self._by_key(conn, new.scope.org_id, new.idempotency_key)
            if existing is not None:
                return self._replay(existing, new), None, False
        run_id = new.flow_run_id or f"run-{uuid.uuid4().hex}"
        state = new.state
        token = None if claimer is None else f"{claimer}/{uuid.uuid4().hex[:12]}"
        status = CompatibilityStatus.RUNNING if token else CompatibilityStatus.PAUSED
        values = {
            **dataclasses.asdict(new.scope),
            "flow_run_id": run_id,
            "flow_version_id": new.flow_version_id,
            "runtime_state": legacy_runtime_state(status).code,
            "state_version": 0,
            "run_after": None if token else now,
            "priority": 0,
            "is_deleted": False,
            "idempotency_key": new.idempotency_key,
            "request_digest": new.request_digest,
            "interview_status": status.code,
            "current_element": state.path,
            "paused_at": None if token else now,
            "legacy_context": state.dumps(),
            "legacy_claimed_by": token,
            "legacy_claim_until": now + self.lease if token else None,
            "started_at": now if token else None,
            "created_at": now,
            "updated_at": now,
        }
        if not await _insert_legacy_row(conn, values):
            key = new.idempotency_key
            existing = None if key is None else await self._by_key(conn, new.scope.org_id, key)
            if existing is None:
                raise ConflictError("flow run identity collision", entity="flow_run")
            return self._replay(existing, new), None, False
        row = await self.get_txn(conn, new.scope.org_id, run_id, include_deleted=True)
        claim = None
        if token is not None:
            claim = LegacyClaim(new.scope, run_id, new.flow_version_id, 0, token, state.dumps())
        return row, claim, True

    async def adopt_txn(
        self, conn: AsyncConnection, scope: TrustedRuntimeWorkScope, values: Mapping[str, Any]
    ) -> bool:
        """Insert one adopted pre-bridge interview (same identity, owner Legacy, epoch 0,
        its carried state version); ``False`` when it already exists."""
        return await _insert_legacy_row(conn, {**values, **dataclasses.asdict(scope)})

    @staticmethod
    def _replay(existing: LegacyInterview, new: NewInterview) -> LegacyInterview:
        if existing.request_digest != new.request_digest:
            raise ConflictError(
                "idempotency key already used for a different request",
                entity="flow_run",
                key=existing.idempotency_key or "",
            )
        return existing

    async def _by_key(self, conn: AsyncConnection, org_id: str, key: str) -> LegacyInterview | None:
        t = flow_runs.c
        stmt = select(flow_runs).where(
            t.org_id == org_id,
            t.idempotency_key == key,
            t.execution_owner == LEGACY_OWNER,
            t.ownership_epoch == LEGACY_EPOCH,
        )
        row = (await conn.execute(stmt)).mappings().first()
        return None if row is None else LegacyInterview.from_row(row)

    # --- reads --------------------------------------------------------------------------

    async def get_txn(
        self, conn: AsyncConnection, org_id: str, flow_run_id: str, *, include_deleted: bool
    ) -> LegacyInterview:
        t = flow_runs.c
        stmt = select(flow_runs).where(
            t.org_id == org_id,
            t.flow_run_id == flow_run_id,
            t.execution_owner == LEGACY_OWNER,
            t.ownership_epoch == LEGACY_EPOCH,
        )
        if not include_deleted:
            stmt = stmt.where(t.is_deleted.is_(False))
        row = (await conn.execute(stmt)).mappings().first()
        if row is None:
            raise NotFoundError("flow_run", flow_run_id)
        return LegacyInterview.from_row(row)

    async def get(
        self, org_id: str, flow_run_id: str, *, include_deleted: bool = False
    ) -> LegacyInterview:
        """The legacy interview ``(org_id, flow_run_id)`` (support read).

        Raises:
            NotFoundError: missing, in another org, V2-owned, or deleted.
        """
        async with transaction(self._engine, readonly=True) as conn:
            return await self.get_txn(conn, org_id, flow_run_id, include_deleted=include_deleted)

    async def due_list(
        self, org_id: str, *, now: datetime | None = None, limit: int = 50
    ) -> list[DueInterview]:
        """§20.3 (6): due Paused legacy interviews of ``org_id``, oldest first."""
        t = flow_runs.c
        async with transaction(self._engine, readonly=True) as conn:
            at = now or await self.now(conn)
            stmt = (
                select(t.flow_run_id, t.state_version, t.run_after)
                .where(
                    t.org_id == org_id,
                    t.execution_owner == LEGACY_OWNER,
                    t.ownership_epoch == LEGACY_EPOCH,
                    t.interview_status == CompatibilityStatus.PAUSED.code,
                    t.is_deleted.is_(False),
                    t.run_after <= at,
                )
                .order_by(t.run_after, t.flow_run_id)
                .limit(limit)
            )
            return [DueInterview(*r) for r in await conn.execute(stmt)]

    async def orgs_with_work(self, *, limit: int = 100) -> list[str]:
        """Orgs with a due or stale legacy interview: the scheduler then serves each org
        through its org-scoped due list and recovery (one bounded discovery query)."""
        t = flow_runs.c
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.now(conn)
            paused_due = and_(
                t.interview_status == CompatibilityStatus.PAUSED.code,
                t.is_deleted.is_(False),
                t.run_after <= now,
            )
            stale = and_(
                t.interview_status == CompatibilityStatus.RUNNING.code,
                t.legacy_claim_until < now,
            )
            stmt = (
                select(distinct(t.org_id))
                .where(
                    t.execution_owner == LEGACY_OWNER,
                    t.ownership_epoch == LEGACY_EPOCH,
                    paused_due | stale,
                )
                .limit(limit)
            )
            return [r[0] for r in await conn.execute(stmt)]

    # --- mutators -----------------------------------------------------------------------

    async def claim(
        self,
        org_id: str,
        flow_run_id: str,
        *,
        expected_version: int | None,
        claimer: str,
        require_due: bool = True,
    ) -> LegacyClaim | Rejected:
        """``ClaimPausedInterview``: lock by ``(OrgID, FlowRunId)``, recheck trusted org,
        status, owner, epoch and version, then the fenced claim."""

        async def fn(conn: AsyncConnection) -> LegacyClaim | Rejected:
            now = await self.now(conn)
            row = await _lock(conn, org_id, flow_run_id)
            token = f"{claimer}/{uuid.uuid4().hex[:12]}"
            decision = decide_claim(
                row,
                org_id=org_id,
                expected_version=expected_version,
                token=token,
                now=now,
                lease=self.lease,
                require_due=require_due,
            )
            if isinstance(decision, Rejected):
                return decision
            if row is None:
                raise InvariantError("broken invariant: row is not None")
            version = await _legacy_cas(conn, org_id, flow_run_id, row.state_version, decision)
            return LegacyClaim(
                row.scope,
                flow_run_id,
                row.flow_version_id,
                version,
                token,
                row.context or "",
            )

        return await self._tx(fn)

    async def commit_txn(self, conn: AsyncConnection, claim: LegacyClaim, segment: Segment) -> int:
        """Publish a claimed segment inside the caller's transaction (after its business
        writes): the row must still be ours at the claimed version.

        Raises:
            LegacyRejectedError: the locked row no longer matches the claim (a delete,
                a stale recovery or a re-claim won); the caller rolls everything back.
        """
        now = await self.now(conn)
        row = await _lock(conn, claim.org_id, claim.flow_run_id)
        decision = decide_commit(row, claim, segment, now)
        if isinstance(decision, Rejected):
            raise LegacyRejectedError(decision.reason, claim.flow_run_id)
        return await _legacy_cas(
            conn,
            claim.org_id,
            claim.flow_run_id,
            claim.state_version,
            decision,
            claim_token=claim.token,
        )

    async def recover_stale(self, org_id: str, *, limit: int = 50) -> list[str]:
        """Stale-claim recovery of ``org_id``: every legacy interview whose claim expired
        returns to ``Paused``, due now (each under the full predicate and recheck)."""
        t = flow_runs.c
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.now(conn)
            stmt = (
                select(t.flow_run_id)
                .where(
                    t.org_id == org_id,
                    t.execution_owner == LEGACY_OWNER,
                    t.ownership_epoch == LEGACY_EPOCH,
                    t.interview_status == CompatibilityStatus.RUNNING.code,
                    t.legacy_claim_until < now,
                )
                .order_by(t.legacy_claim_until, t.flow_run_id)
                .limit(limit)
            )
            candidates = [r[0] for r in await conn.execute(stmt)]
        recovered = []
        for run_id in candidates:
            outcome = await self.recover_one(org_id, run_id)
            if not isinstance(outcome, Rejected):
                recovered.append(run_id)
        return recovered

    async def recover_one(self, org_id: str, flow_run_id: str) -> int | Rejected:
        """Recover one stale claim (the repair entry point; refuses a V2 row)."""

        async def fn(conn: AsyncConnection) -> int | Rejected:
            now = await self.now(conn)
            row = await _lock(conn, org_id, flow_run_id)
            decision = decide_stale_recovery(row, org_id=org_id, now=now)
            if isinstance(decision, Rejected):
                return decision
            if row is None:
                raise InvariantError("broken invariant: row is not None")
            return await _legacy_cas(conn, org_id, flow_run_id, row.state_version, decision)

        return await self._tx(fn)

    async def delete(
        self, org_id: str, flow_run_id: str, *, expected_version: int | None = None
    ) -> LegacyInterview:
        """Public delete of a legacy interview: cancellation and ``IsDeleted`` tombstone
        in one fenced write (idempotent; never a physical delete).

        Raises:
            NotFoundError: missing or in another org.
            LegacyRejectedError: V2-owned, or a stale ``expected_version``.
        """
        return await self._lifecycle(org_id, flow_run_id, expected_version, decide_delete)

    async def cancel(
        self, org_id: str, flow_run_id: str, *, expected_version: int | None = None
    ) -> LegacyInterview:
        """Cancel a legacy interview (idempotent while cancelled)."""
        return await self._lifecycle(org_id, flow_run_id, expected_version, decide_cancel)

    async def _lifecycle(
        self,
        org_id: str,
        flow_run_id: str,
        expected_version: int | None,
        decide: Callable[..., Rejected | dict[str, Any] | None],
    ) -> LegacyInterview:
        async def fn(conn: AsyncConnection) -> LegacyInterview:
            now = await self.now(conn)
            row = await _lock(conn, org_id, flow_run_id)
            decision = decide(row, org_id=org_id, expected_version=expected_version, now=now)
            if isinstance(decision, Rejected):
                if decision.reason is Rejection.NOT_FOUND:
                    raise NotFoundError("flow_run", flow_run_id)
                if decision.reason is Rejection.DELETED:
                    raise NotFoundError("flow_run", flow_run_id)
                raise LegacyRejectedError(decision.reason, flow_run_id)
            if row is None:
                raise InvariantError("broken invariant: row is not None")
            if decision is not None:
                await _legacy_cas(conn, org_id, flow_run_id, row.state_version, decision)
            return await self.get_txn(conn, org_id, flow_run_id, include_deleted=True)

        return await self._tx(fn)
