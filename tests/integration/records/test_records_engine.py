"""Record engine on SQLite and MariaDB: round trip, validation, versions, soft delete,
exactly-once history/event/audit in one transaction, late discovery, org scoping,
request replay and audit safety."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.records import (
    Actor,
    Lineage,
    MutationKind,
    MutationResult,
    RecordEngine,
    RecordMutation,
    RecordValidationError,
    StaleVersionError,
    acquire_locks_txn,
    apply_mutation_txn,
    plan_mutation,
    prepare_create,
    prepare_delete,
    prepare_update,
)
from runtime_svc.records import store as record_store
from runtime_svc.resources import (
    LateResourceDiscoveryError,
    LockPlan,
    LockRole,
    business_key,
    history_key,
)
from runtime_svc.schema import (
    audit_records,
    business_events,
    record_history_sequences,
    records,
    runtime_requests,
)
from services.db import strategy_for, transaction
from services.db_batch import Write, execute_writes
from services.errors import (
    AlreadyExistsError,
    ConflictError,
    FenceLostError,
    InvalidArgumentError,
    NotFoundError,
)
from services.request_dedupe import DedupeScope, RequestKey
from tests.integration.records.support import (
    SECRET,
    audit_and_event_text,
    audit_details,
    count,
    last_sequence,
    record_count,
    record_view,
    sequences,
)

VIEW = record_view()
ACTOR = Actor("workload", "records-test")


async def _create(rec: RecordEngine, org: str, obj: str, rid: str, **fields: Any) -> int:
    result = await rec.mutate(org, VIEW, prepare_create(VIEW, obj, rid, fields), actor=ACTOR)
    return result.record.version


async def test_create_get_update_delete_round_trip(engine: AsyncEngine, org: str) -> None:
    rec = RecordEngine(engine)
    created = await rec.mutate(
        org,
        VIEW,
        prepare_create(VIEW, "Account", "", {"Name": "Acme", "Employees": 10, "Tier": "Gold"}),
        actor=ACTOR,
    )
    rid = created.record.record_id
    assert created.record.version == 1 and created.history_sequence == 1
    assert created.changed_fields == ("Employees", "Name", "Tier")

    got = await rec.get(org, "Account", rid)
    assert got.fields == {"Name": "Acme", "Employees": 10, "Tier": "Gold"}
    assert got.version == 1 and not got.is_deleted and got.org_id == org
    assert got.created_at == got.updated_at

    updated = await rec.mutate(
        org,
        VIEW,
        prepare_update(VIEW, "Account", rid, 1, {"Employees": 11, "Tier": None}),
        actor=ACTOR,
    )
    assert updated.record.version == 2 and updated.history_sequence == 2
    assert updated.changed_fields == ("Employees", "Tier")
    assert (await rec.get(org, "Account", rid)).fields == {"Name": "Acme", "Employees": 11}

    deleted = await rec.mutate(org, VIEW, prepare_delete(VIEW, "Account", rid, 2), actor=ACTOR)
    assert deleted.record.is_deleted and deleted.record.version == 3
    assert deleted.history_sequence == 3
    with pytest.raises(NotFoundError):
        await rec.get(org, "Account", rid)  # normal reads filter deleted rows
    with pytest.raises(NotFoundError):
        await rec.mutate(
            org, VIEW, prepare_update(VIEW, "Account", rid, 3, {"Employees": 1}), actor=ACTOR
        )
    with pytest.raises(NotFoundError):
        await rec.mutate(org, VIEW, prepare_delete(VIEW, "Account", rid, 3), actor=ACTOR)
    with pytest.raises(AlreadyExistsError):  # a deleted identity is not reused
        await _create(rec, org, "Account", rid, Name="Again")

    assert await sequences(engine, org, "Account", rid) == [1, 2, 3]
    events = await count(engine, business_events, org, record_id=rid)
    audits = await count(engine, audit_records, org, record_id=rid)
    assert events == audits == 3  # exactly one event and one audit row per mutation
    assert [d["changed_fields"] for d in await audit_details(engine, org, rid)] == [
        ["Employees", "Name", "Tier"],
        ["Employees", "Tier"],
        [],
    ]


async def test_parent_refs_lock_relevant_parent_must_exist(engine: AsyncEngine, org: str) -> None:
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "acc-1", Name="Parent")
    child = await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Contact", "con-1", {"AccountId": "acc-1"}), actor=ACTOR
    )
    assert [(p.relationship_name, p.parent_record_id) for p in child.record.parent_refs] == [
        ("AccountId", "acc-1")
    ]
    assert (await rec.get(org, "Contact", "con-1")).parent_refs == child.record.parent_refs

    with pytest.raises(RecordValidationError) as info:
        await rec.mutate(
            org, VIEW, prepare_create(VIEW, "Contact", "con-2", {"AccountId": "nope"}), actor=ACTOR
        )
    assert info.value.field_path == "fields.AccountId"
    assert dict(info.value.issues) == {"fields.AccountId": "parent_not_found"}
    # A lookup that is not lock-relevant only needs a well-formed identity.
    await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Note", "n-1", {"AboutId": "missing-1"}), actor=ACTOR
    )
    assert await record_count(engine, org) == 3  # the failed create left nothing


async def test_validation_errors_name_the_field(engine: AsyncEngine, org: str) -> None:
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Account", "a1", {"Name": "x", "Employees": "ten"})
    assert info.value.field_path == "fields.Employees"
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Contact", "c1", {"Score": 3})
    assert info.value.field_path == "fields.Score"  # read-only in the catalog view
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Contact", "c1", {"Nope": 3})
    assert dict(info.value.issues) == {"fields.Nope": "unknown_field"}
    with pytest.raises(RecordValidationError) as info:
        prepare_create(VIEW, "Account", "a1", {})
    assert dict(info.value.issues) == {"fields.Name": "required"}
    assert await record_count(engine, org) == 0


async def test_stale_version_is_rejected_with_aborted(engine: AsyncEngine, org: str) -> None:
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")
    await rec.mutate(
        org, VIEW, prepare_update(VIEW, "Account", "a1", 1, {"Employees": 1}), actor=ACTOR
    )
    with pytest.raises(StaleVersionError) as info:
        await rec.mutate(
            org, VIEW, prepare_update(VIEW, "Account", "a1", 1, {"Employees": 2}), actor=ACTOR
        )
    assert info.value.code.name == "ABORTED"
    assert (info.value.expected_version, info.value.found_version) == (1, 2)
    with pytest.raises(StaleVersionError):
        await rec.mutate(org, VIEW, prepare_delete(VIEW, "Account", "a1", 3), actor=ACTOR)
    state = await rec.get(org, "Account", "a1")
    assert state.version == 2 and state.fields["Employees"] == 1
    assert await sequences(engine, org, "Account", "a1") == [1, 2]  # no gap from the rejects


async def test_cross_org_reads_and_writes_answer_not_found(engine: AsyncEngine, org: str) -> None:
    rec = RecordEngine(engine)
    other = org + "-other"
    await _create(rec, org, "Account", "shared-id", Name="Mine")
    with pytest.raises(NotFoundError):
        await rec.get(other, "Account", "shared-id")
    with pytest.raises(NotFoundError):
        await rec.mutate(
            other, VIEW, prepare_update(VIEW, "Account", "shared-id", 1, {"Name": "x"}), actor=ACTOR
        )
    with pytest.raises(NotFoundError):
        await rec.mutate(other, VIEW, prepare_delete(VIEW, "Account", "shared-id", 1), actor=ACTOR)
    # The same identity in another org is another record.
    assert await _create(rec, other, "Account", "shared-id", Name="Theirs") == 1
    assert (await rec.get(org, "Account", "shared-id")).fields["Name"] == "Mine"
    assert (await rec.get(other, "Account", "shared-id")).fields["Name"] == "Theirs"


async def _move(conn: AsyncConnection, org: str, moved: str) -> None:
    """Move Account/a1's record version (or its history sequence) on by one inside the
    caller's transaction: what a lost pessimistic lock would let another writer do."""
    table = records if moved == "record" else record_history_sequences
    column = "record_version" if moved == "record" else "last_sequence"
    c = table.c
    await conn.execute(
        update(table)
        .where(c.org_id == org, c.object_name == "Account", c.record_id == "a1")
        .values({column: c[column] + 1})
    )


@pytest.mark.parametrize("moved", ["record", "history"])
async def test_a_moved_record_or_history_row_under_the_lock_writes_nothing(
    engine: AsyncEngine, org: str, moved: str
) -> None:
    """The record's CAS and its history advance (one statement on MariaDB, two on
    SQLite) each keep their fence: a row that moved although its lock was held (a lost
    pessimistic lock on TiDB; simulated by writing it in the same transaction) refuses
    the write — a stale record version as ``StaleVersionError``, a moved history
    sequence as ``FenceLostError`` on the history row — and nothing is kept."""
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")
    mutation = prepare_update(VIEW, "Account", "a1", 1, {"Employees": 5})
    expected = StaleVersionError if moved == "record" else FenceLostError

    with pytest.raises(expected) as caught:
        async with transaction(engine) as conn:
            current = await record_store.read_record_txn(conn, org, "Account", "a1")
            plan = plan_mutation(VIEW, mutation, current)
            locks = await acquire_locks_txn(conn, org, VIEW, plan)
            await _move(conn, org, moved)
            await apply_mutation_txn(conn, org, VIEW, mutation, locks, actor=ACTOR)
    if moved == "history":
        assert caught.value.attributes["entity"] == "record_history_sequences"
    assert caught.value.found_version == 2
    state = await rec.get(org, "Account", "a1")
    assert state.version == 1 and "Employees" not in state.fields
    assert await sequences(engine, org, "Account", "a1") == [1]
    assert await last_sequence(engine, org, "Account", "a1") == 1


async def test_deferred_writes_wait_for_the_caller_and_write_what_the_mutation_would_have(
    engine: AsyncEngine, org: str
) -> None:
    """``apply_mutation_txn(defer=…)`` (ADR 0011): the mutation's checked writes — the
    record's compare-and-swap with its history advance where the backend writes both in
    one statement, the event and audit rows — are handed to the caller, not executed;
    once the caller executes them (later, in the same transaction) the rows are those
    of the undeferred mutation."""
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")
    mutation = prepare_update(VIEW, "Account", "a1", 1, {"Employees": 5})
    batched = strategy_for(engine.dialect).multi_table_update
    async with transaction(engine) as conn:
        current = await record_store.read_record_txn(conn, org, "Account", "a1")
        locks = await acquire_locks_txn(conn, org, VIEW, plan_mutation(VIEW, mutation, current))
        deferred: list[Write] = []
        result = await apply_mutation_txn(
            conn, org, VIEW, mutation, locks, actor=ACTOR, defer=deferred
        )
        # The event and audit rows always wait; the record's own UPDATE waits where it is
        # one statement with the history advance (elsewhere it ran in place).
        assert len(deferred) == (3 if batched else 2)
        stored = await record_store.read_record_txn(conn, org, "Account", "a1")
        assert stored is not None and stored.version == (1 if batched else 2)
        events = select(func.count()).select_from(business_events)
        events = events.where(business_events.c.org_id == org)
        assert (await conn.execute(events)).scalar_one() == 1  # the create's only
        await execute_writes(conn, deferred)
    state = await rec.get(org, "Account", "a1")
    assert state.version == result.record.version == 2 and state.fields["Employees"] == 5
    assert await sequences(engine, org, "Account", "a1") == [1, 2]
    assert await last_sequence(engine, org, "Account", "a1") == 2
    assert await count(engine, business_events, org) == 2
    assert await count(engine, audit_records, org) == 2


@pytest.mark.parametrize("moved", ["record", "history"])
async def test_a_row_moved_before_deferred_writes_run_refuses_them_with_the_same_error(
    engine: AsyncEngine, org: str, moved: str
) -> None:
    """A deferred compare-and-swap keeps its check: the record (or history row) moved
    between the mutation and the caller's execution of its writes (a lost pessimistic
    lock; simulated in the same transaction) raises what the undeferred write raises
    and nothing is kept."""
    if not strategy_for(engine.dialect).multi_table_update:
        pytest.skip("the record's own UPDATE is not deferred here (no multi-table UPDATE)")
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")
    mutation = prepare_update(VIEW, "Account", "a1", 1, {"Employees": 5})
    expected = StaleVersionError if moved == "record" else FenceLostError
    with pytest.raises(expected) as caught:
        async with transaction(engine) as conn:
            current = await record_store.read_record_txn(conn, org, "Account", "a1")
            plan = plan_mutation(VIEW, mutation, current)
            locks = await acquire_locks_txn(conn, org, VIEW, plan)
            deferred: list[Write] = []
            await apply_mutation_txn(conn, org, VIEW, mutation, locks, actor=ACTOR, defer=deferred)
            await _move(conn, org, moved)
            await execute_writes(conn, deferred)
    assert caught.value.found_version == 2
    state = await rec.get(org, "Account", "a1")
    assert state.version == 1 and "Employees" not in state.fields
    assert await sequences(engine, org, "Account", "a1") == [1]
    assert await count(engine, business_events, org) == 1


async def test_a_create_of_an_existing_record_refuses_before_its_history_row_and_ledger_row(
    engine: AsyncEngine, org: str
) -> None:
    """The create's record and history INSERTs share a round trip (record first): an
    existing record is ``AlreadyExistsError`` with nothing after it run — its history
    row, event, audit and the request's ledger row — so a retry of the request id runs
    fresh and is refused the same way."""
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")
    create = prepare_create(VIEW, "Account", "a1", {"Name": "Again"})
    key = RequestKey(DedupeScope(org), "CreateRecord", "dup-1", "digest-dup-1")
    for _ in range(2):
        with pytest.raises(AlreadyExistsError):
            await rec.mutate_once(org, VIEW, create, actor=ACTOR, key=key, encode=_encode_id)
    state = await rec.get(org, "Account", "a1")
    assert state.version == 1 and state.fields["Name"] == "Acme"
    assert await last_sequence(engine, org, "Account", "a1") == 1
    assert await count(engine, business_events, org) == 1
    assert await count(engine, audit_records, org) == 1
    assert await count(engine, runtime_requests, org) == 0


async def test_concurrent_duplicates_of_one_request_create_one_record(
    engine: AsyncEngine, org: str
) -> None:
    """The ledger row rides in the create's last round trip: two concurrent deliveries of
    one request both write, one ledger INSERT loses (``DuplicateRequestRace``: its whole
    transaction, record included, rolls back) and the loser replays the winner."""
    rec = RecordEngine(engine)
    key = RequestKey(DedupeScope(org), "CreateRecord", "race-1", "digest-race-1")
    # Each delivery prepares its own create (a generated record id each, as RecordService).
    creates = [prepare_create(VIEW, "Account", "", {"Name": "Twice"}) for _ in range(2)]
    first, second = await asyncio.gather(
        *(
            rec.mutate_once(org, VIEW, create, actor=ACTOR, key=key, encode=_encode_id)
            for create in creates
        )
    )
    assert first.response == second.response
    assert sorted([first.replayed, second.replayed]) == [False, True]
    assert await record_count(engine, org) == 1
    assert await count(engine, business_events, org) == 1
    assert await count(engine, runtime_requests, org) == 1


def _encode_id(result: MutationResult) -> bytes:
    return result.record.record_id.encode()


async def test_failure_after_the_record_write_persists_nothing(
    engine: AsyncEngine, org: str
) -> None:
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")
    mutation = prepare_update(VIEW, "Account", "a1", 1, {"Employees": 5})

    class Boom(Exception):
        pass

    async def step(conn: AsyncConnection) -> None:
        current = await record_store.read_record_txn(conn, org, "Account", "a1")
        locks = await acquire_locks_txn(conn, org, VIEW, plan_mutation(VIEW, mutation, current))
        result = await apply_mutation_txn(conn, org, VIEW, mutation, locks, actor=ACTOR)
        assert result.record.version == 2  # written inside the transaction…
        raise Boom  # …then the step fails before commit

    with pytest.raises(Boom):
        async with transaction(engine) as conn:
            await step(conn)

    state = await rec.get(org, "Account", "a1")
    assert state.version == 1 and "Employees" not in state.fields
    assert await sequences(engine, org, "Account", "a1") == [1]
    assert await last_sequence(engine, org, "Account", "a1") == 1
    assert await count(engine, audit_records, org) == 1


async def test_audit_failure_rolls_back_the_business_change(
    engine: AsyncEngine, org: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme")

    async with transaction(engine, readonly=True) as conn:
        mine = select(audit_records.c.audit_record_id).where(audit_records.c.org_id == org)
        taken = (await conn.execute(mine)).scalar_one()
    real_audit_write = record_store.audit_write

    def colliding_audit(audit: Any) -> Any:
        # The audit INSERT fails in the database — the last statement of the write's
        # batched round trip on MariaDB (ADR 0010), after the record, history and event
        # writes went through.
        return real_audit_write(replace(audit, audit_record_id=taken))

    monkeypatch.setattr(record_store, "audit_write", colliding_audit)
    with pytest.raises(IntegrityError):
        await rec.mutate(
            org, VIEW, prepare_update(VIEW, "Account", "a1", 1, {"Employees": 5}), actor=ACTOR
        )
    monkeypatch.undo()
    state = await rec.get(org, "Account", "a1")
    assert state.version == 1 and "Employees" not in state.fields
    assert await sequences(engine, org, "Account", "a1") == [1]
    assert await count(engine, audit_records, org) == 1


async def test_late_discovery_is_refused_before_any_write(engine: AsyncEngine, org: str) -> None:
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "acc-1", Name="P1")
    await _create(rec, org, "Account", "acc-2", Name="P2")
    await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Contact", "c1", {"AccountId": "acc-1"}), actor=ACTOR
    )
    move = prepare_update(VIEW, "Contact", "c1", 1, {"AccountId": "acc-2"})
    # An admitted plan that knows the record and the new parent but not the old one.
    narrow = LockPlan.of(
        [
            (business_key("Contact", "c1"), LockRole.RECORD),
            (business_key("Account", "acc-2"), LockRole.PARENT),
            (history_key("Contact", "c1"), LockRole.HISTORY),
        ]
    )
    with pytest.raises(LateResourceDiscoveryError) as info:
        async with transaction(engine) as conn:
            locks = await acquire_locks_txn(conn, org, VIEW, narrow)
            await apply_mutation_txn(conn, org, VIEW, move, locks, actor=ACTOR)
    assert info.value.resource_key == business_key("Account", "acc-1")
    assert info.value.attributes["role"] == "parent"
    # A plan without the record itself is refused as well.
    other = LockPlan.of([(business_key("Account", "acc-1"), LockRole.RECORD)])
    with pytest.raises(LateResourceDiscoveryError):
        async with transaction(engine) as conn:
            locks = await acquire_locks_txn(conn, org, VIEW, other)
            await apply_mutation_txn(conn, org, VIEW, move, locks, actor=ACTOR)
    assert (await rec.get(org, "Contact", "c1")).fields["AccountId"] == "acc-1"
    assert await sequences(engine, org, "Contact", "c1") == [1]


async def test_public_write_replans_after_late_discovery(
    engine: AsyncEngine, org: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§13.3: the plan came from a stale read (the child moved to another parent before
    the lock); the whole transaction rolls back and restarts with the expanded plan."""
    rec = RecordEngine(engine)
    for rid in ("acc-1", "acc-2", "acc-3"):
        await _create(rec, org, "Account", rid, Name=rid)
    await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Contact", "c1", {"AccountId": "acc-1"}), actor=ACTOR
    )
    await rec.mutate(
        org, VIEW, prepare_update(VIEW, "Contact", "c1", 1, {"AccountId": "acc-2"}), actor=ACTOR
    )
    real_read = record_store.read_record_txn
    stale_reads = 0

    async def stale_first_plain_read(conn: AsyncConnection, *args: Any, **kw: Any) -> Any:
        nonlocal stale_reads
        state = await real_read(conn, *args, **kw)
        if not kw.get("lock") and stale_reads == 0 and state is not None:
            stale_reads += 1
            return type(state)(**{**state.__dict__, "fields": {"AccountId": "acc-1"}})
        return state

    monkeypatch.setattr(record_store, "read_record_txn", stale_first_plain_read)
    result = await rec.mutate(
        org, VIEW, prepare_update(VIEW, "Contact", "c1", 2, {"AccountId": "acc-3"}), actor=ACTOR
    )
    assert stale_reads == 1 and rec.stats.replans == 1
    assert result.record.version == 3 and result.record.fields["AccountId"] == "acc-3"
    assert await sequences(engine, org, "Contact", "c1") == [1, 2, 3]


async def test_composable_txn_writes_flow_lineage_and_several_mutations(
    engine: AsyncEngine, org: str
) -> None:
    """The Flow worker's shape: one plan for all mutations of a step, locks first, then
    the mutations (expected version = version read under lock), derived rows last."""
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "acc-1", Name="P")
    create = prepare_create(VIEW, "Contact", "c9", {"AccountId": "acc-1", "LastName": "A"})
    touch = RecordMutation(MutationKind.UPDATE, "Account", "acc-1", {"Employees": 3})
    again = RecordMutation(MutationKind.UPDATE, "Contact", "c9", {"LastName": "B"})
    lineage = Lineage("run-1", "step-1", "attempt-1")
    async with transaction(engine) as conn:
        plan = plan_mutation(VIEW, create).union(plan_mutation(VIEW, touch))
        locks = await acquire_locks_txn(conn, org, VIEW, plan, [create])
        results = [
            await apply_mutation_txn(conn, org, VIEW, m, locks, actor=ACTOR, lineage=lineage)
            for m in (create, touch, again)
        ]
    assert [r.record.version for r in results] == [1, 2, 2]
    assert [r.history_sequence for r in results] == [1, 2, 2]
    assert await sequences(engine, org, "Contact", "c9") == [1, 2]
    assert await count(engine, business_events, org, flow_run_id="run-1") == 3
    assert await count(engine, audit_records, org, attempt_id="attempt-1") == 3
    assert (await rec.get(org, "Contact", "c9")).fields == {"AccountId": "acc-1", "LastName": "B"}


async def test_request_replay_applies_once_and_answers_the_original(
    engine: AsyncEngine, org: str
) -> None:
    rec = RecordEngine(engine)
    create = prepare_create(VIEW, "Account", "", {"Name": "Acme"})
    key = RequestKey(DedupeScope(org, "inst-1"), "CreateRecord", "req-1", "digest-a")

    def encode(result: MutationResult) -> bytes:
        return f"{result.record.record_id}@{result.record.version}".encode()

    first = await rec.mutate_once(org, VIEW, create, actor=ACTOR, key=key, encode=encode)
    assert first.value is not None
    rid = first.value.record.record_id
    await rec.mutate(org, VIEW, prepare_update(VIEW, "Account", rid, 1, {"Name": "B"}), actor=ACTOR)
    # A client retry after a lost response: the server generated another id this time.
    retry = prepare_create(VIEW, "Account", "", {"Name": "Acme"})
    second = await rec.mutate_once(org, VIEW, retry, actor=ACTOR, key=key, encode=encode)
    # The original answer (version 1), not the record's current version 2.
    assert second.replayed and second.response == f"{rid}@1".encode() == first.response
    assert await record_count(engine, org) == 1
    assert await count(engine, business_events, org) == 2  # the create and the update
    async with transaction(engine, readonly=True) as conn:
        e = business_events.c
        evidence = (
            await conn.execute(
                select(e.request_rpc, e.request_id).where(e.org_id == org, e.event_type == "create")
            )
        ).one()
    assert tuple(evidence) == ("CreateRecord", "req-1")  # the request is kept as evidence
    with pytest.raises(InvalidArgumentError) as info:
        await rec.mutate_once(
            org,
            VIEW,
            retry,
            actor=ACTOR,
            key=replace(key, request_digest="digest-b"),
            encode=encode,
        )
    assert info.value.field_path == "request_id"
    # The dedupe scope is the complete trusted scope: another installation of the org (or
    # another org) may use the same id.
    for scope in (DedupeScope(org, "inst-2"), DedupeScope(org + "-b", "inst-1")):
        other = await rec.mutate_once(
            scope.org_id, VIEW, retry, actor=ACTOR, key=replace(key, scope=scope), encode=encode
        )
        assert not other.replayed


async def test_audit_and_events_hold_no_field_values(engine: AsyncEngine, org: str) -> None:
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "a1", Name="Acme", ApiKey=SECRET)
    await rec.mutate(
        org, VIEW, prepare_update(VIEW, "Account", "a1", 1, {"ApiKey": SECRET + "2"}), actor=ACTOR
    )
    stored = await audit_and_event_text(engine, org)
    assert "ApiKey" in stored  # names of changed fields are evidence…
    assert SECRET not in stored and "Acme" not in stored  # …values are not


async def test_concurrent_updates_have_gapless_history(engine: AsyncEngine, org: str) -> None:
    """N writers race optimistic updates on one record (re-read + retry on ABORTED)."""
    n = 12
    rec = RecordEngine(engine)
    await _create(rec, org, "Account", "hot", Name="Hot", Employees=0)

    async def writer(i: int) -> int:
        for attempts in range(1, 500):
            current = await rec.get(org, "Account", "hot")
            try:
                await rec.mutate(
                    org,
                    VIEW,
                    prepare_update(VIEW, "Account", "hot", current.version, {"Balance": i}),
                    actor=ACTOR,
                )
                return attempts
            except (StaleVersionError, ConflictError):
                await asyncio.sleep(0)
        raise AssertionError("writer never succeeded")

    await asyncio.gather(*(writer(i) for i in range(n)))
    state = await rec.get(org, "Account", "hot")
    assert state.version == n + 1  # create + N updates
    assert await sequences(engine, org, "Account", "hot") == list(range(1, n + 2))
    assert await last_sequence(engine, org, "Account", "hot") == n + 1
    assert await count(engine, audit_records, org, record_id="hot") == n + 1
