"""Fixtures of the migration-contract tests.

* ``engine`` — one migrated runtime database per module and backend (``sqlite``,
  ``mariadb``), shared by tests that only touch their own org (legacy owner, cohorts).
* ``fresh_engine`` — a brand-new migrated database per test, for tests that move the
  deployment-wide control record (bridge gates, rollback, release evidence).
* ``legacy`` — a legacy owner world: an org with stored Flow versions, the legacy store on
  a shiftable database clock, and the service with the corpus record view.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.definitions import repository as repo
from runtime_svc.legacy.service import LegacyInterviewService
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.worker import FixedViews
from services import db, migrate
from services.auth import TrustedRuntimeWorkScope
from services.digest import versioned_digest
from tests.integration.kernel.conftest import ShiftedClock, kernel_db_url  # noqa: F401
from tests.integration.worker.support import record_view

LEASE = timedelta(minutes=5)


@pytest.fixture
async def engine(kernel_db_url: str) -> AsyncIterator[AsyncEngine]:  # noqa: F811
    eng = db.create_engine(kernel_db_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def fresh_engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade(db_url, "runtime_svc")
    eng = db.create_engine(db_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


def new_scope(org: str | None = None) -> TrustedRuntimeWorkScope:
    org = org or f"org-{uuid.uuid4().hex[:12]}"
    return TrustedRuntimeWorkScope(
        org_id=org,
        app_installation_id="inst-crm-1",
        runtime_capability_id="cap-flow-runtime",
        runtime_work_binding_digest=versioned_digest("binding", {"org": org}),
    )


async def register_flow(engine: AsyncEngine, org_id: str, source: dict[str, Any]) -> str:
    """Store a Flow version (what RegisterFlowVersion writes); returns its id."""
    version_id = f"fv-{uuid.uuid4().hex[:12]}"
    async with db.transaction(engine) as conn:
        now = await db.db_now(conn)
        await repo.insert_flow_version_txn(
            conn,
            repo.FlowVersionRow(
                org_id=org_id,
                flow_version_id=version_id,
                flow_api_name=str(source["api_name"]),
                version_number=int(source.get("version", 1)),
                source_json=json.dumps(source),
                metadata_digest=versioned_digest("test-metadata", source),
                label="migration-test",
                created_at=now,
            ),
        )
    return version_id


@dataclass
class LegacyWorld:
    """One org's legacy owner."""

    engine: AsyncEngine
    scope: TrustedRuntimeWorkScope
    clock: ShiftedClock
    store: LegacyInterviewStore
    service: LegacyInterviewService

    @property
    def org(self) -> str:
        return self.scope.org_id

    def other_service(self, owner: str) -> LegacyInterviewService:
        """A second legacy scheduler process on the same database and clock."""
        store = LegacyInterviewStore(self.engine, lease=LEASE, clock=self.clock)
        return LegacyInterviewService(self.engine, store, FixedViews(record_view()), owner=owner)

    async def flow(self, source: dict[str, Any]) -> str:
        return await register_flow(self.engine, self.org, source)


@pytest.fixture
async def legacy(engine: AsyncEngine) -> LegacyWorld:
    clock = ShiftedClock()
    store = LegacyInterviewStore(engine, lease=LEASE, clock=clock)
    service = LegacyInterviewService(engine, store, FixedViews(record_view()), owner="legacy-a")
    return LegacyWorld(engine, new_scope(), clock, store, service)
