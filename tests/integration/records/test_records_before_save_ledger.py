"""A deduplicated before-save write (every ``RecordService`` write) makes its trigger
admission's activation read in the request ledger's lookup — the transaction's first
statement — instead of a statement of its own (``BeforeSaveDispatcher.activation_read``,
``RecordEngine.mutate_once(also=…)``), on SQLite and MariaDB:

* the write costs exactly what a bare deduplicated create costs (one transaction, the
  same statements) and writes the transformed record;
* activation state is still read per write, in the write's transaction: a deactivation
  committed before the next write is seen by it at once (a Flow the view still
  subscribes without an active plan refuses the write closed), a new activation runs
  the Flow again;
* a retry of the same request replays without running the transform again.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.definitions import repository as repo
from runtime_svc.records import (
    MutationResult,
    RecordMutation,
    RecordState,
    prepare_create,
)
from runtime_svc.schema import plan_activations, records
from services import db
from services.db_batch import statements_of
from services.digest import versioned_digest
from services.errors import FailedPreconditionError
from services.request_dedupe import DedupeScope, Deduplicated, RequestKey
from tests.integration.records.test_records_before_save import ACTOR, GOLDEN, _World, _world
from tests.integration.records.test_records_write_cost import CREATE_STATEMENTS
from tests.unit.compiler.compiler_corpus import read_flow

_FIELDS = {"Name": "Big deal", "Amount": 150_000, "StageName": "Prospecting"}
_TRANSFORMED = {"Discount": 15, "Priority": "High", "Description": "BIG DEAL / HIGH"}


async def _write_once(w: _World, request_id: str) -> Deduplicated[MutationResult]:
    """What ``RecordService.CreateRecord`` runs for a before-save subscribed create."""
    dispatcher, org, request, view = w.dispatcher, w.org, w.request, w.view
    mutation = prepare_create(view, "Opportunity", "", _FIELDS)
    activations = dispatcher.activation_read(org, request, mutation)
    assert activations is not None

    async def transform(
        conn: AsyncConnection, m: RecordMutation, current: RecordState | None
    ) -> RecordMutation:
        return await dispatcher.transform_txn(
            conn, org, request, view, m, current, activations=activations
        )

    key = RequestKey(
        DedupeScope(org), "CreateRecord", request_id, versioned_digest("test", [request_id])
    )
    return await w.records.mutate_once(
        org,
        view,
        mutation,
        actor=ACTOR,
        key=key,
        encode=lambda r: r.record.record_id.encode(),
        transform=transform,
        also=activations,
    )


def _fields(done: Deduplicated[MutationResult]) -> dict[str, Any]:
    assert done.value is not None
    return dict(done.value.record.fields)


async def test_the_activation_read_rides_on_the_ledger_lookup(
    engine: AsyncEngine, org: str
) -> None:
    w = await _world(engine, org, [read_flow(g) for g in GOLDEN])
    counts = {"txns": 0, "statements": 0}

    def on_begin(conn: Any) -> None:
        counts["txns"] += 1

    def on_statement(*args: Any) -> None:
        if not (isinstance(args[2], str) and args[2].startswith("BEGIN")):
            # A batched round trip of writes is several statements (services/db_batch.py).
            counts["statements"] += len(statements_of(str(args[2])))

    event.listen(engine.sync_engine, "begin", on_begin)
    event.listen(engine.sync_engine, "before_cursor_execute", on_statement)
    try:
        await _write_once(w, "warm")  # loads the immutable plan rows into the cache
        counts.update(txns=0, statements=0)
        done = await _write_once(w, f"r-{uuid.uuid4().hex}")
    finally:
        event.remove(engine.sync_engine, "begin", on_begin)
        event.remove(engine.sync_engine, "before_cursor_execute", on_statement)

    # The same cost as a bare deduplicated create: no statement of its own.
    assert (counts["txns"], counts["statements"]) == (1, CREATE_STATEMENTS)
    assert _fields(done) == {**_FIELDS, **_TRANSFORMED}
    assert w.dispatcher.ran >= 2


async def test_activation_changes_are_honored_on_the_next_write(
    engine: AsyncEngine, org: str
) -> None:
    w = await _world(engine, org, [read_flow(GOLDEN[0])])
    assert _fields(await _write_once(w, "before")) == {**_FIELDS, **_TRANSFORMED}

    # Deactivated (committed) before the next write, which the view still subscribes:
    # admission sees it at once and refuses the write closed; nothing is written.
    async with db.transaction(engine) as conn:
        [active] = await repo.active_activations_txn(conn, org)
        await repo.end_activation_txn(conn, active, repo.DEACTIVATED, await db.db_now(conn))
    with pytest.raises(FailedPreconditionError, match="has no active plan"):
        await _write_once(w, "deactivated")
    assert await w.count(records) == 1

    # Activated again: the next write runs it again.
    async with db.transaction(engine) as conn:
        values = {
            "activation_id": f"act-{uuid.uuid4().hex[:12]}",
            "state": repo.ACTIVE,
            "active_slot": 1,
            "state_version": 0,
        }
        stored = await _activation_values(conn, org, active.activation_id)
        assert await repo.insert_activation_txn(conn, {**stored, **values, "superseded_at": None})
    assert _fields(await _write_once(w, "reactivated")) == {**_FIELDS, **_TRANSFORMED}

    # A retry of a request replays its first answer; the transform does not run again.
    ran = w.dispatcher.ran
    replay = await _write_once(w, "before")
    assert replay.replayed and replay.value is None
    assert w.dispatcher.ran == ran


async def _activation_values(conn: AsyncConnection, org: str, activation_id: str) -> dict[str, Any]:
    """The stored activation row (a template for a new activation of the same plan)."""
    a = plan_activations.c
    row = (
        (
            await conn.execute(
                select(plan_activations).where(a.org_id == org, a.activation_id == activation_id)
            )
        )
        .mappings()
        .one()
    )
    return dict(row)
