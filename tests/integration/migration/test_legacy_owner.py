"""The LegacyInterpreter owner on both databases (§20.3 6-8, §20.6, §20.8; §22.2 legacy
rows; §22.8 "new application with legacy epoch runs", "paused legacy drain").

Every test runs in its own org on a shared migrated database; V2 runs are created in the
same org through the V2 kernel store, so the owner/epoch predicates are what keeps the two
owners apart — not an org boundary.
"""

from __future__ import annotations

from sqlalchemy import func, select

from runtime_svc.kernel.states import CompatibilityStatus, ExecutionOwner, RunState
from runtime_svc.legacy.interpreter import Finished
from runtime_svc.legacy.model import LegacyClaim, Rejected, Rejection
from runtime_svc.legacy.store import LegacyRejectedError, _legacy_cas
from runtime_svc.schema import audit_records, flow_checkpoints, flow_step_executions, records
from services import db
from services.errors import FenceLostError, NotFoundError
from tests.integration.migration.conftest import LegacyWorld
from tests.integration.migration.flows import (
    event_wait_flow,
    pure_flow,
    time_wait_flow,
    write_flow,
)
from tests.integration.migration.support import (
    capture_inserts,
    raw_run,
    tamper,
    v2_waiting_run,
    v2_world,
)

LEGACY = ExecutionOwner.LEGACY_INTERPRETER.code


async def _count(world: LegacyWorld, table: object, **where: object) -> int:
    async with db.transaction(world.engine, readonly=True) as conn:
        t = table  # a Table
        stmt = select(func.count()).select_from(t)  # type: ignore[arg-type]
        for name, value in where.items():
            stmt = stmt.where(t.c[name] == value)  # type: ignore[attr-defined]
        return int((await conn.execute(stmt)).scalar_one())


async def _paused(world: LegacyWorld, source: dict[str, object], **inputs: object) -> str:
    version = await world.flow(source)
    interview, created = await world.service.start(world.scope, version, inputs)
    assert created and interview.status is CompatibilityStatus.PAUSED
    return interview.flow_run_id


# --- creation and execution ------------------------------------------------------------


async def test_every_bridge_creation_path_writes_trusted_org_and_legacy_0_0(
    legacy: LegacyWorld,
) -> None:
    version = await legacy.flow(pure_flow())
    with capture_inserts(legacy.engine, "flow_runs") as inserts:
        interview, created = await legacy.service.start(legacy.scope, version, {"amount": 70})
        async with db.transaction(legacy.engine) as conn:
            queued, _, _ = await legacy.service.new_interview_txn(
                conn, legacy.scope, version, {"amount": 1}
            )

    assert created
    assert len(inserts) == 2
    for sent in inserts:
        # Sent explicitly by the writer — never left to the column defaults.
        assert sent["org_id"] == legacy.org
        assert sent["execution_owner"] == LEGACY
        assert sent["ownership_epoch"] == 0
        assert sent["state_version"] == 0
        assert sent["is_deleted"] is False
        assert sent["plan_id"] is None
    row = await raw_run(legacy.engine, legacy.org, interview.flow_run_id)
    assert (row["execution_owner"], row["ownership_epoch"]) == (LEGACY, 0)
    assert queued.status is CompatibilityStatus.PAUSED and queued.state_version == 0


async def test_new_application_runs_legacy_epoch_runs_to_completion(legacy: LegacyWorld) -> None:
    version = await legacy.flow(write_flow())
    interview, _ = await legacy.service.start(legacy.scope, version, {"label": "Acme"})

    assert interview.status is CompatibilityStatus.FINISHED
    assert interview.runtime_state == RunState.SUCCEEDED.code
    assert (interview.execution_owner, interview.ownership_epoch) == (LEGACY, 0)
    acct = (interview.outputs() or {})["acct"]
    async with db.transaction(legacy.engine, readonly=True) as conn:
        stored = (
            await conn.execute(
                select(records.c.fields).where(
                    records.c.org_id == legacy.org, records.c.record_id == acct["Id"]
                )
            )
        ).scalar_one()
    assert '"Status":"touched"' in stored.replace(" ", "")
    # Business lineage names the run; no V2 step or checkpoint was ever written.
    assert await _count(legacy, audit_records, flow_run_id=interview.flow_run_id) == 2
    assert await _count(legacy, flow_step_executions, flow_run_id=interview.flow_run_id) == 0
    assert await _count(legacy, flow_checkpoints, flow_run_id=interview.flow_run_id) == 0


async def test_a_time_wait_pauses_and_the_due_list_resumes_it(legacy: LegacyWorld) -> None:
    run_id = await _paused(legacy, time_wait_flow(), label="Acme")
    paused = await legacy.store.get(legacy.org, run_id)
    assert paused.current_element == "cool_off" and paused.run_after is not None

    assert await legacy.store.due_list(legacy.org) == []
    legacy.clock.advance(minutes=61)
    [due] = await legacy.store.due_list(legacy.org)
    assert due.flow_run_id == run_id

    [report] = await legacy.service.run_due(legacy.org)
    assert isinstance(report.segment and report.segment.status, Finished)
    assert report.interview.status is CompatibilityStatus.FINISHED


async def test_an_expired_wait_follows_its_expiry_policy(legacy: LegacyWorld) -> None:
    fault_path = await _paused(
        legacy, event_wait_flow("legacy_expiry_fault", expiry="fault_path"), ticket="A"
    )
    terminal = await _paused(legacy, event_wait_flow("legacy_expiry_terminal"), ticket="B")
    assert await legacy.store.due_list(legacy.org) == []  # due only at the deadline

    legacy.clock.advance(days=8)
    reports = {r.interview.flow_run_id: r for r in await legacy.service.run_due(legacy.org)}

    via_fault = reports[fault_path].interview
    assert via_fault.status is CompatibilityStatus.ERROR
    assert via_fault.terminal_cause_code == "WAIT_EXPIRED"  # the fault connector's Fault
    assert via_fault.current_element == "expired"
    failed = reports[terminal].interview
    assert failed.status is CompatibilityStatus.ERROR
    assert failed.terminal_cause_code == "wait_expired"


async def test_a_direct_resume_releases_an_event_wait_only_when_its_condition_holds(
    legacy: LegacyWorld,
) -> None:
    run_id = await _paused(legacy, event_wait_flow(), ticket="T-1")

    rejected = await legacy.service.resume(legacy.org, run_id, {"status": "rejected"})
    assert rejected.interview.status is CompatibilityStatus.PAUSED
    approved = await legacy.service.resume(
        legacy.org,
        run_id,
        {"status": "approved"},
        expected_version=rejected.interview.state_version,
    )
    assert approved.interview.status is CompatibilityStatus.FINISHED
    assert approved.interview.outputs() == {"outcome": "approved"}


async def test_stale_claim_recovery_requeues_a_crashed_segment(legacy: LegacyWorld) -> None:
    run_id = await _paused(legacy, time_wait_flow("legacy_crash"), label="Crash")
    legacy.clock.advance(minutes=61)
    claim = await legacy.store.claim(legacy.org, run_id, expected_version=None, claimer="dead")
    assert isinstance(claim, LegacyClaim)
    # The claimer dies before running its segment: nothing is due, the claim is live.
    assert await legacy.store.due_list(legacy.org) == []
    assert await legacy.store.recover_stale(legacy.org) == []

    legacy.clock.advance(minutes=10)  # past the 5-minute lease
    assert await legacy.store.recover_stale(legacy.org) == [run_id]
    [report] = await legacy.service.run_due(legacy.org)
    assert report.interview.status is CompatibilityStatus.FINISHED
    # The dead claimer's fence is gone: its late commit cannot publish anything.
    late = await legacy.service.execute(claim, None)
    assert late.segment is None
    assert late.interview.status is CompatibilityStatus.FINISHED


async def test_two_legacy_schedulers_claim_one_due_interview_once(legacy: LegacyWorld) -> None:
    run_id = await _paused(legacy, time_wait_flow("legacy_race"), label="Race")
    legacy.clock.advance(minutes=61)
    [due] = await legacy.store.due_list(legacy.org)

    first = await legacy.store.claim(
        legacy.org, run_id, expected_version=due.state_version, claimer="a"
    )
    second = await legacy.other_service("b").store.claim(
        legacy.org, run_id, expected_version=due.state_version, claimer="b"
    )
    assert isinstance(first, LegacyClaim)
    assert second == Rejected(Rejection.VERSION_MISMATCH)


# --- delete ----------------------------------------------------------------------------


async def test_delete_is_an_idempotent_tombstone_that_keeps_the_row(legacy: LegacyWorld) -> None:
    run_id = await _paused(legacy, time_wait_flow("legacy_delete"), label="Gone")

    deleted = await legacy.service.delete(legacy.org, run_id)
    again = await legacy.service.delete(legacy.org, run_id)

    assert deleted.is_deleted and deleted.delete_requested_at is not None
    assert deleted.status is CompatibilityStatus.ERROR
    assert deleted.runtime_state == RunState.CANCELLED.code
    assert again.state_version == deleted.state_version  # nothing changed the second time
    try:
        await legacy.store.get(legacy.org, run_id)
        raise AssertionError("a deleted interview is not visible")
    except NotFoundError:
        pass
    row = await raw_run(legacy.engine, legacy.org, run_id)  # durable lineage retained
    assert row["execution_owner"] == LEGACY and row["legacy_context"]


async def test_delete_racing_a_claimed_segment_rolls_the_segment_back(
    legacy: LegacyWorld,
) -> None:
    run_id = await _paused(legacy, time_wait_flow("legacy_delete_race"), label="Race")
    before = await _count(legacy, audit_records)
    legacy.clock.advance(minutes=61)
    claim = await legacy.store.claim(legacy.org, run_id, expected_version=None, claimer="w")
    assert isinstance(claim, LegacyClaim)

    await legacy.service.delete(legacy.org, run_id)  # delete wins the root
    report = await legacy.service.execute(claim, None)

    assert report.segment is None
    assert report.interview.is_deleted
    assert report.interview.terminal_cause_code == "cancelled"
    assert await _count(legacy, audit_records) == before  # the segment's write rolled back


# --- the V2 row boundary ---------------------------------------------------------------


async def _refused_segment(legacy: LegacyWorld, claim: LegacyClaim) -> None:
    """A segment whose commit the recheck refuses writes nothing; the run is then not a
    legacy interview any more, so the legacy read answers like a missing one."""
    before = await _count(legacy, audit_records)
    try:
        await legacy.service.execute(claim, None)
        raise AssertionError("the segment of a non-legacy row was published")
    except NotFoundError:
        pass
    assert await _count(legacy, audit_records) == before


async def test_the_legacy_due_list_excludes_a_v2_run_projected_as_paused(
    legacy: LegacyWorld,
) -> None:
    world = await v2_world(legacy.engine, legacy.scope, legacy.clock)
    v2_run = await v2_waiting_run(world)
    await tamper(legacy.engine, legacy.org, v2_run, run_after=None)
    row = await raw_run(legacy.engine, legacy.org, v2_run)
    assert row["interview_status"] == "Paused"
    # Make it look due by legacy status/time alone: what a pre-bridge due list would take.
    async with db.transaction(legacy.engine, readonly=True) as conn:
        now = await legacy.store.now(conn)
    await tamper(legacy.engine, legacy.org, v2_run, run_after=now)

    assert [d.flow_run_id for d in await legacy.store.due_list(legacy.org)] == []
    assert await legacy.service.run_due(legacy.org) == []
    assert (await raw_run(legacy.engine, legacy.org, v2_run))["state_version"] == row[
        "state_version"
    ]


async def test_the_legacy_locked_claim_rechecks_owner_and_epoch_and_rejects_a_v2_row(
    legacy: LegacyWorld,
) -> None:
    world = await v2_world(legacy.engine, legacy.scope, legacy.clock)
    v2_run = await v2_waiting_run(world)
    row = await raw_run(legacy.engine, legacy.org, v2_run)

    outcome = await legacy.store.claim(
        legacy.org, v2_run, expected_version=row["state_version"], claimer="x", require_due=False
    )

    assert outcome == Rejected(Rejection.NOT_LEGACY_OWNED)
    after = await raw_run(legacy.engine, legacy.org, v2_run)
    assert after["state_version"] == row["state_version"]
    assert after["runtime_state"] == RunState.WAITING.code


async def test_legacy_stale_recovery_and_direct_resume_reject_v2_ownership(
    legacy: LegacyWorld,
) -> None:
    world = await v2_world(legacy.engine, legacy.scope, legacy.clock)
    v2_run = await v2_waiting_run(world)
    # A V2 root that *looks* like a stale legacy claim: Running with an expired claim.
    await tamper(
        legacy.engine, legacy.org, v2_run, interview_status="Running", legacy_claim_until=None
    )
    row = await raw_run(legacy.engine, legacy.org, v2_run)

    assert await legacy.store.recover_one(legacy.org, v2_run) == Rejected(
        Rejection.NOT_LEGACY_OWNED
    )
    assert await legacy.store.recover_stale(legacy.org) == []
    try:
        await legacy.service.resume(legacy.org, v2_run, {"status": "approved"})
        raise AssertionError("a direct legacy resume of a V2 run must be refused")
    except LegacyRejectedError as exc:
        assert exc.rejection is Rejection.NOT_LEGACY_OWNED
    assert (await raw_run(legacy.engine, legacy.org, v2_run))["state_version"] == row[
        "state_version"
    ]


async def test_every_legacy_mutator_carries_owner_epoch_and_version_predicates(
    legacy: LegacyWorld,
) -> None:
    world = await v2_world(legacy.engine, legacy.scope, legacy.clock)
    v2_run = await v2_waiting_run(world)
    v2_row = await raw_run(legacy.engine, legacy.org, v2_run)
    mine = await _paused(legacy, time_wait_flow("legacy_predicates"), label="P")
    legacy.clock.advance(minutes=61)
    claim = await legacy.store.claim(legacy.org, mine, expected_version=None, claimer="p")
    assert isinstance(claim, LegacyClaim)

    # The locked-row recheck refuses the V2 row in every mutator ...
    for mutate in (
        lambda: legacy.store.delete(legacy.org, v2_run),
        lambda: legacy.store.cancel(legacy.org, v2_run),
    ):
        try:
            await mutate()
            raise AssertionError("a legacy mutator changed a V2 row")
        except LegacyRejectedError as exc:
            assert exc.rejection is Rejection.NOT_LEGACY_OWNED
    forged = LegacyClaim(
        legacy.scope,
        v2_run,
        claim.flow_version_id,
        v2_row["state_version"],
        claim.token,
        claim.context,
    )
    await _refused_segment(legacy, forged)
    # ... and the SQL predicate alone cannot match it either (owner, epoch, version).
    async with db.transaction(legacy.engine) as conn:
        try:
            await _legacy_cas(
                conn, legacy.org, v2_run, v2_row["state_version"], {"current_element": "x"}
            )
            raise AssertionError("the legacy CAS matched a V2 row")
        except FenceLostError:
            pass
    await tamper(legacy.engine, legacy.org, mine, ownership_epoch=7)  # a foreign epoch
    await _refused_segment(legacy, claim)
    async with db.transaction(legacy.engine) as conn:
        try:
            await _legacy_cas(conn, legacy.org, mine, claim.state_version, {"paused_at": None})
            raise AssertionError("the legacy CAS ignored the epoch")
        except FenceLostError:
            pass
    await tamper(legacy.engine, legacy.org, mine, ownership_epoch=0)
    assert await legacy.store.claim(legacy.org, mine, expected_version=0, claimer="q") == (
        Rejected(Rejection.VERSION_MISMATCH)
    )
    after = await raw_run(legacy.engine, legacy.org, v2_run)
    assert after["state_version"] == v2_row["state_version"]


async def test_the_v2_scheduler_never_sees_or_changes_a_legacy_run(legacy: LegacyWorld) -> None:
    world = await v2_world(legacy.engine, legacy.scope, legacy.clock)
    run_id = await _paused(legacy, time_wait_flow("legacy_vs_v2"), label="Both")
    legacy.clock.advance(minutes=61)
    before = await raw_run(legacy.engine, legacy.org, run_id)

    for queue in ("durable_mutation", "bounded_atomic_foreground", "legacy_interpreter"):
        assert all(
            c.flow_run_id != run_id for c in await world.store.eligible_work(legacy.org, queue)
        )
    try:
        await world.store.delete_run(legacy.org, run_id)
        raise AssertionError("the V2 store changed a legacy row")
    except (FenceLostError, NotFoundError, ValueError):
        pass
    after = await raw_run(legacy.engine, legacy.org, run_id)
    assert after["state_version"] == before["state_version"]
    assert not after["is_deleted"]


async def test_a_paused_legacy_interview_drains_without_owner_or_epoch_conversion(
    legacy: LegacyWorld,
) -> None:
    version = await legacy.flow(time_wait_flow("legacy_drain"))
    paused, _ = await legacy.service.start(legacy.scope, version, {"label": "Drain"})
    # New runs of the same Flow version go to V2 in this (clean-install) deployment ...
    world = await v2_world(legacy.engine, legacy.scope, legacy.clock)
    await v2_waiting_run(world)

    seen = [await raw_run(legacy.engine, legacy.org, paused.flow_run_id)]
    legacy.clock.advance(minutes=61)
    await legacy.service.run_due(legacy.org)
    seen.append(await raw_run(legacy.engine, legacy.org, paused.flow_run_id))

    # ... while the existing interview keeps its owner and epoch for its whole lifetime.
    assert {(r["execution_owner"], r["ownership_epoch"]) for r in seen} == {(LEGACY, 0)}
    assert seen[-1]["interview_status"] == "Finished"
    assert await _count(legacy, flow_step_executions, flow_run_id=paused.flow_run_id) == 0
