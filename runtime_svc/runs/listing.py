"""``ListRuns`` (§10.1 step 6, §19): org-scoped, ``IsDeleted``-filtered, keyset pages in
``(created_at, flow_run_id)`` order with tamper-evident tokens.

A read-only query over ``flow_runs`` decoded by the kernel's own row codec: the kernel's
``list_runs`` orders by run id and has no Flow-name or creation-range filter, which the
public contract needs. It takes no locks and writes nothing (the state store stays the
only write path).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, false, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel import RunRecord, RunState
from runtime_svc.kernel.store_codec import run_from_row
from runtime_svc.runs.tokens import PageCursor, PageTokenCodec
from runtime_svc.schema import flow_runs, flow_versions
from services.digest import versioned_digest
from services.errors import InvalidArgumentError

__all__ = ["DEFAULT_PAGE_SIZE", "MAX_PAGE_SIZE", "ListFilters", "list_runs_txn"]

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


@dataclass(frozen=True)
class ListFilters:
    """``ListRuns`` filters (all optional, combined with AND)."""

    flow_api_name: str | None = None
    flow_version_id: str | None = None
    plan_id: str | None = None
    states: tuple[RunState, ...] = ()
    created_after: datetime | None = None
    created_before: datetime | None = None

    def digest(self) -> str:
        """What a page token is bound to: the same filters or no page."""
        return versioned_digest(
            "list-runs-filters",
            {
                "flow_api_name": self.flow_api_name,
                "flow_version_id": self.flow_version_id,
                "plan_id": self.plan_id,
                "states": sorted(s.code for s in self.states),
                "created_after": None
                if self.created_after is None
                else self.created_after.isoformat(),
                "created_before": None
                if self.created_before is None
                else self.created_before.isoformat(),
            },
        )


async def list_runs_txn(
    conn: AsyncConnection,
    org_id: str,
    filters: ListFilters,
    page_size: int,
    page_token: str,
    tokens: PageTokenCodec,
) -> tuple[list[RunRecord], str]:
    """One page of the org's visible runs and the next page's token (``""`` at the end).

    Raises:
        InvalidArgumentError: negative ``page_size``; malformed/foreign ``page_token``.
    """
    if page_size < 0:
        raise InvalidArgumentError("page_size must not be negative", field_path="page_size")
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    digest = filters.digest()
    cursor = tokens.decode(org_id, digest, page_token)
    t = flow_runs.c
    stmt = select(flow_runs).where(t.org_id == org_id, t.is_deleted == false())
    if filters.flow_api_name is not None:
        v = flow_versions.c
        versions = select(v.flow_version_id).where(
            v.org_id == org_id, v.flow_id == filters.flow_api_name
        )
        stmt = stmt.where(t.flow_version_id.in_(versions))
    if filters.flow_version_id is not None:
        stmt = stmt.where(t.flow_version_id == filters.flow_version_id)
    if filters.plan_id is not None:
        stmt = stmt.where(t.plan_id == filters.plan_id)
    if filters.states:
        stmt = stmt.where(t.runtime_state.in_(sorted(s.code for s in filters.states)))
    if filters.created_after is not None:
        stmt = stmt.where(t.created_at >= filters.created_after)
    if filters.created_before is not None:
        stmt = stmt.where(t.created_at < filters.created_before)
    if cursor is not None:
        stmt = stmt.where(
            or_(
                t.created_at > cursor.created_at,
                and_(t.created_at == cursor.created_at, t.flow_run_id > cursor.flow_run_id),
            )
        )
    stmt = stmt.order_by(t.created_at, t.flow_run_id).limit(size + 1)
    rows = (await conn.execute(stmt)).mappings().all()
    runs = [run_from_row(r) for r in rows[:size]]
    token = ""
    if len(rows) > size:
        last = runs[-1]
        token = tokens.encode(org_id, digest, PageCursor(last.created_at, last.flow_run_id))
    return runs, token
