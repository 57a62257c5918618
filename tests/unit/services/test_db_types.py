"""``services.db.UtcDateTime`` binds and reads (no server): aware UTC in Python, naive
UTC in the column, a naive value refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy.dialects import mysql, sqlite

from services.db import UtcDateTime

DIALECTS = [sqlite.dialect(), mysql.dialect()]


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: str(d.name))
def test_an_aware_time_binds_as_naive_utc_whatever_its_zone(dialect: object) -> None:
    column = UtcDateTime()
    instant = datetime(2026, 12, 2, 17, 30, 0, 123456, tzinfo=UTC)
    expected = datetime(2026, 12, 2, 17, 30, 0, 123456)
    plus_two = instant.astimezone(timezone(timedelta(hours=2)))
    zero_offset = instant.replace(tzinfo=timezone(timedelta(0), "Z"))  # not the UTC object
    for value in (instant, plus_two, zero_offset):
        bound = column.process_bind_param(value, dialect)  # type: ignore[arg-type]
        assert bound == expected
        assert bound is not None and bound.tzinfo is None
    assert column.process_bind_param(None, dialect) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: str(d.name))
def test_a_naive_time_is_refused_and_a_read_comes_back_aware(dialect: object) -> None:
    column = UtcDateTime()
    with pytest.raises(ValueError, match="naive datetime"):
        column.process_bind_param(datetime(2026, 1, 1), dialect)  # type: ignore[arg-type]
    read = column.process_result_value(datetime(2026, 1, 1, 8), dialect)  # type: ignore[arg-type]
    assert read == datetime(2026, 1, 1, 8, tzinfo=UTC)
