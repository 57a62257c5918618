"""A Bounded Atomic step's read-modify-write must not lose a write committed between
the Flow's ``GetRecords`` current read and the step's record locks (§9.2: the whole Flow
is one logical mutation; §12.2: current reads, then locks, then writes).

MariaDB only (SQLite's ``BEGIN IMMEDIATE`` serialises every writer, so no other write can
commit inside that window). The window is opened deterministically: the step's record
reader is wrapped so that, right after the Flow read the line item, an ordinary record
write of that line item commits on another connection.

The step's update is compare-and-swapped against the version its own read observed
(``apply_intents_txn(observed=…)``), so the interleaved write is a conflict: the step rolls
back and retries whole from its input checkpoint, and its new read sees 100.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.records import RecordEngine, prepare_update
from runtime_svc.records.model import RecordState
from runtime_svc.records.store import read_record_txn
from runtime_svc.worker import loop
from tests.integration.atomic.support import (
    SEED_ACTOR,
    business_rows,
    evidence,
    make_runner,
    make_service,
    seed_atomic,
    seed_business,
)
from tests.integration.worker.support import record_view

pytestmark = pytest.mark.parametrize("kernel_db_url", ["mariadb"], indirect=True)


async def test_write_committed_after_the_flow_read_is_not_lost(
    engine: AsyncEngine, store: FlowRunStateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    view = record_view()
    ordinary = RecordEngine(engine)
    interleaved: list[int] = []

    async def read_then_interleave(
        conn: AsyncConnection, org_id: str, object_name: str, record_id: str, **kw: Any
    ) -> RecordState | None:
        state = await read_record_txn(conn, org_id, object_name, record_id, **kw)
        if object_name == "OpportunityLineItem" and not interleaved:
            # The Flow has read Quantity = 1 (version 1); another client now sets it to
            # 100 and commits before the step locks anything.
            result = await ordinary.mutate(
                org_id,
                view,
                prepare_update(view, object_name, record_id, None, {"Quantity": 100}),
                actor=SEED_ACTOR,
            )
            interleaved.append(result.record.version)
        return state

    monkeypatch.setattr(loop, "read_record_txn", read_then_interleave)
    runner = make_runner(engine, store)
    outcome = await make_service(engine, store, runner).start_run(
        seeded.scope, seeded.plan_id, {"oppId": biz.opp_id, "lineId": biz.line_id, "label": "r"}
    )
    assert interleaved == [2]
    assert outcome.view.run.state is RunState.SUCCEEDED
    [line] = (await business_rows(engine, seeded.org))["OpportunityLineItem"]
    # Either the step conflicted and was retried from its input checkpoint (its new read
    # sees 100), or it failed; it may never commit "1 + 1" over the committed 100.
    assert line["fields"]["Quantity"] == 101, (
        line,
        (await evidence(engine, seeded.org, outcome.view.run.flow_run_id)).attempts,
    )
