"""A multi-table fenced UPDATE whose row count is neither all rows nor none (a backend
that counts rows otherwise than MariaDB/MySQL/TiDB) is refused, so the caller's
transaction rolls back instead of going on with half its rows written; and a backend
without multi-table UPDATE sends no combined statement at all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.records import store
from runtime_svc.schema import flow_runs, flow_step_executions
from services import db


class _Conn:
    """Answers every statement with ``rowcount`` and remembers what it was sent."""

    def __init__(self, dialect: Any, rowcount: int) -> None:
        self.dialect, self.rowcount = dialect, rowcount
        self.sent: list[list[str]] = []

    async def execute(self, stmt: Any, params: Any = None) -> Any:
        self.sent.append(str(stmt.compile(dialect=self.dialect)).split()[0:3])
        return SimpleNamespace(rowcount=self.rowcount)


def _writes() -> list[db.FencedWrite]:
    def write(table: Any, key: dict[str, str], version: int, state: dict[str, str]) -> Any:
        return db.FencedWrite(
            table, org_id="org", key=key, expected_version=version, values=state, equal={}
        )

    return [
        write(flow_runs, {"flow_run_id": "run"}, 3, {"runtime_state": "Running"}),
        write(flow_step_executions, {"step_execution_id": "step"}, 1, {"state": "Running"}),
    ]


async def test_a_partial_multi_table_row_count_is_refused() -> None:
    conn = _Conn(mysql.dialect(), rowcount=1)
    with pytest.raises(RuntimeError, match="matched 1 of 2 rows"):
        await db.fenced_updates(cast(AsyncConnection, conn), _writes())
    assert conn.sent == [["UPDATE", "flow_runs,", "flow_step_executions"]]


async def test_all_rows_matched_is_each_write_s_next_version() -> None:
    conn = _Conn(mysql.dialect(), rowcount=2)
    assert await db.fenced_updates(cast(AsyncConnection, conn), _writes()) == [4, 2]
    assert len(conn.sent) == 1


async def test_record_and_history_in_one_statement_partial_count_is_refused() -> None:
    with pytest.raises(RuntimeError, match="matched 1 of 2 rows"):
        store.advanced_together(1)
    assert store.advanced_together(2) is True
    assert store.advanced_together(0) is False


async def test_without_multi_table_update_nothing_is_sent_for_the_combined_write() -> None:
    conn = _Conn(sqlite.dialect(), rowcount=1)
    assert db.fenced_together(sqlite.dialect(), _writes()) is None
    assert await db.fenced_updates(cast(AsyncConnection, conn), _writes()) == [4, 2]
    assert [s[0] for s in conn.sent] == ["UPDATE", "UPDATE"]  # one by one
