"""The write-protocol bridge on both databases (§20.2-§20.3; §22.2 V22.2-10/-11/-29;
§22.8 V22.8-02/-03/-06/-07/-09): the old-writer insert, the trusted OrgID backfill and its
receipt, quarantine, the drain and org-schema gates, adoption into the org-keyed run table,
the write-protocol generation, and the ID-only path that closes at the gate.

Each test gets a brand-new database: the control record is deployment-wide.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.exc import NoResultFound
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import CheckpointInput, FirstStep, FlowRunStateStore, StartRunRequest
from runtime_svc.kernel.states import CompatibilityStatus, ExecutionOwner
from runtime_svc.legacy.service import LegacyInterviewService
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import backfill, bridge, protocol
from runtime_svc.migration.authority import AuthorityUnproven
from runtime_svc.migration.cohorts import choose_owner_txn
from runtime_svc.migration.control import Origin, Phase
from runtime_svc.migration.prebridge import IdOnlyPathClosedError, read_prebridge_interview
from runtime_svc.migration.protocol import V2AdmissionClosedError
from runtime_svc.schema_bridge import flow_interview_org_backfill_receipts, flow_interviews
from runtime_svc.worker import FixedViews
from services import db
from services.auth import generate_keypair
from services.errors import NotFoundError
from tests.integration.kernel.conftest import seed_plan
from tests.integration.migration.bridge_support import (
    Issuer,
    prebridge_rows,
    through_org_schema_gate,
)
from tests.integration.migration.conftest import new_scope, register_flow
from tests.integration.migration.flows import pure_flow, time_wait_flow
from tests.integration.migration.support import raw_run
from tests.integration.worker.support import record_view
from tests.support.prebridge import old_claim, old_insert, old_update_status

LEGACY = ExecutionOwner.LEGACY_INTERPRETER.code


async def _v2_start(engine: AsyncEngine, scope: object) -> None:
    plan_id, _ = await seed_plan(engine, scope)  # type: ignore[arg-type]
    await FlowRunStateStore(engine).create_run(
        scope,  # type: ignore[arg-type]
        StartRunRequest(
            plan_id=plan_id,
            first_step=FirstStep("s1", "PureCompute", "durable_mutation"),
            input=CheckpointInput({"n": 0}),
        ),
    )


async def _receipts(engine: AsyncEngine) -> list[dict[str, object]]:
    async with db.transaction(engine, readonly=True) as conn:
        t = flow_interview_org_backfill_receipts
        return [
            dict(r) for r in (await conn.execute(select(t).order_by(t.c.completed_at))).mappings()
        ]


# --- §20.2: the additive window --------------------------------------------------------


async def test_an_old_writer_insert_reads_back_legacy_0_0_and_the_trusted_sweep_stamps_it(
    fresh_engine: AsyncEngine,
) -> None:
    await bridge.bridge_begin(fresh_engine)
    interview = await old_insert(fresh_engine, flow="legacy_pure", position="calc")

    [row] = (await prebridge_rows(fresh_engine)).values()
    # The old insert named none of these columns: the legacy-safe defaults answered.
    assert row["org_id"] is None
    assert (row["execution_owner"], row["ownership_epoch"], row["state_version"]) == (
        LEGACY,
        0,
        0,
    )
    assert row["is_deleted"] is False and row["delete_requested_at"] is None

    issuer, scope = Issuer.new(), new_scope()
    authority = issuer.proven(scope)
    receipt = await backfill.org_backfill_sweep(fresh_engine, authority)

    assert receipt.complete and receipt.org_id == scope.org_id
    assert (receipt.scanned, receipt.stamped, receipt.already_matching) == (1, 1, 0)
    assert (receipt.null_count, receipt.mismatch_count) == (0, 0)
    assert (await prebridge_rows(fresh_engine))[interview]["org_id"] == scope.org_id
    [stored] = await _receipts(fresh_engine)
    assert stored["authority_digest"] == authority.digest
    assert stored["schema_generation"] == backfill.SCHEMA_GENERATION
    again = await backfill.org_backfill_sweep(fresh_engine, authority)
    assert (again.stamped, again.already_matching) == (0, 1)  # idempotent


@pytest.mark.parametrize(
    "case",
    ["none", "two_orgs", "two_scopes", "forged", "expired", "no_role"],
)
async def test_an_unprovable_authority_stamps_nothing_and_quarantines_the_rollout(
    fresh_engine: AsyncEngine, case: str
) -> None:
    await bridge.bridge_begin(fresh_engine)
    await old_insert(fresh_engine, flow="legacy_pure", position="calc")
    issuer, scope = Issuer.new(), new_scope()
    other_install = new_scope(scope.org_id)
    other_install = type(scope)(
        scope.org_id, "inst-other", scope.runtime_capability_id, scope.runtime_work_binding_digest
    )
    statements = {
        "none": [],
        "two_orgs": [issuer.statement(scope), issuer.statement(new_scope())],
        "two_scopes": [issuer.statement(scope), issuer.statement(other_install)],
        "forged": [issuer.statement(scope, key=generate_keypair()[0])],
        "expired": [issuer.statement(scope, ttl_s=1)],
        "no_role": [issuer.statement(scope, roles=("flow.runs.delete",))],
    }[case]
    if case == "expired":
        verifier = issuer.verifier
        verifier._now = lambda: 10**12
    authority = issuer.authority(*statements)
    assert isinstance(authority, AuthorityUnproven)

    receipt = await backfill.org_backfill_sweep(fresh_engine, authority)

    assert receipt.outcome == "quarantined" and receipt.stamped == 0
    assert all(r["org_id"] is None for r in (await prebridge_rows(fresh_engine)).values())
    control = await bridge.read_control(fresh_engine)
    assert control.quarantine_reason == f"org_authority_unproven.{authority.reason}"
    with pytest.raises(bridge.GateRefusedError):
        await through_org_schema_gate(fresh_engine, issuer, scope)


async def test_a_row_of_another_org_is_never_overwritten_and_blocks_the_receipt(
    fresh_engine: AsyncEngine,
) -> None:
    await bridge.bridge_begin(fresh_engine)
    ours = await old_insert(fresh_engine, flow="legacy_pure", position="calc")
    theirs = await old_insert(fresh_engine, flow="legacy_pure", position="calc")
    async with db.transaction(fresh_engine) as conn:  # a foreign writer's value
        await conn.execute(
            flow_interviews.update()
            .where(flow_interviews.c.interview_id == theirs)
            .values(org_id="org-stray")
        )
    issuer, scope = Issuer.new(), new_scope()

    receipt = await backfill.org_backfill_sweep(fresh_engine, issuer.proven(scope))

    rows = await prebridge_rows(fresh_engine)
    assert rows[ours]["org_id"] == scope.org_id
    assert rows[theirs]["org_id"] == "org-stray"  # never overwritten
    assert receipt.outcome == "quarantined"
    assert (receipt.stamped, receipt.mismatch_count) == (1, 1)
    assert receipt.details["mismatched_interview_ids"] == [theirs]
    control = await bridge.read_control(fresh_engine)
    assert control.quarantine_reason == "org_mismatch" and not control.v2_admission_enabled
    with pytest.raises(bridge.GateRefusedError, match="rollout_quarantined"):
        await through_org_schema_gate(fresh_engine, issuer, scope)


# --- §20.3: the gates ------------------------------------------------------------------


async def test_the_bridge_walk_through_adopts_every_row_after_a_zero_null_final_backfill(
    fresh_engine: AsyncEngine,
) -> None:
    issuer, scope = Issuer.new(), new_scope()
    version = await register_flow(fresh_engine, scope.org_id, time_wait_flow("legacy_tw"))
    await register_flow(fresh_engine, scope.org_id, pure_flow("legacy_pure"))
    await bridge.bridge_begin(fresh_engine)
    paused = await old_insert(
        fresh_engine,
        flow="legacy_tw",
        position="make",
        variables={"label": "Old", "acct": None},
        resume_at=datetime.now(UTC) - timedelta(minutes=1),  # due
    )
    running = await old_insert(
        fresh_engine,
        flow="legacy_pure",
        status="Running",
        position="calc",
        variables={"amount": 60, "total": None, "size": None},
    )
    assert await old_claim(fresh_engine, paused)  # status-only, no version advance
    await old_update_status(fresh_engine, paused, "Paused")
    await backfill.org_backfill_sweep(fresh_engine, issuer.proven(scope))
    late = await old_insert(fresh_engine, flow="legacy_pure", position="calc")  # after a sweep

    # The drain starts after that write: a later millisecond (the old writer stamps rows
    # with its own clock in microseconds, SQLite's clock reads milliseconds — the same
    # millisecond would be a write at the drain start, which the gate refuses).
    await asyncio.sleep(0.01)
    await bridge.drain_begin(fresh_engine)
    await bridge.drain_verify(fresh_engine, settle_s=0)
    receipt = await bridge.org_schema_gate(
        fresh_engine, issuer.proven(scope), LegacyInterviewStore(fresh_engine)
    )

    assert receipt.kind == "final" and receipt.complete
    assert (receipt.null_count, receipt.mismatch_count, receipt.adopted) == (0, 0, 3)
    assert receipt.stamped == 1  # ``late``: the final sweep stamped what the old writer left
    rows = await prebridge_rows(fresh_engine)
    assert all(r["org_id"] == scope.org_id and r["adopted_at"] for r in rows.values())
    for interview in (paused, running, late):
        run = await raw_run(fresh_engine, scope.org_id, interview)
        assert (run["execution_owner"], run["ownership_epoch"]) == (LEGACY, 0)
        assert run["app_installation_id"] == scope.app_installation_id
        assert run["plan_id"] is None
    # A row an old process left Running resumes from its last persisted position.
    assert (await raw_run(fresh_engine, scope.org_id, running))["interview_status"] == "Paused"
    control = await bridge.enable_write_protocol(fresh_engine)
    assert control.generation == 1 and control.phase is Phase.WRITE_PROTOCOL_ENABLED
    assert control.org_backfill_receipt_id == receipt.receipt_id
    assert control.deployment_org_id == scope.org_id

    # The bridge's legacy owner now drains the adopted interviews under trusted OrgID.
    service = LegacyInterviewService(
        fresh_engine, LegacyInterviewStore(fresh_engine), FixedViews(record_view()), owner="b"
    )
    reports = await service.run_due(scope.org_id)
    states = {r.interview.flow_run_id: r.interview for r in reports}
    assert states[running].status is CompatibilityStatus.FINISHED
    assert states[running].outputs() == {"total": 120, "size": "big"}
    assert states[paused].status is CompatibilityStatus.PAUSED  # now in its timer wait
    assert states[paused].flow_version_id == version


async def test_v2_admission_is_impossible_before_both_gates_and_on_a_pre_bridge_binary(
    fresh_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    issuer, scope = Issuer.new(), new_scope()
    await bridge.bridge_begin(fresh_engine)
    refusals = []
    for gate in (
        lambda: bridge.drain_begin(fresh_engine),
        lambda: bridge.drain_verify(fresh_engine, settle_s=0),
        lambda: bridge.org_schema_gate(
            fresh_engine, issuer.proven(scope), LegacyInterviewStore(fresh_engine)
        ),
        lambda: bridge.enable_write_protocol(fresh_engine),
    ):
        with pytest.raises(V2AdmissionClosedError) as exc:
            await _v2_start(fresh_engine, new_scope(scope.org_id))
        refusals.append(exc.value.refusal)
        with pytest.raises(bridge.GateRefusedError):
            await bridge.set_v2_admission(fresh_engine, enabled=True)
        await gate()
    assert refusals == ["write_protocol_not_enabled"] * 4
    # Both gates passed: still closed until admission is enabled deliberately.
    with pytest.raises(V2AdmissionClosedError, match="v2_admission_disabled"):
        await _v2_start(fresh_engine, new_scope(scope.org_id))
    await bridge.set_v2_admission(fresh_engine, enabled=True)
    monkeypatch.setattr(protocol, "BINARY_WRITE_PROTOCOL_GENERATION", 0)
    with pytest.raises(V2AdmissionClosedError, match="binary_pre_bridge"):
        await _v2_start(fresh_engine, new_scope(scope.org_id))
    monkeypatch.undo()
    await _v2_start(fresh_engine, new_scope(scope.org_id))


async def test_a_deployment_with_v2_runs_can_never_go_back_to_the_pre_bridge_window(
    fresh_engine: AsyncEngine,
) -> None:
    await _v2_start(fresh_engine, new_scope())  # a clean install admits V2

    with pytest.raises(bridge.GateRefusedError, match="v2_owned_runs_exist"):
        await bridge.bridge_begin(fresh_engine)
    control = await bridge.read_control(fresh_engine)
    assert control.gates_passed and control.origin is Origin.CLEAN_INSTALL


async def test_mixed_pre_bridge_and_bridge_binaries_share_the_additive_schema(
    fresh_engine: AsyncEngine,
) -> None:
    scope = new_scope()
    version = await register_flow(fresh_engine, scope.org_id, pure_flow("legacy_mixed"))
    control = await bridge.bridge_begin(fresh_engine)
    assert control.origin is Origin.LEGACY_ADOPTION and control.generation == 0

    old = await old_insert(fresh_engine, flow="legacy_mixed", position="calc")
    assert await old_claim(fresh_engine, old)
    await old_update_status(fresh_engine, old, "Paused")
    # CAS enforcement is off for the pre-bridge shape: old updates never advance a version.
    assert (await prebridge_rows(fresh_engine))[old]["state_version"] == 0

    # The bridge binary: new runs are legacy-owned (V2 admission closed) ...
    async with db.transaction(fresh_engine, readonly=True) as conn:
        choice = await choose_owner_txn(conn, scope.org_id, version, "bounded_atomic")
    assert choice.owner is ExecutionOwner.LEGACY_INTERPRETER
    assert choice.reason == "deployment_default_legacy"
    service = LegacyInterviewService(
        fresh_engine, LegacyInterviewStore(fresh_engine), FixedViews(record_view()), owner="b"
    )
    mine, _ = await service.start(scope, version, {"amount": 1})
    assert mine.status is CompatibilityStatus.FINISHED
    # ... it reads the old row through the ID-only path of the isolated deployment ...
    seen = await read_prebridge_interview(fresh_engine, scope.org_id, old)
    assert (seen.execution_owner, seen.ownership_epoch, seen.state_version) == (LEGACY, 0, 0)
    # ... and V2 stays impossible.
    with pytest.raises(V2AdmissionClosedError):
        await _v2_start(fresh_engine, scope)


async def test_no_id_only_flowinterview_path_remains_past_the_org_schema_gate(
    fresh_engine: AsyncEngine,
) -> None:
    issuer, scope = Issuer.new(), new_scope()
    await register_flow(fresh_engine, scope.org_id, pure_flow("legacy_ids"))
    # A clean install never opened the ID-only path.
    with pytest.raises(IdOnlyPathClosedError):
        await read_prebridge_interview(fresh_engine, scope.org_id, "int-x")

    await bridge.bridge_begin(fresh_engine)
    old = await old_insert(fresh_engine, flow="legacy_ids", position="calc")
    assert (await read_prebridge_interview(fresh_engine, scope.org_id, old)).org_id is None
    await backfill.org_backfill_sweep(fresh_engine, issuer.proven(scope))
    with pytest.raises(NotFoundError):  # a stamped row of another org is invisible
        await read_prebridge_interview(fresh_engine, new_scope().org_id, old)

    await through_org_schema_gate(fresh_engine, issuer, scope)
    with pytest.raises(IdOnlyPathClosedError):
        await read_prebridge_interview(fresh_engine, scope.org_id, old)
    # The run is reachable only by (OrgID, FlowRunId) now.
    store = LegacyInterviewStore(fresh_engine)
    assert (await store.get(scope.org_id, old)).flow_run_id == old
    with pytest.raises(NotFoundError):
        await store.get(new_scope().org_id, old)


async def test_an_interview_id_that_is_not_ascii_is_refused_at_adoption_and_named_by_the_gate(
    fresh_engine: AsyncEngine,
) -> None:
    # flow_run_id is an ASCII identifier (ADR 0015: an ascii column on MariaDB/MySQL); an
    # adopted interview keeps its id, so a non-ASCII one cannot be adopted as it is.
    issuer, scope = Issuer.new(), new_scope()
    await register_flow(fresh_engine, scope.org_id, pure_flow("legacy_pure"))
    await bridge.bridge_begin(fresh_engine)
    plain = await old_insert(fresh_engine, flow="legacy_pure", position="calc")
    odd = await old_insert(
        fresh_engine, flow="legacy_pure", position="calc", interview_id="int-ümlaut-1"
    )
    await asyncio.sleep(0.01)
    await bridge.drain_begin(fresh_engine)
    await bridge.drain_verify(fresh_engine, settle_s=0)

    with pytest.raises(bridge.GateRefusedError) as refused:
        await bridge.org_schema_gate(
            fresh_engine, issuer.proven(scope), LegacyInterviewStore(fresh_engine)
        )

    assert refused.value.reasons == ("rows_not_adoptable",)
    assert refused.value.evidence["refused"] == {odd: "interview_id_not_ascii"}
    rows = await prebridge_rows(fresh_engine)
    assert rows[odd]["adopted_at"] is None  # left for an operator, nothing half-written
    assert rows[plain]["adopted_at"] is not None
    with pytest.raises(NoResultFound):  # no run; on MariaDB also no 1267 collation error
        await raw_run(fresh_engine, scope.org_id, odd)
