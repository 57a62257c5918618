"""Admission of a new ``LegacyInterpreter`` run inside the admitting transaction.

Used by every bridge creation path — ``StartRun`` routed to the legacy owner and
after-save admission inside the record transaction — so each writes the trusted
``OrgID`` plus ``LegacyInterpreter/0/0`` explicitly (§20.2, §22.8) through
:meth:`runtime_svc.legacy.store.LegacyInterviewStore.create_txn`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.legacy.interpreter import initial_variables
from runtime_svc.legacy.model import LegacyClaim, LegacyInterview
from runtime_svc.legacy.ports import FlowLibrary
from runtime_svc.legacy.state import LegacyState
from runtime_svc.legacy.store import LegacyInterviewStore, NewInterview
from services.auth import TrustedRuntimeWorkScope

__all__ = ["admit_legacy_txn"]


async def admit_legacy_txn(
    conn: AsyncConnection,
    scope: TrustedRuntimeWorkScope,
    flow_version_id: str,
    variables: Mapping[str, Any],
    *,
    trigger: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    request_digest: str | None = None,
    claimer: str | None = None,
    store: LegacyInterviewStore | None = None,
    lease: timedelta | None = None,
) -> tuple[LegacyInterview, LegacyClaim | None, bool]:
    """Create a legacy interview positioned at its Flow's start element.

    With ``claimer`` the caller holds the claim and runs the first segment itself;
    without, the interview is due now for the legacy scheduler. Returns the interview,
    the claim and whether this call created it (``False``: an idempotent replay).

    Raises:
        NotFoundError: the Flow version is not in the trusted org.
        ConflictError: the idempotency key names a different request.
    """
    library = await FlowLibrary.load_txn(conn, scope.org_id, flow_version_id)
    flow = library.root
    state = LegacyState.start(
        flow.api_name,
        flow.version,
        flow.start,
        initial_variables(flow, variables),
        trigger=trigger,
    )
    if store is None:
        store = (
            LegacyInterviewStore(conn.engine)
            if lease is None
            else LegacyInterviewStore(conn.engine, lease=lease)
        )
    new = NewInterview(
        scope,
        flow_version_id,
        state,
        idempotency_key=idempotency_key,
        request_digest=request_digest,
    )
    return await store.create_txn(conn, new, claimer=claimer)
