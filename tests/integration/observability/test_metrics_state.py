"""The authoritative-state gauges of §19 (run counts by state, queue depth and oldest age
by lane, pending waits, outbox and command backlogs, projection divergence, dual
ownership): read by the bounded scan from a fresh database of their own (SQLite and
MariaDB), served and scraped from ``/metrics``.

The scan visits one org per pass here, so the tests also show the rotation: the gauges
are complete once every org was visited, and an org whose rows are gone drops out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime

import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.api.proto import handoff_from_request
from effect_owner_svc.inbox.store import accept_handoff_txn
from effect_owner_svc.observability import CommandStateSource
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from runtime_svc.kernel import RunState
from runtime_svc.observability import RuntimeStateSource
from runtime_svc.outbox import RUNTIME_OUTBOX, enqueue_effect_submit_txn
from runtime_svc.schema import flow_runs
from services import db
from services.auth import TrustedRuntimeWorkScope
from services.metrics import FlowMetrics, MetricsServer, StateFamily, start_metrics_server
from services.metrics_state import OutboxStateSource, Sample, StateScan
from services.proto import effect_v1
from tests.integration.effects.harness import Scope, envelope, submit_intent
from tests.integration.waits.support import World, approval, new_scope, signal_flow
from tests.support.dbs import migrated_database
from tests.support.metrics import Scrape, scrape

pytestmark = pytest.mark.asyncio

_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]


@pytest.fixture(params=_BACKENDS, ids=["sqlite", "mariadb"])
def fresh_urls(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A runtime and an owner database of this test alone (the scan sees every org)."""
    with (
        migrated_database(request, tmp_path_factory, "runtime_svc") as runtime,
        migrated_database(request, tmp_path_factory, "effect_owner_svc") as owner,
    ):
        yield runtime, owner


@pytest.fixture
async def engines(fresh_urls: tuple[str, str]) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    runtime = db.create_engine(fresh_urls[0], pool_size=4)
    owner = db.create_engine(fresh_urls[1], pool_size=4)
    try:
        yield runtime, owner
    finally:
        await runtime.dispose()
        await owner.dispose()


@pytest.fixture
def served() -> Iterator[tuple[FlowMetrics, MetricsServer]]:
    instance = FlowMetrics()
    server = start_metrics_server("127.0.0.1", 0, instance)
    try:
        yield instance, server
    finally:
        server.stop()


async def _rotate(scan: StateScan, passes: int = 6) -> None:
    """Enough one-org passes for a complete rotation over the test's orgs."""
    for _ in range(passes):
        await scan.scan_once()


async def _scan_until(
    scan: StateScan, port: int, check: Callable[[Scrape], bool], *, max_passes: int = 40
) -> Scrape:
    """Scan pass by pass until the scraped gauges satisfy ``check`` (bounded)."""
    for _ in range(max_passes):
        await scan.scan_once()
        scraped = await scrape(port)
        if check(scraped):
            return scraped
    raise AssertionError(f"the gauges never satisfied the check in {max_passes} passes")


async def test_runtime_state_gauges_come_from_the_database(
    engines: tuple[AsyncEngine, AsyncEngine], served: tuple[FlowMetrics, MetricsServer]
) -> None:
    engine, _ = engines
    instance, server = served
    a, b = World(engine, new_scope()), World(engine, new_scope())
    for w in (a, b):
        await w.seed(signal_flow())
    waiting = await a.start("wait_signal", key="w")
    assert (await a.drive(waiting.flow_run_id)).state is RunState.WAITING
    # Accepted ten minutes ago and never claimed: a queue with an old head.
    a.clock.advance(minutes=-10)
    queued = await a.start("wait_signal", key="q")
    a.clock.advance(minutes=10)
    done = await b.start("wait_signal", key="d")
    await b.drive(done.flow_run_id)
    await b.rt.signals.submit(b.work, approval("d", "tok-d"))
    assert (await b.drive(done.flow_run_id)).state is RunState.SUCCEEDED
    async with db.transaction(engine) as conn:
        await enqueue_effect_submit_txn(conn, submit_intent(Scope(a.org), run=waiting.flow_run_id))

    scan = StateScan(
        engine,
        [
            RuntimeStateSource(count_cap=1000, window=1),
            OutboxStateSource(RUNTIME_OUTBOX, "runtime", count_cap=1000),
        ],
        orgs_per_pass=1,
        instance=instance,
    )
    assert await scan.scan_once() == 1  # one org per pass: the gauges are partial
    await _rotate(scan)
    s: Scrape = await scrape(server.port)
    assert s.value("nexus_flow_runs", state="Waiting") == 1
    assert s.value("nexus_flow_runs", state="Runnable") == 1
    assert s.value("nexus_flow_runs", state="Succeeded") == 1
    assert s.value("nexus_flow_runs", state="Quarantined") == 0
    lanes = [labels["lane"] for labels, v in s.samples["nexus_flow_queue_depth"] if v]
    assert len(lanes) == 1
    lane = lanes[0]
    assert s.value("nexus_flow_queue_depth", lane=lane) == 1
    assert s.value("nexus_flow_queue_oldest_age_seconds", lane=lane) >= 590
    assert s.value("nexus_flow_dependencies_pending") == 1
    assert s.value("nexus_flow_dependency_oldest_age_seconds") >= 0
    assert s.value("nexus_flow_outbox_messages", outbox="runtime", state="Pending") == 1
    assert s.value("nexus_flow_outbox_oldest_due_age_seconds", outbox="runtime") >= 0
    assert s.value("nexus_flow_projection_divergent_runs") == 0
    assert s.value("nexus_flow_dual_ownership_runs") == 0
    assert s.value("nexus_flow_state_scan_timestamp_seconds") > 0

    # Tampering that only a bug or a second scheduler could cause.
    r = flow_runs.c
    async with db.transaction(engine) as conn:
        await conn.execute(
            update(flow_runs)
            .where(r.org_id == a.org, r.flow_run_id == queued.flow_run_id)
            .values(interview_status="Finished")
        )
        await conn.execute(
            update(flow_runs)
            .where(r.org_id == b.org, r.flow_run_id == done.flow_run_id)
            .values(ownership_epoch=0)
        )
    # Windows of one run: each org's check completes only after several visits.
    s = await _scan_until(
        scan,
        server.port,
        lambda s: (
            s.value("nexus_flow_projection_divergent_runs") > 0
            and s.value("nexus_flow_dual_ownership_runs") > 0
        ),
    )
    assert s.value("nexus_flow_projection_divergent_runs", kind="compatibility_status") == 1
    assert s.value("nexus_flow_dual_ownership_runs", kind="v2_epoch_zero") == 1

    # Repaired data reads zero again after the next complete check.
    async with db.transaction(engine) as conn:
        await conn.execute(update(flow_runs).where(r.org_id == b.org).values(ownership_epoch=1))
    s = await _scan_until(
        scan, server.port, lambda s: s.value("nexus_flow_dual_ownership_runs") == 0
    )
    assert s.value("nexus_flow_projection_divergent_runs", kind="compatibility_status") == 1


async def test_counts_are_capped_per_org_and_state(
    engines: tuple[AsyncEngine, AsyncEngine], served: tuple[FlowMetrics, MetricsServer]
) -> None:
    engine, _ = engines
    instance, server = served
    w = World(engine, new_scope())
    await w.seed(signal_flow())
    for i in range(3):
        await w.start("wait_signal", key=f"k{i}")
    scan = StateScan(engine, [RuntimeStateSource(count_cap=2)], instance=instance)
    await scan.scan_once()
    s = await scrape(server.port)
    assert s.value("nexus_flow_runs", state="Runnable") == 2  # "at least 2"


async def test_owner_command_and_outbox_gauges(
    engines: tuple[AsyncEngine, AsyncEngine], served: tuple[FlowMetrics, MetricsServer]
) -> None:
    _, owner = engines
    instance, server = served
    scope = Scope(new_scope().org_id)
    trusted = TrustedRuntimeWorkScope(
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )
    for run in ("r1", "r2"):
        request = effect_v1.AcceptHandoffRequest(
            request_id=f"req-{run}", scope=scope.proto(), envelope=envelope(scope, run=run)
        )
        async with db.transaction(owner) as conn:
            await accept_handoff_txn(conn, handoff_from_request(request, trusted))
    scan = StateScan(
        owner,
        [
            CommandStateSource(count_cap=100),
            OutboxStateSource(OWNER_OUTBOX, "owner", count_cap=100),
        ],
        instance=instance,
    )
    await scan.scan_once()
    s = await scrape(server.port)
    assert s.value("nexus_flow_effect_commands", state="ACCEPTED") == 2
    assert s.value("nexus_flow_effect_commands", state="SUCCEEDED") == 0
    assert s.value("nexus_flow_effect_command_oldest_due_age_seconds") >= 0
    assert s.value("nexus_flow_outbox_messages", outbox="owner", state="Pending") == 0
    assert s.value("nexus_flow_state_scan_duration_seconds_count") == 1


class _FakeSource:
    """A state source over an in-memory org list (the scan's rotation, no tables)."""

    families = (StateFamily("nexus_flow_fake_rows", "rows per org, summed"),)

    def __init__(self, orgs: list[str]) -> None:
        self.present = orgs
        self.visits: list[str] = []
        self.fail: set[str] = set()

    def baseline(self) -> list[Sample]:
        return [Sample("nexus_flow_fake_rows", (), 0)]

    async def orgs(self, conn: object, after: str, limit: int) -> list[str]:
        return [o for o in sorted(self.present) if o > after][:limit]

    async def probe(self, conn: object, org_id: str, now: datetime) -> list[Sample]:
        self.visits.append(org_id)
        if org_id in self.fail:
            raise RuntimeError("probe failed")
        return [Sample("nexus_flow_fake_rows", (), 1)]


async def test_the_scan_rotates_over_every_org_and_drops_vanished_ones() -> None:
    """A fake source over an org list (no tables): the rotation, not the SQL."""
    engine = db.create_engine("sqlite+aiosqlite:///:memory:")
    try:
        source = _FakeSource(["a", "b", "c"])
        m = FlowMetrics()
        scan = StateScan(engine, [source], orgs_per_pass=2, instance=m)
        assert m.state.value("nexus_flow_fake_rows") is None
        assert await scan.scan_once() == 2
        assert m.state.value("nexus_flow_fake_rows") == 2  # a, b
        assert await scan.scan_once() == 1
        assert m.state.value("nexus_flow_fake_rows") == 3  # c: a rotation wrapped
        source.present = ["a", "c"]
        source.fail = {"c"}
        assert await scan.scan_once() == 2  # a, c (c fails: its last value stays)
        assert m.state.value("nexus_flow_fake_rows") == 3
        assert await scan.scan_once() == 0  # the rotation wraps: b is gone
        assert m.state.value("nexus_flow_fake_rows") == 2
        assert source.visits == ["a", "b", "c", "a", "c"]
        assert m.registry.get_sample_value("nexus_flow_state_scan_errors_total") == 1
        assert m.registry.get_sample_value("nexus_flow_state_scan_duration_seconds_count") == 4
    finally:
        await engine.dispose()
