"""Event metrics of §19 on a scraped ``/metrics`` endpoint, each moving when its event
happens through the real code path (worker, kernel, wait engine, database layer), on
SQLite and MariaDB.

Every test installs a fresh process :class:`~services.metrics.FlowMetrics`, serves it on
a free loopback port, drives the event, then scrapes and parses the endpoint (the text
format, prometheus-client's parser) — nothing reads counters in process.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pymysql
import pytest
from sqlalchemy import event, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    LeaseFence,
    RetryPolicy,
    RunState,
    StartRunRequest,
)
from runtime_svc.schema import flow_dependencies
from runtime_svc.waits.evidence import SignalSubmission, evidence_digest
from runtime_svc.worker import FixedViews, Outcome, StepWorker
from runtime_svc.worker.loop import DEFAULT_QUEUE_CLASSES
from services import db
from services.effect_contract import CompletionEvidence, CompletionOutcomeCode, effect_handoff_key
from services.errors import CommitOutcomeUnknownError, InvalidArgumentError, UnavailableError
from services.metrics import (
    FlowMetrics,
    MetricsServer,
    install_metrics,
    metrics,
    start_metrics_server,
)
from tests.integration.waits.support import World, approval, signal_flow
from tests.integration.worker.support import record_view
from tests.support.metrics import SECTION_19, Scrape, scrape

pytestmark = pytest.mark.asyncio


@dataclass
class Served:
    metrics: FlowMetrics
    server: MetricsServer

    async def scrape(self) -> Scrape:
        return await scrape(self.server.port)


@pytest.fixture
def served() -> Iterator[Served]:
    previous = metrics()
    fresh = install_metrics()
    server = start_metrics_server("127.0.0.1", 0, fresh)
    try:
        yield Served(fresh, server)
    finally:
        server.stop()
        install_metrics(previous)


async def _waiting(world: World, key: str) -> str:
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key=key)
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING
    return run.flow_run_id


async def test_every_section_19_family_is_exposed_before_any_event(served: Served) -> None:
    scraped = await served.scrape()
    event_families = {
        name
        for names in SECTION_19.values()
        for name in names
        # the state gauges are declared by the state scan (test_metrics_state)
        if name
        not in {
            "nexus_flow_runs",
            "nexus_flow_queue_oldest_age_seconds",
            "nexus_flow_queue_depth",
            "nexus_flow_dependency_oldest_age_seconds",
            "nexus_flow_projection_divergent_runs",
            "nexus_flow_dual_ownership_runs",
        }
    }
    missing = sorted(f for f in event_families if not scraped.has(f))
    assert missing == []


async def test_claims_steps_checkpoints_locks_and_waits_move(world: World, served: Served) -> None:
    before = await served.scrape()
    assert before.value("nexus_flow_claims_total") == 0
    run_id = await _waiting(world, "k1")
    waiting = await served.scrape()
    assert waiting.value("nexus_flow_claims_total") >= 1
    assert waiting.value("nexus_flow_queue_age_seconds_count") >= 1
    assert waiting.value("nexus_flow_step_attempts_total", outcome="committed") >= 1
    assert waiting.value("nexus_flow_step_duration_seconds_count", step_kind="DependencyWait") >= 1
    assert (
        waiting.value(
            "nexus_flow_step_transaction_duration_seconds_count",
            step_kind="DependencyWait",
            profile="durable_orchestration",
        )
        >= 1
    )
    # The input checkpoint and the wait's output checkpoint.
    assert waiting.value("nexus_flow_checkpoint_size_bytes_count") >= 2
    assert waiting.value("nexus_flow_db_transactions_total", outcome="committed") > 0

    await world.rt.signals.submit(world.work, approval("k1", "tok-1"))
    await world.rt.signals.submit(world.work, approval("k1", "tok-1"))  # a duplicate
    woken = await served.scrape()
    assert woken.value("nexus_flow_wake_signals_total", producer="external", result="new") == 1
    assert (
        woken.value("nexus_flow_wake_signals_total", producer="external", result="duplicate") == 1
    )
    assert woken.value("nexus_flow_dependency_age_seconds_count", producer="external") == 1
    assert woken.value("nexus_flow_wake_latency_seconds_count", producer="external") == 1

    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
    done = await served.scrape()
    # The resumed CreateRecord step took its business locks in canonical order.
    assert done.value("nexus_flow_lock_wait_seconds_count") >= 1
    assert (
        done.value(
            "nexus_flow_step_transaction_duration_seconds_count", step_kind="BoundedMutation"
        )
        >= 1
    )
    assert done.value("nexus_flow_claims_total") > waiting.value("nexus_flow_claims_total")


async def test_claim_conflicts_lease_expiries_and_stale_fences(
    world: World, served: Served
) -> None:
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="k2")
    [candidate] = [
        c
        for lane in DEFAULT_QUEUE_CLASSES
        for c in await world.store.eligible_work(world.org, lane)
    ]
    lane = candidate.queue_class

    async def expire_and_recover(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed":
            world.clock.advance(seconds=world.store.policy.lease_duration_ms / 1000 + 1)
            recovered, _ = await world.lease_sweeper.sweep_org(world.org)
            assert recovered == 1

    stale = StepWorker(
        world.engine,
        world.store,
        FixedViews(record_view()),
        owner="stale",
        waits=world.rt.steps,
        heartbeat=False,
        hook=expire_and_recover,
    )
    assert await stale.process(world.org, candidate) is Outcome.FENCE_LOST
    # A second claimer holding the same (now outdated) candidate loses the claim.
    assert await world.worker.process(world.org, candidate) is Outcome.NOT_ELIGIBLE
    scraped = await served.scrape()
    assert scraped.value("nexus_flow_lease_expiries_total") == 1
    assert scraped.value("nexus_flow_stale_fence_rollbacks_total", lane=lane) == 1
    assert scraped.value("nexus_flow_claim_conflicts_total", lane=lane) == 1
    assert scraped.value("nexus_flow_step_attempts_total", outcome="fence_lost") == 1
    assert (await world.run(run.flow_run_id)).state is RunState.RUNNABLE


class _NoViews:
    """A record-view source whose catalog is unreachable (a retryable step failure)."""

    async def view_for(self, scope: Any) -> Any:
        raise UnavailableError("catalog unreachable", reason="catalog_unavailable")


async def test_retries_and_retry_budget_exhaustion(world: World, served: Served) -> None:
    run_id = await _waiting(world, "k3")
    await world.rt.signals.submit(world.work, approval("k3", "tok-3"))
    store = FlowRunStateStore(
        world.engine,
        policy=RetryPolicy(
            max_attempts=2,
            base_delay_ms=60_000,
            max_delay_ms=60_000,
            jitter_ratio=0.0,
            lease_duration_ms=300_000,
            max_lease_expiries=3,
        ),
        clock=world.clock,
    )
    worker = StepWorker(
        world.engine, store, _NoViews(), owner="retry", waits=world.rt.steps, heartbeat=False
    )
    # The resumed wait step commits; the next step (a CreateRecord) needs the catalog's
    # view: a retryable failure, then the exhausted budget.
    outcomes: list[Outcome] = []
    for _ in range(6):
        outcomes += await worker.run_batch(world.org)
        if (await world.run(run_id)).state is RunState.TERMINAL_FAILED:
            break
        world.clock.advance(hours=1)
    assert outcomes[-2:] == [Outcome.RETRY_SCHEDULED, Outcome.FAILED]
    assert (await world.run(run_id)).state is RunState.TERMINAL_FAILED
    scraped = await served.scrape()
    assert scraped.value("nexus_flow_step_retries_total", reason="metadata_view_unavailable") == 1
    assert scraped.value("nexus_flow_retry_budget_exhausted_total") == 1


async def test_missing_producers_and_checkpoint_serialization_failures(
    world: World, served: Served
) -> None:
    source = {
        "api_name": "wait_action",
        "version": 1,
        "process_type": "autolaunched",
        "variables": [{"name": "recordId", "type": "string", "input": True}],
        "start": "ask",
        "elements": [
            {
                "api_name": "ask",
                "type": "ActionCall",
                "action_type": "await_approval",  # a producer no runtime registers
                "inputs": {"recordId": "recordId"},
            }
        ],
    }
    plan_id = await world.seed(source)
    run = await world.start("wait_action", recordId="x")
    assert (await world.drive(run.flow_run_id)).state is RunState.QUARANTINED
    _, plan = world.plans["wait_action"]
    step = plan.step(plan.start_step)
    with pytest.raises(InvalidArgumentError):
        await world.store.create_run(
            world.scope,
            StartRunRequest(
                plan_id=plan_id,
                first_step=FirstStep(step.key, step.kind.value, "durable_mutation"),
                input=CheckpointInput(context={"variables": {"password": "hunter2"}}),
            ),
        )
    scraped = await served.scrape()
    assert scraped.value("nexus_flow_dependency_missing_producers_total") == 1
    assert (
        scraped.value(
            "nexus_flow_checkpoint_serialization_failures_total",
            reason="checkpoint_credential_rejected",
        )
        == 1
    )


async def test_deadlocks_lock_wait_timeouts_rollbacks_and_ambiguous_commits(
    engine: AsyncEngine, served: Served
) -> None:
    class Boom(Exception):
        pass

    async def fail_with(exc: BaseException) -> None:
        async def body(conn: AsyncConnection) -> None:
            raise exc

        with pytest.raises(Exception):  # noqa: B017 - whichever error the layer re-raises
            await db.run_in_transaction(engine, body, max_attempts=2)

    await fail_with(sqlite3.OperationalError("database is locked"))  # deadlock class
    await fail_with(pymysql.err.OperationalError(1205, "Lock wait timeout exceeded"))
    await fail_with(Boom("domain error"))

    def lost(_conn: Any) -> None:
        raise pymysql.err.OperationalError(2013, "Lost connection to server during query")

    event.listen(engine.sync_engine, "commit", lost)
    try:
        with pytest.raises(CommitOutcomeUnknownError):
            async with db.transaction(engine) as conn:
                await conn.execute(
                    update(flow_dependencies)
                    .where(flow_dependencies.c.org_id == "none")
                    .values(state="Pending")
                )
    finally:
        event.remove(engine.sync_engine, "commit", lost)
    scraped = await served.scrape()
    # run_in_transaction retried each retryable error once (max_attempts=2).
    assert scraped.value("nexus_flow_db_deadlocks_total") == 2
    assert scraped.value("nexus_flow_db_lock_wait_timeouts_total") == 2
    assert scraped.value("nexus_flow_db_transactions_total", outcome="rolled_back") == 5
    assert scraped.value("nexus_flow_db_transactions_total", outcome="commit_unknown") == 1


async def test_an_effect_completion_resolution_observes_the_effect_latency(
    world: World, served: Served
) -> None:
    """Until the runtime's EffectSubmit step lands, the waiting dependency is re-pointed at
    an effect handoff key (what EffectSubmit writes) and the owner's receipt is submitted
    as the owner's delivery does; the resolution path is the real one."""
    run_id = await _waiting(world, "k4")
    key = effect_handoff_key(
        world.scope, flow_run_id=run_id, submit_step_key="send#submit", invocation_ordinal=0
    )
    d = flow_dependencies.c
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            update(flow_dependencies)
            .where(d.org_id == world.org, d.flow_run_id == run_id)
            .values(producer_kind="effect.completion", producer_key=key)
        )
    receipt = CompletionEvidence(
        command_id="cmd_0123456789abcdef",
        outcome_version=1,
        outcome=CompletionOutcomeCode.SUCCEEDED,
        effect_owner_kind="email.smtp",
        effect_handoff_key=key,
    )
    doc = json.loads(receipt.to_json())
    outcome = await world.rt.signals.submit(
        world.work,
        SignalSubmission(
            producer_kind="effect.completion",
            producer_key=key,
            wake_token=receipt.wake_token,
            wake_version=1,
            evidence_digest=evidence_digest(doc),
            evidence_json=receipt.to_json(),
        ),
    )
    assert outcome.signal.dependency_id is not None
    scraped = await served.scrape()
    assert scraped.value("nexus_flow_effect_completion_latency_seconds_count") == 1
    assert (
        scraped.value("nexus_flow_dependency_age_seconds_count", producer="effect_completion") == 1
    )
    assert (
        scraped.value("nexus_flow_wake_signals_total", producer="effect_completion", result="new")
        == 1
    )
