"""Record-condition waits and the ``record.change`` producer on SQLite and MariaDB
(§14.1 same-transaction signal, §14.2 (5) condition re-evaluated against the record,
§22.4 "producer is deleted while waiting")."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState, StepState
from runtime_svc.kernel.wait_model import DependencyState, SignalState
from runtime_svc.records.model import Actor
from runtime_svc.records.validation import prepare_delete
from tests.integration.waits.support import (
    World,
    record_flow,
    signals,
    step_states,
    task_subjects,
)
from tests.integration.worker.support import record_view


class _Statements:
    """Counts SQL statements that mention a table (a driver-level observation)."""

    def __init__(self, engine: AsyncEngine, table: str) -> None:
        self.count = 0
        self._table = table
        self._engine = engine.sync_engine

    def __enter__(self) -> _Statements:
        event.listen(self._engine, "before_cursor_execute", self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self._engine, "before_cursor_execute", self._on)

    def _on(self, _conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if self._table in statement:
            self.count += 1


async def test_record_condition_wait_resumes_when_the_record_matches(world: World) -> None:
    v = await world.create_case("case-1", status="New")
    await world.seed(record_flow())
    run = await world.start("wait_record", key="case-1")
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING
    dep = await world.dependency(run.flow_run_id)
    assert dep.producer_kind == "record.change" and dep.producer_key == "Case/case-1"

    # A change that does not satisfy the condition: signalled, evaluated, still waiting.
    v = await world.update_case("case-1", v, Status="Working")
    [sig] = await signals(world.engine, world.org)
    assert sig.wake_version == v and sig.wake_token == f"v{v}"
    assert sig.state is SignalState.UNMATCHED
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING

    # The closing write commits its signal with the record; the match after the commit
    # re-reads the record, evaluates the condition and resolves.
    v = await world.update_case("case-1", v, Status="Closed")
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED
    assert dep.wake_version == v
    assert dep.resolution_receipt is not None and f'"record_version":{v}' in dep.resolution_receipt
    consumed = [s for s in await signals(world.engine, world.org) if s.dependency_id]
    assert [s.wake_version for s in consumed] == [v]
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]


async def test_record_already_matching_when_the_wait_starts_resumes_at_once(world: World) -> None:
    await world.create_case("case-2", status="Closed")
    await world.seed(record_flow())
    run = await world.start("wait_record", key="case-2")
    await world.drive(run.flow_run_id)
    # No signal was ever written (nobody watched Case when it closed): the fresh
    # reconciliation read the record itself.
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED and dep.wake_signal_id is None
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED


async def test_only_watched_objects_pay_for_signals_and_the_memo_costs_no_query_per_write(
    world: World,
) -> None:
    v = await world.create_case("case-3")
    # No plan waits on Case: writes signal nothing.
    v = await world.update_case("case-3", v, Status="Working")
    assert await signals(world.engine, world.org) == []

    world.rt.watches._ttl = 60.0  # a long-lived memo, as in production
    await world.seed(record_flow())
    run = await world.start("wait_record", key="case-3")
    await world.drive(run.flow_run_id)  # the wait registers its watch of Case

    with _Statements(world.engine, "flow_record_watches") as reads:
        v = await world.update_case("case-3", v, Status="Again")  # reloads the memo once
        v = await world.update_case("case-3", v, Status="And again")
        v = await world.update_case("case-3", v, Status="Once more")
    assert reads.count == 1
    assert len(await signals(world.engine, world.org)) == 3


async def test_producer_deleted_while_waiting_applies_the_compiled_expiry_policy(
    world: World,
) -> None:
    v = await world.create_case("case-4")
    await world.seed(record_flow(expiry="fault_path", fault=True))
    run = await world.start("wait_record", key="case-4")
    await world.drive(run.flow_run_id)

    engine = await world.record_engine()
    view = record_view()
    await engine.mutate(
        world.org,
        view,
        prepare_delete(view, "Case", "case-4", v),
        actor=Actor("user", "tester"),
    )
    # The delete's signal fails the producer's existence check: the fault path runs.
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.EXPIRED
    assert dep.resolution_receipt is not None
    assert "dependency_producer_deleted" in dep.resolution_receipt
    assert await step_states(world.engine, world.org, run.flow_run_id) == {
        "pause": StepState.FAILED.code,
        "escalate": StepState.PENDING.code,
    }
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["escalated"]


async def test_record_waited_on_by_a_missing_record_fails_on_the_first_reconciliation(
    world: World,
) -> None:
    await world.seed(record_flow(expiry="terminal_failure"))
    run = await world.start("wait_record", key="no-such-case")
    done = await world.drive(run.flow_run_id)
    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "dependency_producer_deleted"


async def test_flow_record_writes_signal_too_and_a_concurrent_wait_in_another_run_wakes(
    world: World,
) -> None:
    # A waiting run, and a Flow step (not an API write) that closes the case.
    await world.create_case("case-5")
    await world.seed(record_flow())
    waiting = await world.start("wait_record", key="case-5")
    await world.drive(waiting.flow_run_id)
    closer = {
        "api_name": "close_case",
        "version": 1,
        "process_type": "autolaunched",
        "variables": [{"name": "key", "type": "string", "input": True}],
        "start": "fetch",
        "elements": [
            {
                "api_name": "fetch",
                "type": "GetRecords",
                "object": "Case",
                "filters": [{"field": "Id", "op": "=", "value": "key"}],
                "first_only": True,
                "output_variable": "c",
                "next": "close",
            },
            {
                "api_name": "close",
                "type": "UpdateRecord",
                "object": "Case",
                "record": "c",
                "fields": {"Status": "'Closed'"},
            },
        ],
    }
    closer["variables"].append({"name": "c", "type": "record", "object": "Case"})
    await world.seed(closer)
    run = await world.start("close_case", key="case-5")
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED
    assert (await world.dependency(waiting.flow_run_id)).state is DependencyState.RESOLVED
    assert (await world.drive(waiting.flow_run_id)).state is RunState.SUCCEEDED


async def test_an_idle_watch_is_dropped_only_once_no_record_wait_is_pending(
    world: World,
) -> None:
    from sqlalchemy import select

    from runtime_svc.schema import flow_record_watches
    from services import db

    async def watches() -> list[str]:
        w = flow_record_watches.c
        async with db.transaction(world.engine, readonly=True) as conn:
            rows = await conn.execute(select(w.object_name).where(w.org_id == world.org))
            return [str(r) for r in rows.scalars()]

    v = await world.create_case("case-6")
    await world.seed(record_flow(deadline="P7D"))
    run = await world.start("wait_record", key="case-6")
    await world.drive(run.flow_run_id)
    assert await watches() == ["Case"]

    world.clock.advance(hours=2)  # idle past the window, but a wait is pending
    await world.sweep()
    assert await watches() == ["Case"]

    v = await world.update_case("case-6", v, Status="Closed")  # resolves the wait
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.RESOLVED
    await world.sweep()
    assert await watches() == []
    # Nobody waits on Case any more: a write signals nothing.
    before = len(await signals(world.engine, world.org))
    await world.update_case("case-6", v, Status="Reopened")
    assert len(await signals(world.engine, world.org)) == before
