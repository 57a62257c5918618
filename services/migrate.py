"""Schema migrations: one Alembic environment per service, driven from code.

Each service package has ``<svc>/schema.py`` (the SQLAlchemy Core ``metadata``) and
``<svc>/migrations/`` (``env.py``, ``script.py.mako``, ``versions/``); no ``alembic.ini``.
This module runs Alembic on a connection of the service's async engine
(``connection.run_sync``), so SQLite gets the same ``BEGIN IMMEDIATE`` hooks as the
services and MySQL-family servers the same connect options::

    await upgrade(db_url, "runtime_svc")            # clean install or upgrade to head
    problems = await verify(db_url, "runtime_svc")  # [] when the live schema equals schema.py

and from the command line (``python -m <svc> db upgrade|verify|current``) through
:func:`main`. ``verify`` is the §20.2 "verify" step: it fails when the database is not at
the head revision or when Alembic's comparison (types and server defaults included) finds
any difference between the live schema and the models.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from alembic import command, context
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, Index, MetaData, Table
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.schema import ColumnCollectionConstraint
from sqlalchemy.types import TypeDecorator, TypeEngine

from services.config import ServiceName, load_config
from services.db import create_engine, strategy_for, transaction
from services.db_cluster import ClusterSettingsError, check_cluster
from services.db_profiles import ServerFlavor, flavor_of
from services.schema_lock import LOCK_TABLE, SchemaLockTimeoutError, schema_lock

__all__ = [
    "SERVICE_PACKAGES",
    "current",
    "downgrade",
    "heads",
    "main",
    "run_migrations",
    "upgrade",
    "verify",
]

#: Service package -> service, for reading the database URL from the configuration.
SERVICE_PACKAGES: dict[str, ServiceName] = {
    "catalog_svc": ServiceName.CATALOG,
    "runtime_svc": ServiceName.RUNTIME,
    "effect_owner_svc": ServiceName.EFFECT_OWNER,
}


def _include_name(name: str | None, type_: str, _parent: Any) -> bool:
    # The schema-upgrade lock's table (services.schema_lock) is not part of any schema.
    return not (type_ == "table" and name == LOCK_TABLE)


_COMPARE_OPTS: dict[str, Any] = {
    "compare_type": True,
    "compare_server_default": True,
    "include_name": _include_name,
}


def _package(service_pkg: str) -> str:
    if service_pkg not in SERVICE_PACKAGES:
        raise ValueError(f"unknown service package {service_pkg!r}")
    return service_pkg


def _config(service_pkg: str) -> Config:
    cfg = Config()
    # A filesystem path, not Alembic's "package:dir" form: that goes through
    # importlib.resources, which fails when the editable-install finder serves the
    # package as a namespace package.
    package_dir = Path(next(iter(importlib.import_module(_package(service_pkg)).__path__)))
    cfg.set_main_option("script_location", str(package_dir / "migrations"))
    cfg.set_main_option("path_separator", "os")
    return cfg


def _metadata(service_pkg: str) -> MetaData:
    metadata: MetaData = importlib.import_module(f"{_package(service_pkg)}.schema").metadata
    return metadata


def run_migrations(target_metadata: MetaData) -> None:
    """Body of every service's ``migrations/env.py``.

    Runs on the connection this module put into ``config.attributes``; a run through the
    bare ``alembic`` command line (which would open a connection without our engine hooks)
    is refused.
    """
    connection = context.config.attributes.get("connection")
    if not isinstance(connection, Connection):
        raise RuntimeError("run migrations through `python -m <service> db ...` (services.migrate)")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite DDL is transactional (pysqlite's own transaction handling is off), so a
        # failed upgrade leaves nothing half-done; MySQL commits each DDL statement.
        transactional_ddl=strategy_for(connection.dialect).transactional_ddl,
        **_COMPARE_OPTS,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_alembic(db_url: str, service_pkg: str, action: Callable[[Config], None]) -> None:
    cfg = _config(service_pkg)
    # Two connections: the migration's and the schema lock's lease renewal.
    engine = create_engine(db_url, pool_size=2)
    try:
        # A cluster node whose settings would break fencing gets no DDL either.
        await check_cluster(engine)
        if strategy_for(engine.dialect).transactional_ddl:
            lock: contextlib.AbstractAsyncContextManager[object] = contextlib.nullcontext()
        else:
            lock = schema_lock(engine, f"flow_migrate_{service_pkg}")
        async with lock, engine.connect() as conn:

            def _run(sync_conn: Connection) -> None:
                cfg.attributes["connection"] = sync_conn
                action(cfg)

            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


async def upgrade(db_url: str, service_pkg: str, revision: str = "head") -> None:
    """Upgrade the service's database to ``revision`` (clean install when empty).

    Upgrades of one database from several processes are serialised (a lock row that
    holds across every node of a cluster, :mod:`services.schema_lock`, on MySQL/MariaDB/
    TiDB; the single SQLite writer lock), and a database already at ``revision`` is left
    alone. A Galera node whose settings would break fencing is refused first
    (:func:`services.db_cluster.check_cluster`). Within one process run one Alembic
    command at a time: Alembic keeps its migration context in a process-global.
    """
    await _run_alembic(db_url, service_pkg, lambda cfg: command.upgrade(cfg, revision))


async def downgrade(db_url: str, service_pkg: str, revision: str) -> None:
    """Downgrade the service's database to ``revision`` (``"base"`` drops every table)."""
    await _run_alembic(db_url, service_pkg, lambda cfg: command.downgrade(cfg, revision))


def heads(service_pkg: str) -> list[str]:
    """The head revision(s) of ``service_pkg``'s migration scripts (one for a linear history)."""
    return sorted(ScriptDirectory.from_config(_config(service_pkg)).get_heads())


async def current(db_url: str, service_pkg: str) -> list[str]:
    """The revision(s) the database is at (empty before the first upgrade)."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with transaction(engine, readonly=True) as conn:
            return await conn.run_sync(
                lambda sync_conn: sorted(MigrationContext.configure(sync_conn).get_current_heads())
            )
    finally:
        await engine.dispose()


def _describe_item(item: Any) -> str | None:
    if isinstance(item, Table):
        return f"table {item.name}"
    if isinstance(item, Column):
        table = item.table.name if isinstance(item.table, Table) else "?"
        return f"column {table}.{item.name} {item.type!r}"
    if isinstance(item, Index | ColumnCollectionConstraint):
        table = item.table.name if isinstance(item.table, Table) else "?"
        columns = ", ".join(c.name for c in item.columns)
        return f"{type(item).__name__} {item.name} on {table}({columns})"
    if item is None or isinstance(item, dict):
        return None  # schema name / "existing_*" keywords: noise in a report
    return repr(item)


def _describe(diff: Any) -> str:
    """One line per Alembic difference tuple (or list of column-modification tuples)."""
    if isinstance(diff, list):
        return "; ".join(_describe(d) for d in diff)
    op, *items = diff
    parts = [p for p in (_describe_item(i) for i in items) if p is not None]
    return f"{op}: {' '.join(parts)}"


def _declared_charset(declared: TypeEngine[Any]) -> str | None:
    while isinstance(declared, TypeDecorator):
        declared = declared.impl_instance
    charset = getattr(declared, "charset", None)
    return charset if isinstance(charset, str) else None


def _charset_drift(conn: Connection, metadata: MetaData) -> list[str]:
    """Columns whose declared MySQL character set (``services.db.AsciiId``) the live
    column does not have — a difference Alembic's type comparison does not see. MariaDB
    and MySQL only: SQLite has none, and TiDB keeps ``utf8mb4`` ids (it cannot convert a
    column to ``ascii``; revision ``0015_ascii_ids`` of the runtime leaves it alone)."""
    if conn.dialect.name not in ("mysql", "mariadb"):
        return []
    version = str(conn.exec_driver_sql("SELECT VERSION()").scalar_one())
    if flavor_of(version) is ServerFlavor.TIDB:
        return []
    live = {
        (str(t), str(c)): str(cs)
        for t, c, cs in conn.exec_driver_sql(
            "SELECT table_name, column_name, character_set_name FROM information_schema.columns"
            " WHERE table_schema = DATABASE()"
        ).all()
    }
    problems = []
    for table in metadata.sorted_tables:
        for column in table.columns:
            wanted = _declared_charset(column.type.dialect_impl(conn.dialect))
            found = live.get((table.name, column.name))
            if wanted and found is not None and found != wanted:
                name = f"{table.name}.{column.name}"
                problems.append(f"modify_charset: column {name} is {found}, declared {wanted}")
    return problems


async def verify(db_url: str, service_pkg: str) -> list[str]:
    """Differences between the live database and the service's ``schema.py``.

    Returns:
        One line per problem: a revision other than head, then every difference Alembic's
        comparison finds (tables, columns, types, nullability, server defaults, indexes,
        unique and foreign keys), then every column whose declared MySQL character set the
        live column lacks. Empty when the schema is exactly as declared.
    """
    metadata = _metadata(service_pkg)
    expected_heads = heads(service_pkg)

    def _compare(sync_conn: Connection) -> list[str]:
        mc = MigrationContext.configure(sync_conn, opts=dict(_COMPARE_OPTS))
        at = sorted(mc.get_current_heads())
        problems = []
        if at != expected_heads:
            problems.append(f"database is at revision {at or 'none'}, head is {expected_heads}")
        problems.extend(_describe(d) for d in compare_metadata(mc, metadata))
        problems.extend(_charset_drift(sync_conn, metadata))
        return problems

    engine = create_engine(db_url, pool_size=1)
    try:
        async with transaction(engine, readonly=True) as conn:
            return await conn.run_sync(_compare)
    finally:
        await engine.dispose()


def main(argv: Sequence[str], service_pkg: str, db_url: str | None = None) -> int:
    """``db upgrade [--revision R] | verify | current`` for one service; returns the exit code.

    Args:
        argv: the arguments after ``db`` (e.g. ``["upgrade", "--revision", "0001"]``).
        service_pkg: ``catalog_svc``, ``runtime_svc`` or ``effect_owner_svc``.
        db_url: database URL; defaults to the service's configured URL.

    Exit codes: 0 success, 1 verify found differences or the database failed, 2 usage.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {service_pkg} db")
    actions = parser.add_subparsers(dest="action", required=True)
    up = actions.add_parser("upgrade", help="upgrade the schema (default: to head)")
    up.add_argument("--revision", default="head")
    actions.add_parser("verify", help="compare the live schema with the models; exit 1 on drift")
    actions.add_parser("current", help="print the current and head revisions")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    url = db_url if db_url is not None else load_config(SERVICE_PACKAGES[service_pkg]).db_url
    out = sys.stdout
    try:
        if args.action == "upgrade":
            asyncio.run(upgrade(url, service_pkg, args.revision))
            out.write(f"{service_pkg}: upgraded to {args.revision}\n")
            return 0
        if args.action == "current":
            at = asyncio.run(current(url, service_pkg))
            head = ", ".join(heads(service_pkg))
            out.write(f"{service_pkg}: at {', '.join(at) or 'none'} (head {head})\n")
            return 0
        problems = asyncio.run(verify(url, service_pkg))
    except DBAPIError as exc:
        sys.stderr.write(f"{service_pkg}: database error: {exc.orig or exc}\n")
        return 1
    except (ClusterSettingsError, SchemaLockTimeoutError) as exc:
        sys.stderr.write(f"{service_pkg}: refusing to migrate: {exc}\n")
        return 1
    if problems:
        out.write(f"{service_pkg}: schema differs from the models:\n")
        out.writelines(f"  {p}\n" for p in problems)
        return 1
    out.write(f"{service_pkg}: schema matches the models at head\n")
    return 0
