"""``StartRun`` of a Bounded Atomic Flow through gRPC (issue 6 deliverables 2-3, §18.3), on
SQLite and MariaDB, with the real catalog: a ``run_atomically: true`` Flow the compiler
proved safe executes inside the call — one owned transaction for its business writes,
final checkpoint and terminal state — and returns its terminal result and outputs; an
unsafe one never reaches the runtime (compilation refuses it, so it cannot be activated).
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from runtime_svc.schema import records
from services.proto import common_v1, runtime_v1
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.definitions.harness import error_detail, rows
from tests.integration.runs.harness import RunClient
from tests.integration.triggers.harness import sealed_tenant

SUCCEEDED = common_v1.RunState.RUN_STATE_SUCCEEDED
BOUNDED_ATOMIC = common_v1.ExecutionProfile.EXECUTION_PROFILE_BOUNDED_ATOMIC


def _open_account(**extra: Any) -> dict[str, Any]:
    """Creates an Account and a Contact under it; outputs the account id."""
    return {
        "api_name": "OpenAccount",
        "version": 1,
        "process_type": "autolaunched",
        "run_atomically": True,
        "variables": [
            {"name": "name", "type": "string", "input": True},
            {"name": "acct", "type": "record", "object": "Account"},
            {"name": "acctId", "type": "string", "output": True},
        ],
        "start": "make_account",
        "elements": [
            {
                "api_name": "make_account",
                "type": "CreateRecord",
                "object": "Account",
                "fields": {"Name": "name"},
                "output_variable": "acct",
                "next": "make_contact",
            },
            {
                "api_name": "make_contact",
                "type": "CreateRecord",
                "object": "Contact",
                "fields": {"AccountId": "acct.Id", "Email": "'owner@example.com'"},
                "next": "out",
            },
            {
                "api_name": "out",
                "type": "Assignment",
                "assignments": [{"target": "acctId", "value": "acct.Id"}],
            },
        ],
        **extra,
    }


def _unsafe() -> dict[str, Any]:
    """``run_atomically`` with an external effect: never Bounded Atomic."""
    return {
        "api_name": "MailAtomically",
        "version": 1,
        "process_type": "autolaunched",
        "run_atomically": True,
        "variables": [{"name": "msgId", "type": "string"}],
        "start": "mail",
        "elements": [
            {
                "api_name": "mail",
                "type": "ActionCall",
                "action_type": "core.send_email",
                "inputs": {"to": "'x@example.com'"},
                "output_variable": "msgId",
            }
        ],
    }


def test_safe_run_atomically_flow_returns_its_terminal_result_synchronously(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = sealed_tenant(catalog)
    fv = client.register(pub.scope[0], _open_account())
    compiled = client.compile(pub, fv.flow_version_id)
    assert compiled.compiled, [d.message for d in compiled.diagnostics]
    assert compiled.plan.execution_profile == BOUNDED_ATOMIC
    client.activate(pub, fv.flow_version_id, compiled.plan)

    resp = client.start(pub, flow="OpenAccount", inputs={"name": "Initech"})  # no wait asked
    assert resp.completed and not resp.existing_run
    run = resp.run
    assert run.runtime_state == SUCCEEDED
    acct_id = dict(run.output_variables)["acctId"]
    record = runtime_v1.RecordServiceStub(client.channel).GetRecord(
        runtime_v1.GetRecordRequest(object_api_name="Account", record_id=acct_id),
        metadata=client.creds(pub),
        timeout=30,
    )
    assert json_format.MessageToDict(record.record.fields) == {"Name": "Initech"}

    # One step, one committed attempt: the whole Flow was one owned transaction.
    support = client.support(pub, run.flow_run_id)
    steps = [s for s in support.steps if s.plan_step_key == "$atomic"]
    assert len(steps) == 1
    attempts = [a for a in support.attempts if a.step_execution_id == steps[0].step_execution_id]
    assert len(attempts) == 1

    # The same idempotency key returns the finished run without running it again.
    keyed = client.start(pub, flow="OpenAccount", inputs={"name": "Hooli"}, key="k-1")
    again = client.start(pub, flow="OpenAccount", inputs={"name": "Hooli"}, key="k-1")
    assert again.existing_run and again.completed
    assert again.run.flow_run_id == keyed.run.flow_run_id
    assert dict(again.run.output_variables) == dict(keyed.run.output_variables)


def test_a_failing_atomic_flow_writes_nothing(
    client: RunClient, catalog: CatalogClient, module_db_url: str
) -> None:
    """Account.Name is required: the run's one transaction fails validation, the run ends
    failed, and neither record of the Flow exists."""
    pub = sealed_tenant(catalog)
    fv = client.register(pub.scope[0], _open_account())
    compiled = client.compile(pub, fv.flow_version_id)
    client.activate(pub, fv.flow_version_id, compiled.plan)
    resp = client.start(pub, flow="OpenAccount", inputs={})
    assert resp.completed
    assert resp.run.runtime_state == common_v1.RunState.RUN_STATE_TERMINAL_FAILED
    assert rows(module_db_url, records, org_id=pub.scope[0]) == []
    ok = client.start(pub, flow="OpenAccount", inputs={"name": "Initech"})
    assert ok.run.runtime_state == SUCCEEDED
    assert len(rows(module_db_url, records, org_id=pub.scope[0])) == 2


def test_unsafe_run_atomically_flow_never_reaches_the_runtime(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = sealed_tenant(catalog)
    fv = client.register(pub.scope[0], _unsafe())
    compiled = client.compile(pub, fv.flow_version_id)
    assert not compiled.compiled
    codes = {d.code for d in compiled.diagnostics}
    assert any(c.startswith("atomic_unsafe.") for c in codes), codes
    with pytest.raises(grpc.RpcError) as err:
        client.start(pub, flow="MailAtomically", inputs={})
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # never activated
    assert error_detail(err.value).code
