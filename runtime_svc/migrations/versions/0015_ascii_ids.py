"""Run, step, attempt, checkpoint and record identifiers and object API names become
``ascii``/``ascii_bin`` columns on MariaDB and MySQL (ADR 0015).

Why: a primary key of ``org_id`` (``utf8mb4``, 258 bytes) and one ``utf8mb4`` id (258
bytes) is 516 bytes; above 512 MariaDB's multi-table ``UPDATE`` (the fenced step commit of
ADR 0009 and the record + history advance) keeps the row ids of every table it does not
update on the fly in an **on-disk** temporary table — two of them per step commit, one per
record update, measured at ≈ 0.25 ms of server time each. These values are ASCII by
construction (``run_<hex>``-style ids, ``RECORD_ID_RE``, the catalog's object-name rule), so
storing them as ``ascii`` (1 byte per character) brings those keys to 324-390 bytes and the
temporary tables into memory. Comparison stays byte-for-byte (``ascii_bin`` like
``utf8mb4_bin``).

How, on MariaDB/MySQL (SQLite stores text as before; TiDB cannot convert a ``utf8mb4``
column to ``ascii`` and has no such temporary table, so it is left as it is):

1. every converted column is checked for a non-ASCII value **before any DDL** (MySQL DDL
   is not transactional: a failure half-way would leave foreign keys dropped); one found
   stops the migration with the table, column and row count, nothing changed;
2. the seven foreign keys over converted columns are dropped (MariaDB refuses to change a
   character set under a foreign key, even with ``foreign_key_checks=0``);
3. each table's columns are modified in one ``ALTER TABLE`` (a table copy: time grows with
   the table — run it in a maintenance window on a large deployment);
4. the foreign keys are added back, exactly as they were.

Each step looks at ``information_schema`` first, so a migration interrupted half-way (a
killed process, a lost connection) completes when it is run again. ``downgrade`` converts
the same columns back to the tables' ``utf8mb4``/``utf8mb4_bin``.

Revision ID: 0015_ascii_ids
Revises: 0014_run_subject
"""

from __future__ import annotations

from collections.abc import Mapping

from alembic import op
from sqlalchemy.engine import Connection

revision = "0015_ascii_ids"
down_revision = "0014_run_subject"
branch_labels = None
depends_on = None

_LEN = 64

#: table -> (column, nullable) converted, as declared at revision 0014.
COLUMNS: Mapping[str, tuple[tuple[str, bool], ...]] = {
    "audit_records": (
        ("object_name", True),
        ("record_id", True),
        ("flow_run_id", True),
        ("step_execution_id", True),
        ("attempt_id", True),
    ),
    "business_events": (
        ("object_name", False),
        ("record_id", False),
        ("flow_run_id", True),
        ("step_execution_id", True),
        ("attempt_id", True),
    ),
    "flow_checkpoints": (
        ("checkpoint_id", False),
        ("flow_run_id", False),
        ("created_by_attempt_id", True),
    ),
    "flow_dependencies": (("flow_run_id", False), ("step_execution_id", False)),
    "flow_effect_links": (
        ("flow_run_id", False),
        ("step_execution_id", False),
        ("submission_attempt_id", False),
    ),
    "flow_record_watches": (("object_name", False),),
    "flow_run_slots": (("flow_run_id", False),),
    "flow_runs": (
        ("flow_run_id", False),
        ("current_step_execution_id", True),
        ("current_checkpoint_id", True),
    ),
    "flow_step_attempts": (("attempt_id", False), ("step_execution_id", False)),
    "flow_step_executions": (
        ("step_execution_id", False),
        ("flow_run_id", False),
        ("input_checkpoint_id", True),
        ("output_checkpoint_id", True),
    ),
    "record_history_sequences": (("object_name", False), ("record_id", False)),
    "records": (
        ("object_name", False),
        ("record_id", False),
        ("parent_object_name", True),
        ("parent_record_id", True),
    ),
    "runtime_outbox": (
        ("flow_run_id", True),
        ("step_execution_id", True),
        ("submission_attempt_id", True),
    ),
}

#: The foreign keys over converted columns: name -> (table, columns, referred table).
#: Each refers to the same column names in the referred table (ON DELETE/UPDATE RESTRICT,
#: the default, as revision 0001 and 0005 created them).
FOREIGN_KEYS: Mapping[str, tuple[str, tuple[str, ...], str]] = {
    "fk_business_events_records": (
        "business_events",
        ("org_id", "object_name", "record_id"),
        "records",
    ),
    "fk_flow_checkpoints_flow_runs": ("flow_checkpoints", ("org_id", "flow_run_id"), "flow_runs"),
    "fk_flow_dependencies_flow_step_executions": (
        "flow_dependencies",
        ("org_id", "step_execution_id"),
        "flow_step_executions",
    ),
    "fk_flow_effect_links_flow_runs": (
        "flow_effect_links",
        ("org_id", "flow_run_id"),
        "flow_runs",
    ),
    "fk_flow_step_attempts_flow_step_executions": (
        "flow_step_attempts",
        ("org_id", "step_execution_id"),
        "flow_step_executions",
    ),
    "fk_flow_step_executions_flow_runs": (
        "flow_step_executions",
        ("org_id", "flow_run_id"),
        "flow_runs",
    ),
    "fk_record_history_sequences_records": (
        "record_history_sequences",
        ("org_id", "object_name", "record_id"),
        "records",
    ),
}

#: The column specification of each character set the revision converts to.
_SPEC = {
    "ascii": "CHARACTER SET ascii COLLATE ascii_bin",
    "utf8mb4": "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
}


class NonAsciiIdentifierError(RuntimeError):
    """A value to be converted is not ASCII: nothing was changed."""


def _applies(conn: Connection) -> bool:
    if conn.dialect.name not in ("mysql", "mariadb"):
        return False
    version = str(conn.exec_driver_sql("SELECT VERSION()").scalar_one())
    return "tidb" not in version.lower()


def _charsets(conn: Connection) -> dict[tuple[str, str], str]:
    rows = conn.exec_driver_sql(
        "SELECT table_name, column_name, character_set_name FROM information_schema.columns"
        " WHERE table_schema = DATABASE()"
    ).all()
    return {(str(t), str(c)): str(cs) for t, c, cs in rows}


def _foreign_keys(conn: Connection) -> set[str]:
    rows = conn.exec_driver_sql(
        "SELECT constraint_name FROM information_schema.referential_constraints"
        " WHERE constraint_schema = DATABASE()"
    ).all()
    return {str(r[0]) for r in rows}


def _refuse_non_ascii(conn: Connection) -> None:
    found = []
    for table, columns in COLUMNS.items():
        # A value with a character outside ASCII differs, byte for byte, from its ASCII
        # conversion (which turns that character into '?'). One scan per table.
        checks = ", ".join(
            f"COALESCE(SUM(CAST({c} AS BINARY) <> CAST(CONVERT({c} USING ascii) AS BINARY)), 0)"
            for c, _ in columns
        )
        sql = f"SELECT {checks} FROM {table}"  # noqa: S608 - names from COLUMNS, no input
        counts = conn.exec_driver_sql(sql).one()
        found += [
            f"{table}.{c}: {int(n)} row(s)" for (c, _), n in zip(columns, counts, strict=True) if n
        ]
    if found:
        raise NonAsciiIdentifierError(
            "identifiers to be stored as ASCII hold non-ASCII values; nothing was changed: "
            + "; ".join(found)
        )


def _convert(charset: str) -> None:
    conn = op.get_bind()
    if not _applies(conn):
        return
    if charset == "ascii":
        _refuse_non_ascii(conn)
    present = _foreign_keys(conn)
    for name, (table, _, _) in FOREIGN_KEYS.items():
        if name in present:
            conn.exec_driver_sql(f"ALTER TABLE {table} DROP FOREIGN KEY {name}")
    current = _charsets(conn)
    for table, columns in COLUMNS.items():
        todo = [(c, n) for c, n in columns if current.get((table, c)) != charset]
        if todo:
            conn.exec_driver_sql(
                f"ALTER TABLE {table} "
                + ", ".join(
                    f"MODIFY {c} VARCHAR({_LEN}) {_SPEC[charset]} {'NULL' if n else 'NOT NULL'}"
                    for c, n in todo
                )
            )
    present = _foreign_keys(conn)
    for name, (table, key, referred) in FOREIGN_KEYS.items():
        if name not in present:
            keys = ", ".join(key)
            conn.exec_driver_sql(
                f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({keys})"
                f" REFERENCES {referred} ({keys})"
            )


def upgrade() -> None:
    _convert("ascii")


def downgrade() -> None:
    _convert("utf8mb4")
