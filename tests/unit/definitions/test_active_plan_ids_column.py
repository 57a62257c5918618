"""The activation read a before-save write's ledger lookup makes
(``repository.active_plan_ids_column``) decodes to exactly what the statement of its own
returned (``active_plan_ids_txn``): ``(name, version id, plan id)`` by Flow name; no
active activation is ``[]`` (MariaDB aggregates no row to NULL, SQLite to ``[]``); a
value that is not the column's JSON fails loudly instead of admitting nothing."""

from __future__ import annotations

import pytest
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.engine import Dialect

from runtime_svc.definitions import repository as repo


def test_rows_decode_by_flow_name_with_a_missing_plan_as_none() -> None:
    raw = '[["Zeta", "fv-2", "plan-2"], ["Alpha", "fv-1", null]]'
    assert repo.parse_active_plan_ids(raw) == [("Alpha", "fv-1", None), ("Zeta", "fv-2", "plan-2")]
    assert repo.parse_active_plan_ids(raw.encode()) == repo.parse_active_plan_ids(raw)


def test_a_decoded_value_is_reused_and_never_shared_with_a_caller() -> None:
    raw = '[["Beta", "fv-3", "plan-3"]]'
    first = repo.parse_active_plan_ids(raw)
    first.append(("Mutated", "by", "a caller"))
    assert repo.parse_active_plan_ids(raw) == [("Beta", "fv-3", "plan-3")]
    # An already decoded column (a driver that decodes JSON) is read as it is.
    assert repo.parse_active_plan_ids([["Beta", "fv-3", "plan-3"]]) == [("Beta", "fv-3", "plan-3")]
    with pytest.raises(ValueError, match="active plan ids"):
        repo.parse_active_plan_ids({"not": "a list"})


@pytest.mark.parametrize("empty", [None, "[]"])
def test_no_active_activation_is_no_row(empty: str | None) -> None:
    assert repo.parse_active_plan_ids(empty) == []


@pytest.mark.parametrize("bad", ['{"a": 1}', '[["Alpha", "fv-1"]]', '["Alpha"]'])
def test_anything_else_is_refused(bad: str) -> None:
    for _ in range(2):  # a refused value is refused every time (nothing of it is kept)
        with pytest.raises(ValueError, match="active plan ids"):
            repo.parse_active_plan_ids(bad)


@pytest.mark.parametrize(
    ("dialect", "aggregate"),
    [(sqlite.dialect(), "json_group_array"), (mysql.dialect(), "json_arrayagg")],
)
def test_the_column_aggregates_the_same_predicate_per_dialect(
    dialect: Dialect, aggregate: str
) -> None:
    column = repo.active_plan_ids_column(dialect, 2)
    sql = str(column.compile(dialect=dialect)).lower()
    assert aggregate in sql and "json_array(" in sql
    for predicate in ("org_id", "app_installation_id", "runtime_capability_id", "active_slot"):
        assert predicate in sql
    assert "flow_api_name in" in sql
    # One bound parameter per distinct name (no expanding IN rendered at each execution).
    assert "postcompile" not in sql
    params = repo.active_plan_ids_params("org-1", "inst", "cap", ["B", "A", "B"])
    assert params == {
        "ap_org": "org-1",
        "ap_installation": "inst",
        "ap_capability": "cap",
        "ap_name_0": "A",
        "ap_name_1": "B",
    }
    assert set(column.compile(dialect=dialect).params) >= {"ap_name_0", "ap_name_1"}


def test_a_read_names_at_least_one_flow() -> None:
    with pytest.raises(ValueError, match="at least one Flow"):
        repo.active_plan_ids_column(sqlite.dialect(), 0)
