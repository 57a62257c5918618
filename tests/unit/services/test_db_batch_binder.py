"""``services.db_batch``'s parameter binder and typed rows, without a database: the
DBAPI parameters a batched statement gets from its binder (found once per compiled form)
are exactly what ``construct_params`` and the bind processors make — the path every
statement took before, and still takes when a bind's value is computed per execution —
and a batched read's rows are typed by each column's result processor."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    MetaData,
    String,
    Table,
    bindparam,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.mysql import asyncmy

from services import db
from services.db_batch import Read, Write, _bound, _compiled, _compiled_read, _typed

_md = MetaData()
_items = Table(
    "binder_items",
    _md,
    Column("org_id", String(db.ID_LEN), primary_key=True),
    Column("item_id", String(db.ID_LEN), primary_key=True),
    Column("kind", String(20), nullable=False),
    Column("state_version", BigInteger, nullable=False),
    Column("body", db.JsonText(256), nullable=True),
    Column("seen_at", db.UtcDateTime(), nullable=True),
)
_DIALECT = asyncmy.dialect()
_SEEN = datetime(2026, 12, 4, 12, 0, 0, 250000, tzinfo=UTC)


def _construct_params_path(write: Write) -> list[Any]:
    found = _compiled(_DIALECT, write)
    assert found is not None
    return _bound(write, dataclasses.replace(found, binder=None))


_FENCED = (
    update(_items)
    .where(
        _items.c.org_id == bindparam("org"),
        _items.c.item_id == bindparam("id"),
        _items.c.kind == "ledger",  # a bind with a fixed value
        _items.c.state_version == bindparam("expected"),
    )
    .values(state_version=bindparam("next"), seen_at=bindparam("at"), body=literal('{"x":1}'))
)
_CASES = [
    pytest.param(
        Write(
            insert(_items),
            {
                "org_id": "o",
                "item_id": "i1",
                "kind": "k",
                "state_version": 1,
                "body": '{"a": [1, 2]}',
                "seen_at": _SEEN,
            },
        ),
        id="insert-with-processors",
    ),
    pytest.param(
        Write(_FENCED, {"org": "o", "id": "i1", "expected": 3, "next": 4, "at": _SEEN}),
        id="update-with-fixed-binds",
    ),
    pytest.param(
        Write(
            update(_items)
            .where(_items.c.org_id == bindparam("org"), _items.c.item_id == bindparam("org"))
            .values(state_version=_items.c.state_version + 1),
            {"org": "o"},
        ),
        id="one-key-at-two-positions",
    ),
]


@pytest.mark.parametrize("write", _CASES)
def test_the_binder_binds_what_construct_params_and_the_processors_make(write: Write) -> None:
    found = _compiled(_DIALECT, write)
    assert found is not None and found.binder is not None
    assert _bound(write, found) == _construct_params_path(write)
    # Other values through the same compiled form (the binder is per shape, not per call).
    again = Write(write.statement, {k: _other(v) for k, v in write.params.items()})
    assert _compiled(_DIALECT, again) is found
    assert _bound(again, found) == _construct_params_path(again)


def _other(value: Any) -> Any:
    if isinstance(value, str):
        return '{"b": null}' if value.startswith("{") else value + "-2"
    if isinstance(value, int):
        return value + 10
    if isinstance(value, datetime):
        return value.replace(microsecond=1)
    return value


def test_the_fixed_value_of_a_bind_is_taken_from_the_statement() -> None:
    write = Write(_FENCED, {"org": "o", "id": "i1", "expected": 3, "next": 4, "at": None})
    found = _compiled(_DIALECT, write)
    assert found is not None and found.binder is not None
    bound = _bound(write, found)
    assert "ledger" in bound and '{"x":1}' in bound


def test_a_bind_computed_per_execution_goes_through_construct_params() -> None:
    counter = itertools.count(1)
    stmt = (
        update(_items)
        .where(_items.c.item_id == bindparam("id"))
        .values(state_version=bindparam("version", callable_=lambda: next(counter)))
    )
    write = Write(stmt, {"id": "i1"})
    found = _compiled(_DIALECT, write)
    assert found is not None and found.binder is None
    assert _bound(write, found)[0] == 1
    assert _bound(write, found)[0] == 2  # computed again, never frozen by a binder


def test_a_required_bind_without_a_value_still_fails_at_execution() -> None:
    stmt = update(_items).where(_items.c.item_id == bindparam("id", required=True))
    write = Write(stmt.values(kind=bindparam("kind")), {"kind": "k"})
    found = _compiled(_DIALECT, write)
    assert found is not None and found.binder is None
    with pytest.raises(Exception, match="id"):
        _bound(write, found)


def test_batched_rows_are_typed_per_column_and_read_by_key() -> None:
    read = Read(
        select(_items.c.item_id, _items.c.state_version, _items.c.seen_at, _items.c.body).where(
            _items.c.org_id == bindparam("org")
        ),
        {"org": "o"},
    )
    compiled = _compiled_read(_DIALECT, read)
    assert compiled is not None
    # The driver's description: (name, type code, …); 253 VARCHAR, 8 BIGINT, 12 DATETIME.
    description = [("item_id", 253), ("state_version", 8), ("seen_at", 12), ("body", 252)]
    raw = [("i1", 3, _SEEN.replace(tzinfo=None), '{"a": 1}'), ("i2", 4, None, None)]
    rows = _typed(_DIALECT, compiled, description, raw)
    assert rows[0].seen_at == _SEEN and rows[0].seen_at.tzinfo is UTC  # UtcDateTime
    assert rows[1].seen_at is None and rows[1][0] == "i2" and rows[1].state_version == 4
    assert tuple(rows[0]) == ("i1", 3, _SEEN, '{"a": 1}')
    assert _typed(_DIALECT, compiled, description, []) == []
