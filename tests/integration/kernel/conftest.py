"""Fixtures of the kernel store tests: one migrated runtime database per module and
backend (``sqlite``, ``mariadb``), a fresh engine per test, and a per-test world (org,
work scope, seeded plan, store with a shiftable database clock).

Isolation comes from every test using its own org; the MariaDB case follows
``tests/conftest.py`` (skipped locally without ``FLOW_TEST_MYSQL_URL``, failed under
``CI=true``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RetryPolicy
from runtime_svc.schema import execution_plans, flow_versions
from services import db
from services.auth import TrustedRuntimeWorkScope
from services.digest import versioned_digest
from tests.support.databases import BACKENDS, module_database


@pytest.fixture(scope="module", **BACKENDS)
def kernel_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated runtime database shared by one test module, on each backend."""
    yield from module_database(request, tmp_path_factory, prefix="kernel")


@pytest.fixture
async def engine(kernel_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(kernel_db_url, pool_size=6)
    try:
        yield eng
    finally:
        await eng.dispose()


@dataclass
class ShiftedClock:
    """The database clock plus an offset the test moves forward (never a worker clock:
    the offset is applied to ``db_now``, so durable times still come from the server)."""

    offset: timedelta = field(default_factory=timedelta)

    async def __call__(self, conn: AsyncConnection) -> datetime:
        return await db.db_now(conn) + self.offset

    def advance(self, **kwargs: float) -> None:
        self.offset += timedelta(**kwargs)


#: Delays of minutes, reached by shifting the clock: the few milliseconds of real time a
#: test takes can never make a "not yet due" check pass or fail.
TEST_POLICY = RetryPolicy(
    max_attempts=4,
    base_delay_ms=60_000,
    max_delay_ms=3_600_000,
    jitter_ratio=0.25,
    lease_duration_ms=300_000,
    max_lease_expiries=2,
)


@dataclass
class World:
    """One test's org: scope, a seeded plan, a store and its clock."""

    engine: AsyncEngine
    scope: TrustedRuntimeWorkScope
    plan_id: str
    plan_digest: str
    clock: ShiftedClock
    store: FlowRunStateStore

    @property
    def org(self) -> str:
        return self.scope.org_id

    def other_store(self, **kwargs: object) -> FlowRunStateStore:
        """A second store (another worker process) on the same database and clock."""
        options: dict[str, object] = {"policy": TEST_POLICY, "clock": self.clock}
        options.update(kwargs)
        return FlowRunStateStore(self.engine, **options)  # type: ignore[arg-type]


def new_scope() -> TrustedRuntimeWorkScope:
    org = f"org_{uuid.uuid4().hex[:12]}"
    return TrustedRuntimeWorkScope(
        org_id=org,
        app_installation_id="inst_1",
        runtime_capability_id="cap_1",
        runtime_work_binding_digest=versioned_digest("binding", {"org": org}),
    )


async def seed_plan(engine: AsyncEngine, scope: TrustedRuntimeWorkScope) -> tuple[str, str]:
    """A Flow version and a Durable Orchestration plan in ``scope`` (written through the
    schema: plans are owned by the definitions service, not the kernel)."""
    now = datetime.now().astimezone()
    version_id, plan_id = f"fv_{uuid.uuid4().hex[:12]}", f"plan_{uuid.uuid4().hex[:12]}"
    plan_digest = versioned_digest("plan", {"plan": plan_id})
    digest = versioned_digest("test", {"x": 1})
    async with db.transaction(engine) as conn:
        await conn.execute(
            flow_versions.insert().values(
                org_id=scope.org_id,
                flow_version_id=version_id,
                flow_id=f"Kernel_{version_id}",
                version_number=1,
                source_payload="{}",
                metadata_digest=digest,
                created_at=now,
            )
        )
        await conn.execute(
            execution_plans.insert().values(
                org_id=scope.org_id,
                app_installation_id=scope.app_installation_id,
                runtime_capability_id=scope.runtime_capability_id,
                runtime_work_binding_digest=scope.runtime_work_binding_digest,
                plan_id=plan_id,
                flow_version_id=version_id,
                metadata_digest=digest,
                compiler_version="test",
                catalog_generation_id="gen_1",
                catalog_digest=digest,
                catalog_revision=1,
                schema_generation=1,
                engine_generation=1,
                catalog_snapshot_digest=digest,
                runtime_metadata_view_digest=digest,
                trigger_binding_digest=digest,
                policy_version=1,
                execution_profile="durable_orchestration",
                plan_digest=plan_digest,
                plan_payload="{}",
                bound_summary="{}",
                diagnostic_summary="[]",
                created_at=now,
            )
        )
    return plan_id, plan_digest


@pytest.fixture
async def world(engine: AsyncEngine) -> World:
    scope = new_scope()
    plan_id, plan_digest = await seed_plan(engine, scope)
    clock = ShiftedClock()
    store = FlowRunStateStore(engine, policy=TEST_POLICY, clock=clock)
    return World(engine, scope, plan_id, plan_digest, clock, store)
