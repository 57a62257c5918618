"""The MySQL-protocol *cluster* profile: what the services need from a MariaDB Galera
cluster, applied per connection and checked at start-up.

Galera (synchronous multi-master, Debian's ``mariadb-server`` + ``galera-4``) breaks the
single-server assumptions the way any distributed MySQL-protocol engine does
(``docs/scale-out.md``):

* **row locks are node-local** — two sessions on two nodes both get ``SELECT … FOR
  UPDATE`` on one row and both conditional ``UPDATE … WHERE state_version = ?`` report
  row count 1; the first ``COMMIT`` wins and the second fails with 1213 (certification
  failure, a *definite* rollback). A fence is therefore won only when its ``COMMIT``
  succeeds; :func:`services.db.transaction` treats a 1213 at ``COMMIT`` as a proven
  rollback (retried whole) and any other ``COMMIT`` failure as commit-unknown;
* **reads may lag** — a node applies other nodes' write-sets asynchronously, so a read
  right after a commit elsewhere can miss it. :data:`SESSION_SETTINGS` turns on causal
  reads (``wsrep_sync_wait`` READ bit) on every connection: a statement that reads first
  waits until the node has applied everything committed in the cluster before it began.
  Claim revalidation, lease recovery, the commit-unknown marker read and read-your-writes
  across replicas (a run started through one node, read or continued through another)
  rely on it. Writes need no extra bit: a write on a stale row conflicts at certification;
* **``GET_LOCK`` is node-local** — the schema-migration lock is a row
  (:mod:`services.schema_lock`), not a named lock;
* **DDL** must run in total order (``wsrep_OSU_method=TOI``, set per session).

Two entry points, one per concern:

* :func:`install_session_hooks` — registered on every MySQL-family engine by
  :mod:`services.db`; on a new connection it asks the server whether it is a Galera
  node (``SHOW VARIABLES LIKE 'wsrep_on'``, which every MySQL-protocol server answers)
  and, when it is, applies :data:`SESSION_SETTINGS`. Other servers get nothing.
* :func:`check_cluster` — called once at start-up (``services.service_main``, ``db
  upgrade``): reads the node's settings and raises :class:`ClusterSettingsError` naming
  every setting that would break fencing (:func:`galera_problems`, pure). Non-Galera
  servers return ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "REQUIRED_COMMIT_ORDER",
    "SESSION_SETTINGS",
    "SYNC_WAIT_READ",
    "ClusterProfile",
    "ClusterSettingsError",
    "SettingProblem",
    "check_cluster",
    "galera_problems",
    "install_session_hooks",
    "parse_provider_options",
]

log = logging.getLogger(__name__)

#: ``wsrep_sync_wait`` bit for reads (SELECT, SHOW, BEGIN): causal reads.
SYNC_WAIT_READ = 1
#: Galera's ``repl.commit_order`` that keeps commits in certification order on every
#: node (3 = NO_OOOC, the default). Out-of-order commit would let a node expose a later
#: write-set before an earlier one, so a causal read could see a fence's successor
#: without the fence.
REQUIRED_COMMIT_ORDER = "3"

#: Applied to every new connection to a Galera node (see the module docstring). The READ
#: bit is OR-ed into whatever the global value asks for, never narrowing it.
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (
    ("wsrep_sync_wait", f"@@global.wsrep_sync_wait | {SYNC_WAIT_READ}"),
    ("wsrep_OSU_method", "'TOI'"),
    ("wsrep_dirty_reads", "OFF"),
)

_GLOBAL_VARIABLES = (
    "wsrep_on",
    "wsrep_provider",
    "wsrep_provider_options",
    "binlog_format",
    "wsrep_forced_binlog_format",
    "wsrep_desync",
    "innodb_autoinc_lock_mode",
)
_STATUS = ("wsrep_ready", "wsrep_cluster_status", "wsrep_cluster_size", "wsrep_connected")


class ClusterSettingsError(RuntimeError):
    """The database is a cluster node whose settings would break fencing; the service
    refuses to start. ``problems`` names each offending setting."""

    def __init__(self, problems: list[SettingProblem]) -> None:
        self.problems = problems
        super().__init__(
            "the database cluster's settings would break fencing: "
            + "; ".join(f"{p.setting}: {p.message}" for p in problems)
        )


@dataclass(frozen=True)
class SettingProblem:
    """One setting that breaks (``fatal``) or weakens the cluster profile."""

    setting: str
    message: str
    fatal: bool = True


@dataclass(frozen=True)
class ClusterProfile:
    """What :func:`check_cluster` found on a Galera node."""

    cluster_size: int
    provider_options: Mapping[str, str]
    session: Mapping[str, str]
    warnings: tuple[SettingProblem, ...] = ()


def parse_provider_options(raw: str) -> dict[str, str]:
    """``wsrep_provider_options`` (``"a = 1; b = x; …"``) as a dict."""
    out: dict[str, str] = {}
    for part in raw.split(";"):
        name, sep, value = part.partition("=")
        if sep:
            out[name.strip()] = value.strip()
    return out


def _is_on(value: str | None) -> bool:
    return (value or "").strip().upper() in ("ON", "1", "TRUE")


def galera_problems(
    variables: Mapping[str, str], status: Mapping[str, str], session: Mapping[str, str]
) -> list[SettingProblem]:
    """Every setting of a Galera node that breaks or weakens fencing (pure).

    Args:
        variables: global variables (lower-case names, see ``_GLOBAL_VARIABLES``).
        status: ``wsrep_*`` status values.
        session: the effective session values after :data:`SESSION_SETTINGS`
            (``wsrep_sync_wait``, ``wsrep_osu_method``, ``wsrep_dirty_reads``).

    Returns:
        Problems in a stable order; ``fatal`` ones make :func:`check_cluster` refuse.
    """
    problems: list[SettingProblem] = []
    if not _is_on(variables.get("wsrep_on")):
        problems.append(
            SettingProblem(
                "wsrep_on",
                "OFF on a node with a Galera provider: its writes are not replicated, so "
                "other nodes never see this node's fences",
            )
        )
    if not _is_on(status.get("wsrep_ready")) or status.get("wsrep_cluster_status") != "Primary":
        problems.append(
            SettingProblem(
                "wsrep_cluster_status",
                f"node is {status.get('wsrep_cluster_status', '?')} / wsrep_ready="
                f"{status.get('wsrep_ready', '?')}: not part of the primary component",
            )
        )
    binlog = (variables.get("binlog_format") or "").upper()
    forced = (variables.get("wsrep_forced_binlog_format") or "NONE").upper()
    if binlog != "ROW" and forced != "ROW":
        problems.append(
            SettingProblem(
                "binlog_format",
                f"{binlog or '?'}: Galera replicates row events; set binlog_format=ROW",
            )
        )
    order = parse_provider_options(variables.get("wsrep_provider_options", "")).get(
        "repl.commit_order"
    )
    if order is not None and order != REQUIRED_COMMIT_ORDER:
        problems.append(
            SettingProblem(
                "wsrep_provider_options repl.commit_order",
                f"{order}: commits out of certification order let a causal read see a "
                f"transition without the fence before it; set repl.commit_order="
                f"{REQUIRED_COMMIT_ORDER}",
            )
        )
    try:
        sync_wait = int(session.get("wsrep_sync_wait", "0"))
    except ValueError:
        sync_wait = 0
    if not sync_wait & SYNC_WAIT_READ:
        problems.append(
            SettingProblem(
                "wsrep_sync_wait",
                f"session value {session.get('wsrep_sync_wait', '?')} lacks the READ bit "
                "(1): reads may miss commits of other nodes (a proxy that drops session "
                "SETs has this effect)",
            )
        )
    if (session.get("wsrep_osu_method") or "").upper() != "TOI":
        problems.append(
            SettingProblem(
                "wsrep_OSU_method",
                f"session value {session.get('wsrep_osu_method', '?')}: schema changes must "
                "run in total order (TOI) on every node",
            )
        )
    if _is_on(session.get("wsrep_dirty_reads")):
        problems.append(
            SettingProblem(
                "wsrep_dirty_reads",
                "ON: a node outside the primary component would answer reads with stale rows",
            )
        )
    if _is_on(variables.get("wsrep_desync")):
        problems.append(
            SettingProblem(
                "wsrep_desync",
                "ON: the node may lag without flow control; causal reads wait for it",
                fatal=False,
            )
        )
    if variables.get("innodb_autoinc_lock_mode", "2") != "2":
        problems.append(
            SettingProblem(
                "innodb_autoinc_lock_mode",
                "Galera expects 2 (interleaved); the services use no AUTO_INCREMENT ordering",
                fatal=False,
            )
        )
    size = status.get("wsrep_cluster_size", "0")
    if size.isdigit() and 0 < int(size) < 3:
        problems.append(
            SettingProblem(
                "wsrep_cluster_size",
                f"{size}: fewer than three nodes cannot keep a primary component after "
                "one node is lost",
                fatal=False,
            )
        )
    return problems


# --- per-connection settings ---------------------------------------------------------


def _is_galera(cursor: Any) -> bool:
    cursor.execute("SHOW VARIABLES LIKE 'wsrep_on'")
    row = cursor.fetchone()
    return row is not None and _is_on(str(row[1]))


def install_session_hooks(engine: Engine) -> None:
    """Apply :data:`SESSION_SETTINGS` to every new connection of ``engine`` that reaches a
    Galera node (no-op on other MySQL-protocol servers)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            if _is_galera(cursor):
                assignments = ", ".join(f"SESSION {k} = {v}" for k, v in SESSION_SETTINGS)
                cursor.execute(f"SET {assignments}")
        finally:
            cursor.close()
        # The driver opened an implicit transaction with the SHOW: end it before the pool
        # hands the connection out.
        dbapi_connection.commit()


# --- start-up check ----------------------------------------------------------------------


async def check_cluster(engine: AsyncEngine) -> ClusterProfile | None:
    """Read a Galera node's settings through ``engine`` and refuse unsafe ones.

    Returns:
        ``None`` when the server is not a Galera node (SQLite, MariaDB/MySQL without
        wsrep, TiDB); the profile otherwise (non-fatal findings are logged and kept in
        ``warnings``).

    Raises:
        ClusterSettingsError: at least one fatal problem (:func:`galera_problems`).
    """
    if engine.dialect.name not in ("mysql", "mariadb"):
        return None
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SHOW VARIABLES LIKE 'wsrep_%'"))).all()
        found = {str(k).lower(): str(v) for k, v in rows}
        provider = found.get("wsrep_provider", "none")
        if not provider or provider.lower() == "none":
            await conn.rollback()
            return None
        names = ", ".join(f"'{n}'" for n in _GLOBAL_VARIABLES)
        rows = (
            await conn.execute(text(f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({names})"))
        ).all()
        variables = {str(k).lower(): str(v) for k, v in rows}
        names = ", ".join(f"'{n}'" for n in _STATUS)
        rows = (
            await conn.execute(text(f"SHOW GLOBAL STATUS WHERE Variable_name IN ({names})"))
        ).all()
        status = {str(k).lower(): str(v) for k, v in rows}
        row = (
            await conn.execute(
                text(
                    "SELECT @@session.wsrep_sync_wait, @@session.wsrep_OSU_method, "
                    "@@session.wsrep_dirty_reads"
                )
            )
        ).one()
        await conn.rollback()
    session = {
        "wsrep_sync_wait": str(row[0]),
        "wsrep_osu_method": str(row[1]),
        "wsrep_dirty_reads": "ON" if str(row[2]) in ("1", "ON") else "OFF",
    }
    problems = galera_problems(variables, status, session)
    fatal = [p for p in problems if p.fatal]
    if fatal:
        raise ClusterSettingsError(fatal)
    warnings = tuple(p for p in problems if not p.fatal)
    for warning in warnings:
        log.warning("database cluster setting %s: %s", warning.setting, warning.message)
    size = status.get("wsrep_cluster_size", "0")
    return ClusterProfile(
        cluster_size=int(size) if size.isdigit() else 0,
        provider_options=parse_provider_options(variables.get("wsrep_provider_options", "")),
        session=session,
        warnings=warnings,
    )
