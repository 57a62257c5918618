"""``LegacyInterviewService``: create, run, resume, recover, cancel and delete legacy
interviews — the bridge-protected ``LegacyInterpreter`` owner of epoch 0 (§20.3, §20.6,
§20.8).

A segment is: a fenced claim (its own short transaction), then ONE transaction that walks
the elements with :class:`~runtime_svc.legacy.ports.LivePorts` — business writes through
the record engine, in element order — and ends with the fenced legacy commit of the
interview row (§13.1: business rows first, the lifecycle row last). A segment that ends
in an unhandled fault keeps none of its business writes (a savepoint is rolled back) but
publishes the interview's ``Error`` state. If the commit's
locked-row recheck fails (a delete won, a stale recovery re-queued it) the whole
transaction rolls back: no business write of a fenced segment survives. A crash after
the claim leaves the row ``Running`` with an expiring claim; stale-claim recovery returns
it to ``Paused`` at its last committed position.

Creation paths write trusted ``OrgID`` plus ``LegacyInterpreter/0/0`` explicitly
(:class:`~runtime_svc.legacy.store.LegacyInterviewStore`). Nothing here can write a V2
row: every mutator is the legacy store's owner/epoch/version-predicated CAS.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.legacy.admission import admit_legacy_txn
from runtime_svc.legacy.interpreter import (
    Due,
    EventArrived,
    Failed,
    LegacyFault,
    Resume,
    Segment,
    run_segment,
)
from runtime_svc.legacy.model import LegacyClaim, LegacyInterview, Rejected
from runtime_svc.legacy.ports import FlowLibrary, LivePorts
from runtime_svc.legacy.state import LegacyState
from runtime_svc.legacy.store import LegacyInterviewStore, LegacyRejectedError
from runtime_svc.records import RecordView
from runtime_svc.worker.views import RecordViewSource
from services.auth import TrustedRuntimeWorkScope
from services.db import run_in_transaction
from services.errors import FenceLostError

__all__ = ["LegacyInterviewService", "SegmentReport"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentReport:
    """One executed segment: the interview after it and what the walk did."""

    interview: LegacyInterview
    segment: Segment | None


class LegacyInterviewService:
    """The legacy owner (see the module docstring).

    Args:
        engine: the runtime database.
        store: the legacy write boundary.
        views: record views by work scope (validation of record writes); ``None`` makes
            any record write fail closed (``metadata_view_missing``).
        owner: this process's claimer name (claim tokens extend it).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        store: LegacyInterviewStore,
        views: RecordViewSource | None,
        *,
        owner: str,
    ) -> None:
        self._engine = engine
        self.store = store
        self._views = views
        self._owner = owner

    async def _view(self, scope: TrustedRuntimeWorkScope) -> RecordView | None:
        if self._views is None:
            return None
        return await self._views.view_for(scope)

    # --- creation -----------------------------------------------------------------------

    async def new_interview_txn(
        self,
        conn: AsyncConnection,
        scope: TrustedRuntimeWorkScope,
        flow_version_id: str,
        variables: Mapping[str, Any],
        *,
        trigger: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        request_digest: str | None = None,
        claim: bool = False,
    ) -> tuple[LegacyInterview, LegacyClaim | None, bool]:
        """:func:`~runtime_svc.legacy.admission.admit_legacy_txn` with this service's
        store (``claim``: this process runs the first segment)."""
        return await admit_legacy_txn(
            conn,
            scope,
            flow_version_id,
            variables,
            trigger=trigger,
            idempotency_key=idempotency_key,
            request_digest=request_digest,
            claimer=self._owner if claim else None,
            store=self.store,
        )

    async def start(
        self,
        scope: TrustedRuntimeWorkScope,
        flow_version_id: str,
        variables: Mapping[str, Any],
        *,
        trigger: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        request_digest: str | None = None,
    ) -> tuple[LegacyInterview, bool]:
        """``CreateInterview`` and run its first segment now (the legacy synchronous
        start); returns the interview and whether this call created it."""

        async def create(conn: AsyncConnection) -> tuple[LegacyInterview, LegacyClaim | None, bool]:
            return await self.new_interview_txn(
                conn,
                scope,
                flow_version_id,
                variables,
                trigger=trigger,
                idempotency_key=idempotency_key,
                request_digest=request_digest,
                claim=True,
            )

        interview, claim, created = await run_in_transaction(self._engine, create)
        if claim is None:
            return interview, created
        report = await self.execute(claim, None)
        return report.interview, created

    # --- execution ----------------------------------------------------------------------

    async def execute(self, claim: LegacyClaim, signal: Resume | None) -> SegmentReport:
        """Run one claimed segment and publish it (see the module docstring).

        A lost fence (delete/recovery won) rolls the segment back and is reported as the
        interview's current state with ``segment=None``.
        """
        view = await self._view(claim.scope)

        async def fn(conn: AsyncConnection) -> Segment:
            state = LegacyState.loads(claim.context)
            now = await self.store.now(conn)
            try:
                library = await FlowLibrary.load_txn(conn, claim.org_id, claim.flow_version_id)
            except LegacyFault as exc:
                # The stored Flow version no longer parses: fail the interview, fenced.
                log.warning("legacy interview %s cannot run: %s", claim.flow_run_id, exc.code)
                segment = Segment(Failed(exc.code, state.path), state, (), (), ())
            else:
                ports = LivePorts(conn, claim.org_id, claim.flow_run_id, library, view)
                # An unhandled fault rolls the segment's business writes back (the legacy
                # all-or-nothing segment); the Error state itself is still published.
                savepoint = await conn.begin_nested()
                segment = await run_segment(library.root, state, ports, now=now, resume=signal)
                if isinstance(segment.status, Failed):
                    await savepoint.rollback()
                else:
                    await savepoint.commit()
            await self.store.commit_txn(conn, claim, segment)
            return segment

        try:
            segment: Segment | None = await run_in_transaction(self._engine, fn)
        except (LegacyRejectedError, FenceLostError):
            segment = None
        interview = await self.store.get(claim.org_id, claim.flow_run_id, include_deleted=True)
        return SegmentReport(interview, segment)

    async def run_due(self, org_id: str, *, limit: int = 20) -> list[SegmentReport]:
        """Claim and run the due interviews of ``org_id`` (the legacy scheduler's tick)."""
        reports = []
        for due in await self.store.due_list(org_id, limit=limit):
            claim = await self.store.claim(
                org_id, due.flow_run_id, expected_version=due.state_version, claimer=self._owner
            )
            if isinstance(claim, Rejected):
                continue  # someone else won, or it is no longer due / legacy-owned
            reports.append(await self.execute(claim, Due()))
        return reports

    async def resume(
        self,
        org_id: str,
        flow_run_id: str,
        evidence: Mapping[str, Any],
        *,
        expected_version: int | None = None,
    ) -> SegmentReport:
        """Direct legacy resume of an event/action wait with the producer's evidence.

        Raises:
            NotFoundError: missing or in another org.
            LegacyRejectedError: V2-owned, not paused, deleted, or a stale version.
        """
        claim = await self.store.claim(
            org_id,
            flow_run_id,
            expected_version=expected_version,
            claimer=self._owner,
            require_due=False,
        )
        if isinstance(claim, Rejected):
            raise LegacyRejectedError(claim.reason, flow_run_id)
        return await self.execute(claim, EventArrived(dict(evidence)))

    async def recover_stale(self, org_id: str) -> list[str]:
        """Stale-claim recovery of one org (see :meth:`LegacyInterviewStore.recover_stale`)."""
        return await self.store.recover_stale(org_id)

    async def tick(self) -> bool:
        """One scheduler pass over every org with legacy work; True when it did work."""
        busy = False
        for org_id in await self.store.orgs_with_work():
            if await self.recover_stale(org_id):
                busy = True
            if await self.run_due(org_id):
                busy = True
        return busy

    # --- lifecycle commands -------------------------------------------------------------

    async def get(
        self, org_id: str, flow_run_id: str, *, include_deleted: bool = False
    ) -> LegacyInterview:
        return await self.store.get(org_id, flow_run_id, include_deleted=include_deleted)

    async def delete(
        self, org_id: str, flow_run_id: str, *, expected_version: int | None = None
    ) -> LegacyInterview:
        return await self.store.delete(org_id, flow_run_id, expected_version=expected_version)

    async def cancel(
        self, org_id: str, flow_run_id: str, *, expected_version: int | None = None
    ) -> LegacyInterview:
        return await self.store.cancel(org_id, flow_run_id, expected_version=expected_version)
