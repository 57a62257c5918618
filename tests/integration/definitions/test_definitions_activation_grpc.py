"""Plan compilation and activation through the runtime's gRPC API (§7.3, §7.4, §9.2, §16.3),
on SQLite and MariaDB, with the catalog reached over gRPC.

One server pair and one migrated database serve the module; every test uses its own org.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest

from runtime_svc.compiler import ExecutionPlan
from runtime_svc.definitions.policy import DEFAULT_POLICY_DOCUMENT
from runtime_svc.definitions.policy_store import PolicyStore
from runtime_svc.schema import execution_plans, flow_runs, plan_activations
from services.proto import common_v1, runtime_v1
from tests.integration.definitions import flows
from tests.integration.definitions.harness import (
    Client,
    Servers,
    error_detail,
    new_org,
    new_request_id,
    rows,
    run_db,
)

ACTIVE = runtime_v1.ActivationState.ACTIVATION_STATE_ACTIVE
SUPERSEDED = runtime_v1.ActivationState.ACTIVATION_STATE_SUPERSEDED
DEACTIVATED = runtime_v1.ActivationState.ACTIVATION_STATE_DEACTIVATED
BOUNDED_ATOMIC = common_v1.ExecutionProfile.EXECUTION_PROFILE_BOUNDED_ATOMIC
DURABLE = common_v1.ExecutionProfile.EXECUTION_PROFILE_DURABLE_ORCHESTRATION


def _publish(servers: Servers, org: str, **kwargs: Any) -> Any:
    return servers.catalog.publish(org, flows.view(org), flows.entries(), **kwargs)


def _put_policy(db_url: str, org: str, **bounded_atomic: int) -> int:
    doc = json.loads(json.dumps(DEFAULT_POLICY_DOCUMENT))
    doc["bounded_atomic"].update(bounded_atomic)

    async def put(engine: Any) -> int:
        return (await PolicyStore(engine).put(org, doc)).version

    version: int = run_db(db_url, put)
    return version


def _compiled(client: Client, pub: Any, fv: Any) -> Any:
    resp = client.compile(pub, fv.flow_version_id)
    assert resp.compiled, [d.message for d in resp.diagnostics]
    return resp.plan


def _insert_running_run(db_url: str, pub: Any, fv: Any, plan: Any) -> str:
    """A non-terminal FlowRun accepted on ``plan`` (written through the schema)."""
    run_id = f"run-{new_request_id()[:16]}"
    now = datetime.now(UTC)

    async def insert(engine: Any) -> None:
        async with engine.begin() as conn:
            await conn.execute(
                flow_runs.insert().values(
                    org_id=pub.scope[0],
                    app_installation_id=pub.scope[1],
                    runtime_capability_id=pub.scope[2],
                    runtime_work_binding_digest=pub.scope[3],
                    flow_run_id=run_id,
                    flow_version_id=fv.flow_version_id,
                    plan_id=plan.plan_id,
                    execution_profile="bounded_atomic",
                    execution_owner="FlowRuntimeV2",
                    runtime_state="Running",
                    state_version=3,
                    ownership_epoch=1,
                    queue_class="bounded_atomic_foreground",
                    priority=0,
                    interview_status="Running",
                    created_at=now,
                    updated_at=now,
                )
            )

    run_db(db_url, insert)
    return run_id


# --- registration ---------------------------------------------------------------------------


def test_register_is_idempotent_by_name_version_and_source(client: Client) -> None:
    org = new_org()
    first = client.register(org, flows.task_flow(), label="Tasks")
    # Same Flow, reformatted and with its keys reordered: the same version.
    reordered = json.dumps(dict(reversed(list(flows.task_flow().items()))), indent=4)
    again = client.register(org, reordered)
    assert again.flow_version_id == first.flow_version_id
    assert again.metadata_digest == first.metadata_digest
    assert first.version_number == 1 and first.label == "Tasks"
    assert first.process_type == runtime_v1.FlowProcessType.FLOW_PROCESS_TYPE_AUTOLAUNCHED
    assert first.requested_profile == BOUNDED_ATOMIC and first.run_atomically
    assert [v.name for v in first.variables] == ["recordId"]
    assert first.element_count == 2

    with pytest.raises(grpc.RpcError) as err:
        client.register(org, flows.task_flow(subject="changed"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already registered with a different source" in (err.value.details() or "")
    assert error_detail(err.value).code == "flow_version_source_conflict"
    # A new version number is a new Flow version.
    v2 = client.register(org, flows.task_flow(subject="changed", version=2))
    assert v2.flow_version_id != first.flow_version_id and v2.version_number == 2


def test_register_rejects_bad_json_and_invalid_sources_naming_the_path(client: Client) -> None:
    org = new_org()
    with pytest.raises(grpc.RpcError) as err:
        client.register(org, '{"api_name": "broken",\n  "version": 1,, }')
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "line 2 column 16" in (err.value.details() or "")
    assert error_detail(err.value).field_path.startswith("source_json")

    bad = flows.task_flow("typo")
    bad["elements"][0]["fualt"] = "done"
    with pytest.raises(grpc.RpcError) as err:
        client.register(org, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(err.value)
    assert detail.field_path == "source_json:elements[make].fualt"
    assert "source.unknown_field" in detail.attributes["codes"]

    with pytest.raises(grpc.RpcError) as err:
        client.stub.RegisterFlowVersion(
            runtime_v1.RegisterFlowVersionRequest(
                request_id=new_request_id(),
                flow_api_name="other_name",
                source_json=json.dumps(flows.task_flow()),
            ),
            metadata=client.md(org),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err.value).field_path == "flow_api_name"


# --- compile -----------------------------------------------------------------------------------


def test_compile_stores_one_immutable_plan_per_identity(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    first = _compiled(client, pub, fv)
    again = _compiled(client, pub, fv)
    assert (again.plan_id, again.plan_digest) == (first.plan_id, first.plan_digest)
    assert first.execution_profile == BOUNDED_ATOMIC
    assert first.catalog_generation.catalog_generation_id == pub.generation_id
    assert first.runtime_metadata_view_digest == pub.view_digest
    assert first.policy_version == "1"  # the default policy, seeded on first use
    stored = rows(module_db_url, execution_plans, org_id=org)
    assert [r["plan_id"] for r in stored] == [first.plan_id]

    plan = client.get_plan(org, first.plan_id)
    assert plan.plan_digest == first.plan_digest
    assert plan.execution_profile == BOUNDED_ATOMIC
    assert plan.payload.entry_step_key and plan.payload.steps
    assert "Profile: bounded_atomic" in plan.diagnostic_summary
    by_digest = client.get_plan(org, first.plan_digest)
    assert by_digest.plan_id == first.plan_id


def test_failed_compile_is_ok_with_exact_blockers_and_writes_no_plan(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.unknown_capability_flow())
    resp = client.compile(pub, fv.flow_version_id)
    assert not resp.compiled and not resp.HasField("plan")
    unknown = [d for d in resp.diagnostics if d.code == "atomic_unsafe.unknown_capability"]
    assert unknown, resp.diagnostics
    assert all(
        d.severity == runtime_v1.DiagnosticSeverity.DIAGNOSTIC_SEVERITY_ERROR for d in unknown
    )
    assert {tuple(d.blocker_chain) for d in unknown} == {("ActionCall sync",)}
    assert any("capability security is unknown" in d.message for d in unknown)
    assert rows(module_db_url, execution_plans, org_id=org) == []

    # An explicit profile request the compiler cannot prove names its blockers, too.
    email = client.register(org, flows.email_flow())
    resp = client.compile(pub, email.flow_version_id, requested_profile=BOUNDED_ATOMIC)
    assert not resp.compiled
    codes = [d.code for d in resp.diagnostics]
    assert codes[0] == "profile.requested_unproven"
    assert any(c.startswith("atomic_unsafe.") for c in codes)
    assert any(tuple(d.blocker_chain) == ("ActionCall send",) for d in resp.diagnostics)
    assert rows(module_db_url, execution_plans, org_id=org) == []


def test_compile_needs_a_sealed_generation_of_the_callers_scope(
    servers: Servers, client: Client
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    with pytest.raises(grpc.RpcError) as err:
        client.compile(pub, fv.flow_version_id, generation_id="gen-missing")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        client.compile(pub, fv.flow_version_id, catalog_digest="catalog/v1:sha256:" + "0" * 64)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    unsealed = servers.catalog.publish(org, flows.view(org), flows.entries(), sealed=False)
    with pytest.raises(grpc.RpcError) as err:
        client.compile(unsealed, fv.flow_version_id, catalog_digest="x")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err.value).code == "catalog_generation_not_sealed"
    # The same generation id under another installation is another scope: not found.
    other = _publish(servers, org, app="inst-2")
    with pytest.raises(grpc.RpcError) as err:
        client.compile(other, fv.flow_version_id, generation_id=pub.generation_id)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Compile is work-scoped: an org-only credential is refused.
    with pytest.raises(grpc.RpcError) as err:
        client.stub.CompileFlowVersion(
            runtime_v1.CompileFlowVersionRequest(
                request_id=new_request_id(),
                flow_version_id=fv.flow_version_id,
                catalog_generation_id=pub.generation_id,
                catalog_digest=pub.catalog_digest,
            ),
            metadata=client.md(org),
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


# --- activation --------------------------------------------------------------------------------


def test_activation_registers_references_and_is_idempotent(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    plan = _compiled(client, pub, fv)
    resp = client.activate(pub, fv.flow_version_id, plan)
    act = resp.activation
    assert act.state == ACTIVE and act.plan_id == plan.plan_id
    assert act.plan_digest == plan.plan_digest
    assert act.runtime_work_binding_digest == pub.scope[3]
    holder = f"{plan.plan_id}/"
    refs = servers.catalog.references_of(pub.scope)
    assert {t for t, h in refs if h.startswith(holder)} == {
        f"generation:{pub.generation_id}",
        f"view:{pub.view_digest}",
    }

    again = client.activate(pub, fv.flow_version_id, plan)
    assert again.activation.activated_at == act.activated_at
    assert again.activation.plan_id == act.plan_id
    active = rows(module_db_url, plan_activations, org_id=org, state="ACTIVE")
    assert len(active) == 1
    assert len(servers.catalog.references_of(pub.scope)) == 2

    with pytest.raises(grpc.RpcError) as err:
        other = runtime_v1.PlanSummary(
            plan_id=plan.plan_id, plan_digest="plan/v1:sha256:" + "1" * 64
        )
        client.activate(pub, fv.flow_version_id, other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err.value).code == "plan_digest_mismatch"


def test_in_flight_runs_keep_their_plan_when_a_newer_plan_is_activated(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.welcome_flow())
    old = _compiled(client, pub, fv)
    client.activate(pub, fv.flow_version_id, old)
    run_id = _insert_running_run(module_db_url, pub, fv, old)
    old_row = rows(module_db_url, execution_plans, org_id=org, plan_id=old.plan_id)

    # A metadata-view publication: a new view, so a new complete binding (new scope).
    newer_pub = servers.catalog.publish(
        org, flows.view(org, schema_generation=2), flows.entries(), catalog_revision=2
    )
    assert newer_pub.scope[3] != pub.scope[3]
    new = _compiled(client, newer_pub, fv)
    assert new.plan_id != old.plan_id and new.plan_digest != old.plan_digest
    activated = client.activate(newer_pub, fv.flow_version_id, new).activation
    assert activated.state == ACTIVE and activated.plan_id == new.plan_id

    # The run still names the old plan; the old plan row is byte-for-byte unchanged and
    # still readable by id; its activation is SUPERSEDED, not rewritten.
    run = rows(module_db_url, flow_runs, org_id=org, flow_run_id=run_id)
    assert run[0]["plan_id"] == old.plan_id
    assert rows(module_db_url, execution_plans, org_id=org, plan_id=old.plan_id) == old_row
    assert client.get_plan(org, old.plan_id).plan_digest == old.plan_digest
    by_state = {r["plan_id"]: r["state"] for r in rows(module_db_url, plan_activations, org_id=org)}
    assert by_state == {old.plan_id: "SUPERSEDED", new.plan_id: "ACTIVE"}
    # The superseded activation keeps its catalog references while the run is in flight.
    old_refs = {t for t, h in servers.catalog.references_of(pub.scope) if h.startswith(old.plan_id)}
    assert old_refs == {f"generation:{pub.generation_id}", f"view:{pub.view_digest}"}


def test_catalog_generation_change_creates_a_new_plan_and_releases_unused_references(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    old = _compiled(client, pub, fv)
    client.activate(pub, fv.flow_version_id, old)
    # Same binding, new sealed generation of the same entries.
    regen = _publish(servers, org)
    assert regen.scope == pub.scope and regen.generation_id != pub.generation_id
    new = _compiled(client, regen, fv)
    assert new.plan_digest != old.plan_digest
    resp = client.activate(regen, fv.flow_version_id, new)
    assert resp.activation.plan_id == new.plan_id
    holders = {h.split("/")[0] for _, h in servers.catalog.references_of(pub.scope)}
    assert holders == {new.plan_id}  # no run uses the old plan: its references are released
    assert len(rows(module_db_url, execution_plans, org_id=org)) == 2


def test_policy_generation_change_gives_a_new_plan_and_the_old_one_is_stale(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    v1 = _compiled(client, pub, fv)
    client.activate(pub, fv.flow_version_id, v1)
    assert _put_policy(module_db_url, org, max_reads=400) == 2
    v2 = _compiled(client, pub, fv)
    assert v2.policy_version == "2"
    assert v2.plan_digest != v1.plan_digest and v2.plan_id != v1.plan_id
    with pytest.raises(grpc.RpcError) as err:
        client.activate(pub, fv.flow_version_id, v1)  # compiled under policy v1
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err.value).code == "plan_stale"
    act = client.activate(pub, fv.flow_version_id, v2).activation
    assert act.plan_id == v2.plan_id
    assert client.get_plan(org, v1.plan_id).policy_version == "1"


def test_unsafe_run_atomically_blocks_activation_with_the_exact_blocker(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    plan = _compiled(client, pub, fv)
    # The operator lowers the Bounded Atomic write bound: the atomic request is unsafe now.
    assert _put_policy(module_db_url, org, max_writes=0) == 2
    plans_before = rows(module_db_url, execution_plans, org_id=org)
    request_id = new_request_id()
    with pytest.raises(grpc.RpcError) as err:
        client.activate(pub, fv.flow_version_id, plan, request_id=request_id)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(err.value)
    assert detail.code == "activation_blocked"
    blocker = "maximum writes 1 exceeds the bounded_atomic bound 0 (policy v2)"
    assert blocker in (err.value.details() or "")
    assert "atomic_unsafe.exceeds_policy" in detail.attributes["codes"]

    # No plan was written, no activation is ACTIVE; the attempt keeps the diagnostics.
    assert rows(module_db_url, execution_plans, org_id=org) == plans_before
    attempts = rows(module_db_url, plan_activations, org_id=org)
    assert [(a["state"], a["plan_id"], a["active_slot"]) for a in attempts] == [
        ("BLOCKED", None, None)
    ]
    assert attempts[0]["activation_id"] == detail.attributes["activation_id"]
    stored = json.loads(attempts[0]["attempt_diagnostics"])
    assert stored["requested_plan_id"] == plan.plan_id and stored["policy_version"] == 2
    assert any(blocker in d["message"] for d in stored["diagnostics"])
    # A retry of the same request records the same attempt once.
    with pytest.raises(grpc.RpcError):
        client.activate(pub, fv.flow_version_id, plan, request_id=request_id)
    assert len(rows(module_db_url, plan_activations, org_id=org)) == 1
    # CompileFlowVersion, the same compiler, reports the same blocker.
    resp = client.compile(pub, fv.flow_version_id)
    assert not resp.compiled
    assert any(blocker in d.message for d in resp.diagnostics)
    assert servers.catalog.references_of(pub.scope) == set()


def test_deactivation_releases_references_and_is_idempotent(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    plan = _compiled(client, pub, fv)
    with pytest.raises(grpc.RpcError) as err:
        client.deactivate(pub, fv.flow_version_id)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    client.activate(pub, fv.flow_version_id, plan)
    ended = client.deactivate(pub, fv.flow_version_id)
    assert ended.state == DEACTIVATED and ended.HasField("deactivated_at")
    assert servers.catalog.references_of(pub.scope) == set()
    assert client.deactivate(pub, fv.flow_version_id).deactivated_at == ended.deactivated_at
    # Re-activation after deactivation is a new activation with its own references.
    again = client.activate(pub, fv.flow_version_id, plan).activation
    assert again.state == ACTIVE
    assert len(servers.catalog.references_of(pub.scope)) == 2


def test_a_newer_version_supersedes_the_active_version_of_the_flow(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    v1 = client.register(org, flows.task_flow(version=1))
    v2 = client.register(org, flows.task_flow(version=2, subject="v2"))
    p1, p2 = _compiled(client, pub, v1), _compiled(client, pub, v2)
    client.activate(pub, v1.flow_version_id, p1)
    client.activate(pub, v2.flow_version_id, p2)
    active = rows(module_db_url, plan_activations, org_id=org, state="ACTIVE")
    assert [(a["flow_version_id"], a["plan_id"]) for a in active] == [
        (v2.flow_version_id, p2.plan_id)
    ]
    with pytest.raises(grpc.RpcError) as err:
        client.activate(pub, v1.flow_version_id, p2)  # a plan of another version
    assert error_detail(err.value).code == "plan_flow_version_mismatch"


# --- reads ---------------------------------------------------------------------------------


def test_plans_and_versions_are_invisible_across_orgs(servers: Servers, client: Client) -> None:
    org, intruder = new_org(), new_org()
    pub = _publish(servers, org)
    fv = client.register(org, flows.task_flow())
    plan = _compiled(client, pub, fv)
    for ref in (plan.plan_id, plan.plan_digest, "plan_nonexistent"):
        with pytest.raises(grpc.RpcError) as err:
            client.get_plan(intruder, ref)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, ref
    # A body org that disagrees with the credential is refused, never used.
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GetPlan(
            runtime_v1.GetPlanRequest(org_id=org, plan_id=plan.plan_id),
            metadata=client.md(intruder),
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Another org cannot activate, compile or deactivate this org's version.
    foreign = _publish(servers, intruder)
    with pytest.raises(grpc.RpcError) as err:
        client.compile(foreign, fv.flow_version_id)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        client.activate(foreign, fv.flow_version_id, plan)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    listed = client.stub.ListFlowVersions(
        runtime_v1.ListFlowVersionsRequest(), metadata=client.md(intruder)
    )
    assert list(listed.flow_versions) == []


def test_list_flow_versions_pages_by_name_then_version(servers: Servers, client: Client) -> None:
    org = new_org()
    pub = _publish(servers, org)
    registered = [
        client.register(org, flows.task_flow("alpha", version=1)),
        client.register(org, flows.task_flow("alpha", version=2, subject="b")),
        client.register(org, flows.task_flow("beta", version=1)),
        client.register(org, flows.email_flow("gamma")),
    ]
    plan = _compiled(client, pub, registered[1])
    client.activate(pub, registered[1].flow_version_id, plan)
    seen: list[tuple[str, int]] = []
    activations: list[Any] = []
    token = ""
    for _ in range(10):
        page = client.stub.ListFlowVersions(
            runtime_v1.ListFlowVersionsRequest(org_id=org, page_size=3, page_token=token),
            metadata=client.md(org),
        )
        seen += [(v.flow_api_name, v.version_number) for v in page.flow_versions]
        activations += list(page.activations)
        token = page.next_page_token
        if not token:
            break
    assert seen == [("alpha", 1), ("alpha", 2), ("beta", 1), ("gamma", 1)]
    assert {(a.flow_api_name, a.plan_id) for a in activations} == {("alpha", plan.plan_id)}
    only_beta = client.stub.ListFlowVersions(
        runtime_v1.ListFlowVersionsRequest(flow_api_name="beta"), metadata=client.md(org)
    )
    assert [v.flow_api_name for v in only_beta.flow_versions] == ["beta"]
    with pytest.raises(grpc.RpcError) as err:
        client.stub.ListFlowVersions(
            runtime_v1.ListFlowVersionsRequest(flow_api_name="beta", page_token="bogus"),
            metadata=client.md(org),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_inventory_compiles_active_flows_without_changing_execution(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    task = client.register(org, flows.task_flow())
    email = client.register(org, flows.email_flow())
    broken = client.register(org, flows.unknown_capability_flow())
    for fv in (task, email):
        client.activate(pub, fv.flow_version_id, _compiled(client, pub, fv))
    plans_before = rows(module_db_url, execution_plans, org_id=org)
    acts_before = rows(module_db_url, plan_activations, org_id=org)

    report = client.inventory(pub)
    by_name = {e.flow_api_name: e for e in report.entries}
    assert sorted(by_name) == ["email_owner", "make_task"]  # only active Flows
    t, e = by_name["make_task"], by_name["email_owner"]
    assert t.compilable and t.selected_profile == BOUNDED_ATOMIC
    assert t.migration_cohort == runtime_v1.MigrationCohort.MIGRATION_COHORT_SMALL_BOUNDED_ATOMIC
    assert "legacy.run_atomically" in t.legacy_behaviors and t.fanout_proven
    assert t.estimated_step_count >= 1
    assert e.selected_profile == DURABLE
    assert e.migration_cohort == runtime_v1.MigrationCohort.MIGRATION_COHORT_EXTERNAL_EFFECTS

    named = client.inventory(pub, names=["sync_legacy"])
    (row,) = named.entries
    assert row.flow_version_id == broken.flow_version_id and not row.compilable
    assert row.migration_cohort == runtime_v1.MigrationCohort.MIGRATION_COHORT_METADATA_ONLY
    assert any(u.startswith("action legacy_sync: unknown") for u in row.unknown_capabilities)
    assert any(d.code == "atomic_unsafe.unknown_capability" for d in row.diagnostics)

    paged = client.inventory(pub, page_size=1)
    assert len(paged.entries) == 1 and paged.next_page_token
    # Nothing was written or changed.
    assert rows(module_db_url, execution_plans, org_id=org) == plans_before
    assert rows(module_db_url, plan_activations, org_id=org) == acts_before


def test_subflow_plans_are_pinned_and_reported(servers: Servers, client: Client) -> None:
    org = new_org()
    pub = _publish(servers, org)
    child = client.register(org, flows.task_flow("child_task"))
    parent = client.register(org, flows.parent_flow("parent_task", "child_task"))
    assert list(parent.referenced_subflow_api_names) == ["child_task"]
    plan = _compiled(client, pub, parent)
    full = client.get_plan(org, plan.plan_id)
    (sub,) = full.payload.subflow_plans
    assert (sub.flow_api_name, sub.flow_version_id) == ("child_task", child.flow_version_id)
    missing = client.register(org, flows.parent_flow("orphan", "never_registered"))
    resp = client.compile(pub, missing.flow_version_id)
    assert not resp.compiled
    assert any(d.code == "subflow.missing" for d in resp.diagnostics)


def test_requests_need_a_request_id(client: Client) -> None:
    org = new_org()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.RegisterFlowVersion(
            runtime_v1.RegisterFlowVersionRequest(source_json=json.dumps(flows.task_flow())),
            metadata=client.md(org),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err.value).field_path == "request_id"


def _system_mode_flow(system_identity: str | None) -> dict[str, Any]:
    fmt: dict[str, Any] = {
        "api_name": "fmt",
        "type": "ActionCall",
        "action_type": "format_text",
        "inputs": {"text": "'x'", "style": "'upper'"},
        "output_variable": "subject",
        "next": "after",
    }
    if system_identity is not None:
        fmt["system_identity"] = system_identity
    return {
        "api_name": "system_task",
        "version": 1 if system_identity is None else 2,
        "process_type": "autolaunched",
        "variables": [{"name": "subject", "type": "string"}],
        "start": "pause",
        "elements": [
            {
                "api_name": "pause",
                "type": "Wait",
                "wait": {"kind": "time", "duration": "PT1H"},
                "deadline": "PT2H",
                "expiry_policy": "terminal_failure",
                "next": "fmt",
            },
            fmt,
            {
                "api_name": "after",
                "type": "CreateRecord",
                "object": "Task",
                "fields": {"Subject": "subject"},
            },
        ],
    }


def test_system_mode_step_without_declared_identity_never_compiles_or_activates(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    """§22.6 "system-mode step requires explicit declared identity", through the API."""
    org = new_org()
    entries = json.loads(json.dumps(flows.entries()))
    for e in entries:
        if e["action_type"] == "format_text":
            e["capabilities"]["security"] = {"principal_mode": "system"}
    pub = servers.catalog.publish(org, flows.view(org), entries)
    fv = client.register(org, _system_mode_flow(None))
    resp = client.compile(pub, fv.flow_version_id)
    assert not resp.compiled and not resp.HasField("plan")
    (issue,) = [d for d in resp.diagnostics if d.code.startswith("principal.")]
    assert issue.code == "principal.system_identity_required"
    assert issue.severity == runtime_v1.DiagnosticSeverity.DIAGNOSTIC_SEVERITY_ERROR
    assert "declares no explicit system identity" in issue.message
    assert rows(module_db_url, execution_plans, org_id=org) == []

    declared = client.register(org, _system_mode_flow("svc-task-bot"))
    plan = _compiled(client, pub, declared)
    client.activate(pub, declared.flow_version_id, plan)
    (stored,) = rows(module_db_url, execution_plans, org_id=org)
    principal = ExecutionPlan.from_dict(json.loads(stored["plan_payload"])).step("fmt").principal
    assert principal is not None
    assert principal.to_dict() == {
        "mode": "system",
        "on_denied": "fault_path",
        "system_identity": "svc-task-bot",
    }
