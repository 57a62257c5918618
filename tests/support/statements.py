"""The SQL statements an engine sends while a block runs (tests that pin how many
statements — or which ones — a transition costs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from services.db import strategy_for
from services.db_batch import statements_of

__all__ = ["clock_reads", "watched_statements"]


@contextmanager
def watched_statements(engine: AsyncEngine) -> Iterator[list[str]]:
    """Every statement ``engine`` sends inside the block, whitespace collapsed."""
    seen: list[str] = []

    def on_statement(*args: Any) -> None:
        # A batched round trip of writes is several statements (services/db_batch.py).
        seen.extend(" ".join(part.split()) for part in statements_of(str(args[2])))

    sync = engine.sync_engine
    event.listen(sync, "before_cursor_execute", on_statement)
    try:
        yield seen
    finally:
        event.remove(sync, "before_cursor_execute", on_statement)


def clock_reads(engine: AsyncEngine, statements: list[str]) -> list[str]:
    """The statements that only read the database clock (``services.db.db_now``'s)."""
    now_sql = strategy_for(engine.dialect).now_sql
    return [s for s in statements if s == now_sql]
