"""After-save record triggers through gRPC (issue 5 deliverable 7), on SQLite and MariaDB:
a RecordService write the request-bound view subscribes an ACTIVE after-save Flow to
starts its run in the record transaction; the run key derives from the record mutation, so
a retried request returns the same run and never starts a second one.

The catalog is the real catalog service in-process; plans are compiled and activated
through the definitions API, runs read through the FlowRunService API.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import grpc
import pymysql
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.records import Actor, MutationResult, RecordEngine, RecordView, prepare_create
from runtime_svc.schema import flow_checkpoints, flow_runs
from services import db
from services.proto import runtime_v1
from services.request_dedupe import DedupeScope, RequestKey
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.definitions.fake_catalog import Published
from tests.integration.definitions.harness import error_detail, new_request_id
from tests.integration.records.support import record_view
from tests.integration.runs.harness import RunClient
from tests.integration.triggers.harness import record_stub, sealed_tenant, struct


def _welcome(entry_condition: str | None = None) -> dict[str, Any]:
    """Record-triggered on the demo view's ``Welcome`` subscription (Contact, after-save,
    create); sends an e-mail."""
    trigger: dict[str, Any] = {"object": "Contact", "timing": "after_save", "events": ["create"]}
    if entry_condition:
        trigger["entry_condition"] = entry_condition
    return {
        "api_name": "Welcome",
        "version": 1,
        "process_type": "record_triggered",
        "trigger": trigger,
        "variables": [{"name": "msgId", "type": "string"}],
        "start": "mail",
        "elements": [
            {
                "api_name": "mail",
                "type": "ActionCall",
                "action_type": "core.send_email",
                "inputs": {"to": "$Record.Email"},
                "output_variable": "msgId",
                "fault": "failed",
            },
            {"api_name": "failed", "type": "Fault", "code": "MAIL", "message": "no mail"},
        ],
    }


def _tenant(
    catalog: CatalogClient,
    client: RunClient,
    *,
    activate: bool = True,
    entry_condition: str | None = None,
) -> Published:
    """A sealed catalog generation of a fresh org; ``Welcome`` compiled and activated."""
    pub = sealed_tenant(catalog)
    org = pub.scope[0]
    if activate:
        fv = client.register(org, _welcome(entry_condition))
        compiled = client.compile(pub, fv.flow_version_id)
        assert compiled.compiled, [d.message for d in compiled.diagnostics]
        client.activate(pub, fv.flow_version_id, compiled.plan)
    return pub


def _create(
    client: RunClient, pub: Published, *, request_id: str | None = None, **fields: Any
) -> Any:
    return record_stub(client.channel).CreateRecord(
        runtime_v1.CreateRecordRequest(
            request_id=request_id or new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Contact",
            fields=struct(**fields),
        ),
        metadata=client.creds(pub),
        timeout=30,
    )


def _run_ids(client: RunClient, pub: Published) -> list[str]:
    return sorted(r.flow_run_id for r in client.list(pub, page_size=100).runs)


def test_create_starts_one_run_and_a_retry_returns_it(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = _tenant(catalog, client)
    request_id = new_request_id()
    first = _create(client, pub, request_id=request_id, Email="ada@example.com")
    (run_id,) = first.triggered_flow_run_ids
    run = client.get(pub, run_id)
    assert run.flow_run_id == run_id and run.org_id == pub.scope[0]
    assert _run_ids(client, pub) == [run_id]

    # The client lost the response and retries the same request: the same record, the
    # same run, and still exactly one run.
    retry = _create(client, pub, request_id=request_id, Email="ada@example.com")
    assert list(retry.triggered_flow_run_ids) == [run_id]
    assert retry.record.record_id == first.record.record_id
    assert retry.record.version == first.record.version == 1
    assert _run_ids(client, pub) == [run_id]

    # A new create (another mutation) starts its own run.
    other = _create(client, pub, Email="grace@example.com")
    (other_id,) = other.triggered_flow_run_ids
    assert other_id != run_id
    assert _run_ids(client, pub) == sorted([run_id, other_id])


def test_unsubscribed_update_and_delete_start_no_run(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = _tenant(catalog, client)
    created = _create(client, pub, Email="ada@example.com")
    (run_id,) = created.triggered_flow_run_ids
    records = record_stub(client.channel)
    rid = created.record.record_id
    updated = records.UpdateRecord(
        runtime_v1.UpdateRecordRequest(
            request_id=new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Contact",
            record_id=rid,
            expected_version=1,
            fields=struct(Email="ada@lovelace.example"),
        ),
        metadata=client.creds(pub),
        timeout=30,
    )
    assert updated.record.version == 2 and list(updated.triggered_flow_run_ids) == []
    deleted = records.DeleteRecord(
        runtime_v1.DeleteRecordRequest(
            request_id=new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Contact",
            record_id=rid,
            expected_version=2,
        ),
        metadata=client.creds(pub),
        timeout=30,
    )
    assert deleted.record.is_deleted and list(deleted.triggered_flow_run_ids) == []
    # Account is not subscribed at all.
    account = records.CreateRecord(
        runtime_v1.CreateRecordRequest(
            request_id=new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Account",
            fields=struct(Name="Acme"),
        ),
        metadata=client.creds(pub),
        timeout=30,
    )
    assert list(account.triggered_flow_run_ids) == []
    assert _run_ids(client, pub) == [run_id]


def test_entry_condition_decides_inside_the_transaction_and_the_run_carries_the_record(
    client: RunClient, catalog: CatalogClient, module_db_url: str
) -> None:
    """The plan's entry condition is evaluated over ``$Record`` / ``$Record__Prior`` in
    the record transaction; a started run's input checkpoint carries both records."""
    pub = _tenant(catalog, client, entry_condition="$Record.Email != 'skip@example.com'")
    skipped = _create(client, pub, Email="skip@example.com")
    assert list(skipped.triggered_flow_run_ids) == []
    request_id = new_request_id()
    started = _create(client, pub, request_id=request_id, Email="ada@example.com")
    (run_id,) = started.triggered_flow_run_ids
    assert _run_ids(client, pub) == [run_id]
    # A replay returns the run its first application started (looked up, not re-decided).
    replay = _create(client, pub, request_id=request_id, Email="ada@example.com")
    assert list(replay.triggered_flow_run_ids) == [run_id]
    assert _run_ids(client, pub) == [run_id]

    async def context() -> tuple[dict[str, Any], str | None]:
        engine = db.create_engine(module_db_url, pool_size=1)
        try:
            async with db.transaction(engine, readonly=True) as conn:
                c = flow_checkpoints.c
                raw = (
                    await conn.execute(
                        select(c.context_payload).where(
                            c.org_id == pub.scope[0], c.flow_run_id == run_id
                        )
                    )
                ).scalar_one()
                r = flow_runs.c
                subject = (
                    await conn.execute(
                        select(r.subject_record_key).where(
                            r.org_id == pub.scope[0], r.flow_run_id == run_id
                        )
                    )
                ).scalar_one()
            return dict(json.loads(raw)), subject
        finally:
            await engine.dispose()

    ctx, subject = asyncio.run(context())
    # The run's subject is the saved record (per-record run limits key on it).
    assert subject == f"{started.record.object_api_name}:{started.record.record_id}"
    record = ctx["variables"]["$Record"]
    assert record == {"Id": started.record.record_id, "Email": "ada@example.com"}
    assert ctx["variables"]["$Record__Prior"] is None
    assert ctx["trigger"]["record_id"] == started.record.record_id
    assert ctx["trigger"]["event"] == "create"


def test_a_failed_record_transaction_starts_no_run(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = _tenant(catalog, client)
    # Fails inside the record transaction (the parent is checked under its lock).
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, Email="ada@example.com", AccountId="no-such-account")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err.value).field_path == "fields.AccountId"
    # Fails validation before it (too long for the field).
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, Email="x" * 400)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _run_ids(client, pub) == []
    # A rolled-back request left no trace: its request id, resent with a valid body,
    # starts exactly one run.
    request_id = new_request_id()
    with pytest.raises(grpc.RpcError):
        _create(client, pub, request_id=request_id, AccountId="no-such-account")
    ok = _create(client, pub, request_id=request_id, Email="ada@example.com")
    assert len(ok.triggered_flow_run_ids) == 1
    assert _run_ids(client, pub) == list(ok.triggered_flow_run_ids)


def test_subscribed_flow_without_active_plan_fails_admission_before_writing(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = _tenant(catalog, client, activate=False)
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, Email="ada@example.com")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err.value).code == "admission.no_active_plan"
    # Nothing was written: an unsubscribed object still writes normally.
    records = record_stub(client.channel)
    account = records.CreateRecord(
        runtime_v1.CreateRecordRequest(
            request_id=new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Account",
            fields=struct(Name="Acme"),
        ),
        metadata=client.creds(pub),
        timeout=30,
    )
    assert list(account.triggered_flow_run_ids) == []
    assert _run_ids(client, pub) == []


def test_a_second_org_never_sees_the_first_orgs_run(
    client: RunClient, catalog: CatalogClient
) -> None:
    mine, theirs = _tenant(catalog, client), _tenant(catalog, client)
    (my_run,) = _create(client, mine, Email="ada@example.com").triggered_flow_run_ids
    (their_run,) = _create(client, theirs, Email="eve@example.com").triggered_flow_run_ids
    assert my_run != their_run
    with pytest.raises(grpc.RpcError) as err:
        client.get(theirs, my_run)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _run_ids(client, theirs) == [their_run]
    assert _run_ids(client, mine) == [my_run]
    # Reusing the other org's request id does not replay the other org's write.
    rid = new_request_id()
    a = _create(client, mine, request_id=rid, Email="same@example.com")
    b = _create(client, theirs, request_id=rid, Email="same@example.com")
    assert set(a.triggered_flow_run_ids).isdisjoint(b.triggered_flow_run_ids)
    assert len(_run_ids(client, mine)) == 2 and len(_run_ids(client, theirs)) == 2


async def test_on_applied_runs_in_the_transaction_and_again_on_a_retry(
    module_db_url: str,
) -> None:
    """The engine hook: inside the record transaction, again on a whole-transaction retry
    (so a captured result must be replaced), never on a replayed request (the ledger
    answers it with the original response)."""
    engine = db.create_engine(module_db_url, pool_size=2)
    try:
        records = RecordEngine(engine)
        view: RecordView = record_view()
        org = f"org-{uuid.uuid4().hex[:12]}"
        seen: list[MutationResult] = []
        deadlocked = False

        async def hook(conn: AsyncConnection, applied: MutationResult) -> None:
            nonlocal deadlocked
            seen.append(applied)
            if not deadlocked:
                deadlocked = True
                # A deadlock victim: the engine rolls back and runs the whole transaction
                # again from the same input.
                raise pymysql.err.OperationalError(1213, "Deadlock found")

        mutation = prepare_create(view, "Account", "acc-1", {"Name": "Acme"}, [])
        key = RequestKey(DedupeScope(org), "CreateRecord", "req-1", "digest-1")
        actor = Actor("workload", "test")

        def encode(applied: MutationResult) -> bytes:
            return applied.event_id.encode()

        done = await records.mutate_once(
            org, view, mutation, actor=actor, key=key, encode=encode, on_applied=hook
        )
        result = done.value
        assert len(seen) == 2 and records.stats.conflict_retries == 1
        assert result is not None and seen[-1] == result and result.record.version == 1
        # The rolled-back attempt wrote nothing: one history sequence.
        assert seen[0].history_sequence == seen[1].history_sequence == 1

        replay = await records.mutate_once(
            org, view, mutation, actor=actor, key=key, encode=encode, on_applied=hook
        )
        assert replay.replayed and replay.response == result.event_id.encode()
        assert len(seen) == 2  # neither the mutation nor the hook ran again
    finally:
        await engine.dispose()
