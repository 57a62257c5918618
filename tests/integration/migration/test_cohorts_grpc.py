"""Cohorts, admission disable, the compatibility projection and the public delete of
legacy runs through the runtime's gRPC API (§18.2, §20.6-§20.9; §22.8 V22.8-09/-10/-12/
-13/-14). Plans are compiled and activated through the definitions API; the owner of each
new run comes from the cohort flags.

One server pair over one database per module; tests that flip the deployment-wide
admission switch restore it.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.migration import bridge, cohorts, reconcile
from runtime_svc.migration.cohorts import CohortRefusedError
from runtime_svc.migration.shadow import compare_flow_version
from runtime_svc.migration.shadow_model import Scenario
from runtime_svc.schema import audit_records, business_events, flow_runs, records, runtime_outbox
from runtime_svc.schema_bridge import flow_shadow_comparisons
from services.errors import NotFoundError
from services.proto import common_v1, runtime_v1
from tests.integration.definitions.harness import error_detail, new_org, rows, run_db
from tests.integration.migration.flows import pure_flow, pure_wait_flow, write_flow
from tests.integration.runs.conftest import client, module_db_url, servers
from tests.integration.runs.harness import RunClient, RunServers, publish_and_activate
from tests.integration.worker.support import make_worker, record_view
from tests.unit.compiler.compiler_corpus import FLOWS, read_json

__all__ = ["client", "module_db_url", "servers"]

LEGACY = common_v1.ExecutionOwner.EXECUTION_OWNER_LEGACY_INTERPRETER
V2 = common_v1.ExecutionOwner.EXECUTION_OWNER_FLOW_RUNTIME_V2
S = common_v1.CompatibilityStatus


def _setup(servers: RunServers, client: RunClient, *sources: dict[str, Any]) -> tuple[Any, Any]:
    return publish_and_activate(servers, client, new_org(), list(sources))


def _cohort(
    db_url: str, pub: Any, plan: Any, owner: ExecutionOwner, evidence: str | None = None
) -> Any:
    profile = (
        common_v1.ExecutionProfile.Name(plan.execution_profile)
        .removeprefix("EXECUTION_PROFILE_")
        .lower()
    )
    return run_db(
        db_url,
        lambda e: cohorts.set_cohort(
            e,
            pub.scope[0],
            plan.flow_version_id,
            profile,
            owner,
            cohort="pure_autolaunched",
            evidence_comparison_id=evidence,
        ),
    )


def _code(fn: Any) -> tuple[grpc.StatusCode, Any]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), error_detail(err.value)  # type: ignore[attr-defined]


def test_a_legacy_cohort_admits_new_runs_to_the_legacy_owner(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client, pure_flow("cohort_pure"))
    _cohort(servers.db_url, pub, plans["cohort_pure"], ExecutionOwner.LEGACY_INTERPRETER)

    resp = client.start(pub, flow="cohort_pure", inputs={"amount": 70}, key="k-1")
    again = client.start(pub, flow="cohort_pure", inputs={"amount": 70}, key="k-1")

    run = resp.run
    assert (run.execution_owner, run.ownership_epoch) == (LEGACY, 0)
    assert resp.completed and not resp.existing_run  # the legacy first segment ran
    assert run.plan_id == "" and run.runtime_state == common_v1.RunState.RUN_STATE_SUCCEEDED
    assert run.compatibility.status == S.COMPATIBILITY_STATUS_FINISHED
    assert dict(run.output_variables) == {"total": 140, "size": "big"}
    assert again.existing_run and again.run.flow_run_id == run.flow_run_id
    code, detail = _code(
        lambda: client.start(pub, flow="cohort_pure", inputs={"amount": 1}, key="k-1")
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and detail.code == "idempotency_key_reused"


def test_cohort_flags_choose_the_owner_of_new_runs_only(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client, pure_flow("cohort_switch"))
    plan = plans["cohort_switch"]
    v2_run = client.start(pub, flow="cohort_switch", inputs={"amount": 1}).run
    assert (v2_run.execution_owner, v2_run.ownership_epoch) == (V2, 1)

    _cohort(servers.db_url, pub, plan, ExecutionOwner.LEGACY_INTERPRETER)
    legacy_run = client.start(pub, flow="cohort_switch", inputs={"amount": 1}).run
    assert legacy_run.execution_owner == LEGACY
    with pytest.raises(CohortRefusedError, match="evidence"):
        _cohort(servers.db_url, pub, plan, ExecutionOwner.FLOW_RUNTIME_V2)
    results = run_db(
        servers.db_url,
        lambda e: compare_flow_version(
            e,
            pub.scope[0],
            plan.flow_version_id,
            [Scenario("big", inputs={"amount": 70}), Scenario("small", inputs={"amount": 1})],
            view=record_view(),
        ),
    )
    assert [r.comparison.outcome.value for r in results] == ["match", "match"]
    _cohort(servers.db_url, pub, plan, ExecutionOwner.FLOW_RUNTIME_V2, results[0].comparison_id)
    back = client.start(pub, flow="cohort_switch", inputs={"amount": 1}).run

    # Every run keeps the owner and epoch it was accepted under.
    assert back.execution_owner == V2
    assert client.get(pub, v2_run.flow_run_id).execution_owner == V2
    assert client.get(pub, legacy_run.flow_run_id).execution_owner == LEGACY
    assert client.get(pub, legacy_run.flow_run_id).ownership_epoch == 0


def test_admission_disable_stops_new_v2_runs_without_abandoning_existing_ones(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client, pure_flow("admission_pure"))
    before = client.start(pub, flow="admission_pure", input_json='{"amount": 70}').run
    assert before.execution_owner == V2

    run_db(servers.db_url, lambda e: bridge.set_v2_admission(e, enabled=False))
    try:
        during = client.start(pub, flow="admission_pure", inputs={"amount": 70}).run
        # The new run returned to the legacy cohort; the V2 run is still V2 and still
        # served by the V2 scheduler to its end.
        assert during.execution_owner == LEGACY
        assert client.get(pub, before.flow_run_id).execution_owner == V2

        async def drive(engine: Any) -> None:
            worker = make_worker(engine, FlowRunStateStore(engine), owner="v2-drain", batch_size=5)
            for _ in range(10):
                await worker.run_once()

        run_db(servers.db_url, drive)
        done = client.get(pub, before.flow_run_id)
        assert done.runtime_state == common_v1.RunState.RUN_STATE_SUCCEEDED
        assert (done.execution_owner, done.ownership_epoch) == (V2, 1)
    finally:
        run_db(servers.db_url, lambda e: bridge.set_v2_admission(e, enabled=True))
    after = client.start(pub, flow="admission_pure", inputs={"amount": 70}).run
    assert after.execution_owner == V2


def test_existing_clients_read_the_compatibility_projection_of_both_owners(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client, pure_wait_flow("projection_wait"))
    v2_run = client.start(pub, flow="projection_wait", inputs={}).run
    _cohort(servers.db_url, pub, plans["projection_wait"], ExecutionOwner.LEGACY_INTERPRETER)
    paused = client.start(pub, flow="projection_wait", inputs={}).run

    assert paused.execution_owner == LEGACY
    assert paused.runtime_state == common_v1.RunState.RUN_STATE_WAITING
    assert paused.compatibility.status == S.COMPATIBILITY_STATUS_PAUSED
    assert paused.compatibility.current_element == "hold"
    assert paused.compatibility.paused_at.seconds > 0
    assert v2_run.compatibility.status == S.COMPATIBILITY_STATUS_RUNNING
    listed = {r.flow_run_id: r for r in client.list(pub).runs}
    assert listed[paused.flow_run_id].compatibility == paused.compatibility
    assert listed[v2_run.flow_run_id].execution_owner == V2
    code, detail = _code(lambda: client.support(pub, paused.flow_run_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and detail.code == "legacy_owned_run"


def test_public_delete_of_a_legacy_run_is_an_authorized_idempotent_soft_delete(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client, pure_wait_flow("delete_wait"))
    _cohort(servers.db_url, pub, plans["delete_wait"], ExecutionOwner.LEGACY_INTERPRETER)
    run = client.start(pub, flow="delete_wait", inputs={}).run

    code, _ = _code(lambda: client.delete(pub, run.flow_run_id, md=client.creds(pub, roles=())))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    first = client.delete(pub, run.flow_run_id)
    second = client.delete(pub, run.flow_run_id)

    assert first.is_deleted and second.is_deleted
    assert first.state_version == second.state_version
    assert first.runtime_state == common_v1.RunState.RUN_STATE_CANCELLED
    assert first.compatibility.status == S.COMPATIBILITY_STATUS_ERROR
    assert _code(lambda: client.get(pub, run.flow_run_id))[0] == grpc.StatusCode.NOT_FOUND
    assert run.flow_run_id not in {r.flow_run_id for r in client.list(pub).runs}
    [row] = rows(servers.db_url, flow_runs, org_id=pub.scope[0], flow_run_id=run.flow_run_id)
    assert row["is_deleted"] and row["execution_owner"] == "LegacyInterpreter"  # lineage kept


def test_no_id_only_or_cross_org_path_reaches_a_legacy_run(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client, pure_wait_flow("scoped_wait"))
    _cohort(servers.db_url, pub, plans["scoped_wait"], ExecutionOwner.LEGACY_INTERPRETER)
    run = client.start(pub, flow="scoped_wait", inputs={}).run
    other = (new_org(),)
    other_md = client.creds(other)
    run_id = run.flow_run_id

    for call in (
        lambda: client.runs.GetRun(
            runtime_v1.GetRunRequest(flow_run_id=run_id), metadata=other_md, timeout=30
        ),
        lambda: client.delete(other, run_id),
        lambda: client.cancel(other, run_id),
        lambda: client.support(other, run_id),
    ):
        assert _code(call)[0] == grpc.StatusCode.NOT_FOUND
    # A body org that disagrees with the credential is refused, never used.
    code, _ = _code(
        lambda: client.runs.GetRun(
            runtime_v1.GetRunRequest(org_id=pub.scope[0], flow_run_id=run_id),
            metadata=other_md,
            timeout=30,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    unsigned = runtime_v1.GetRunRequest(flow_run_id=run_id)
    assert _code(lambda: client.runs.GetRun(unsigned, timeout=30))[0] == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # The run is untouched and still the caller's.
    assert client.get(pub, run_id).compatibility.status == S.COMPATIBILITY_STATUS_PAUSED
    cancelled = client.cancel(pub, run_id)
    assert cancelled.runtime_state == common_v1.RunState.RUN_STATE_CANCELLED


def test_reconciliation_reports_zero_dual_ownership(servers: RunServers, client: RunClient) -> None:
    pub, plans = _setup(servers, client, pure_flow("reconcile_pure"))
    client.start(pub, flow="reconcile_pure", inputs={"amount": 1})
    _cohort(servers.db_url, pub, plans["reconcile_pure"], ExecutionOwner.LEGACY_INTERPRETER)
    client.start(pub, flow="reconcile_pure", inputs={"amount": 1})

    report = run_db(servers.db_url, lambda e: reconcile.reconcile_ownership(e, pub.scope[0]))

    assert report.dual_ownership_total == 0
    assert dict(report.runs_by_owner) == {("FlowRuntimeV2", 1): 1, ("LegacyInterpreter", 0): 1}
    assert set(report.dual_ownership) == set(reconcile.DUAL_OWNERSHIP_KINDS)
    deployment = run_db(servers.db_url, reconcile.reconcile_ownership)
    assert deployment.dual_ownership_total == 0  # across every org of this deployment


def test_a_persisted_shadow_comparison_writes_only_its_evidence(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client, write_flow("shadow_write"))
    org = pub.scope[0]
    tables = (flow_runs, records, business_events, audit_records, runtime_outbox)
    before = {t.name: len(rows(servers.db_url, t, org_id=org)) for t in tables}

    [result] = run_db(
        servers.db_url,
        lambda e: compare_flow_version(
            e,
            org,
            plans["shadow_write"].flow_version_id,
            [Scenario("creates_and_touches", inputs={"label": "Acme"})],
            view=record_view(),
        ),
    )

    assert result.comparison.outcome.value == "match"
    assert [w[:2] for w in result.comparison.legacy.writes] == [
        ("create", "Account"),
        ("update", "Account"),
    ]
    after = {t.name: len(rows(servers.db_url, t, org_id=org)) for t in tables}
    assert after == before  # no business mutation, no effect, no run: only evidence
    [evidence] = rows(servers.db_url, flow_shadow_comparisons, comparison_id=result.comparison_id)
    assert (evidence["org_id"], evidence["outcome"], evidence["blocking"]) == (org, "match", False)
    assert evidence["plan_digest"] == plans["shadow_write"].plan_digest


def test_cohorts_five_to_seven_are_data_enabled_only_by_their_own_evidence(
    servers: RunServers, client: RunClient
) -> None:
    corpus = {
        n: read_json(FLOWS / n / "flow.json")
        for n in (
            "durable_send_email",
            "durable_subflow_effect",
            "durable_wait_time_fault_path",
            "durable_wait_record_condition",
        )
    }
    child = read_json(FLOWS / "_inputs" / "subflows" / "notify_owner.json")
    pub, plans = _setup(servers, client, child, *corpus.values())
    org = pub.scope[0]

    def evidence(name: str, scenario: Scenario) -> Any:
        [result] = run_db(
            servers.db_url,
            lambda e: compare_flow_version(
                e, org, plans[name].flow_version_id, [scenario], view=record_view()
            ),
        )
        return result

    def enable(name: str, cohort: str, comparison_id: str) -> Any:
        return run_db(
            servers.db_url,
            lambda e: cohorts.set_cohort(
                e,
                org,
                plans[name].flow_version_id,
                "durable_orchestration",
                ExecutionOwner.FLOW_RUNTIME_V2,
                cohort=cohort,
                evidence_comparison_id=comparison_id,
            ),
        )

    [email] = [
        s for s in _corpus_scenarios("durable_send_email") if s.name == "delivered_then_marked"
    ]
    effect = evidence("durable_send_email", email)
    # Explained and benign (V2's durable effect boundary): the evidence admits cohort 7.
    assert (effect.comparison.outcome.value, effect.comparison.blocking) == ("explained", False)
    flag = enable("durable_send_email", "external_effects", effect.comparison_id)
    assert (
        flag.new_run_owner is ExecutionOwner.FLOW_RUNTIME_V2 and flag.cohort == "external_effects"
    )

    # Cohort 5 (time waits) and cohort 6 (producer waits: a record-condition wait), each
    # by the comparison of its own Flow version; a wait is a §18.2 Paused observation on
    # both owners, so nothing blocks.
    for name, cohort in (
        ("durable_wait_time_fault_path", "time_waits"),
        ("durable_wait_record_condition", "producer_waits"),
    ):
        for scenario in _corpus_scenarios(name):
            waited = evidence(name, scenario)
            assert not waited.comparison.blocking, (name, scenario.name)
        flag = enable(name, cohort, waited.comparison_id)
        assert (flag.new_run_owner, flag.cohort) == (ExecutionOwner.FLOW_RUNTIME_V2, cohort)
    # Another Flow version's evidence never enables a cohort: it is not found for this one.
    with pytest.raises(NotFoundError):
        enable("durable_wait_time_fault_path", "time_waits", effect.comparison_id)

    blocked = evidence("durable_subflow_effect", _corpus_scenarios("durable_subflow_effect")[0])
    assert blocked.comparison.blocking  # V2 fails closed on the Subflow element today
    with pytest.raises(CohortRefusedError, match="blocks V2 ownership"):
        enable("durable_subflow_effect", "large_complex", blocked.comparison_id)


def _corpus_scenarios(name: str) -> list[Scenario]:
    return [Scenario.from_dict(s) for s in read_json(FLOWS / name / "shadow.json")["scenarios"]]
