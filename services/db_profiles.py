"""Database profiles: the server settings the fencing kernel relies on, checked at start-up.

The SQL rules of ARCHITECTURE §2 hold only when the MySQL-protocol server behaves the
way :mod:`services.db` assumes. A server configured differently does not fail loudly;
it silently breaks a fence (a truncated digest that no longer matches, a transaction
the server retried behind our back, a duplicate key reported at COMMIT instead of at
the INSERT that should have lost the race). So every service checks its database when
it starts and refuses to serve against a server whose settings would break those
assumptions, naming the setting, what was found and what is needed.

The check is a small list of :class:`SettingRule` values (:data:`RULES`). Each rule
names the flavours it applies to, the variables it needs and a pure ``check`` function
over a :class:`ServerSettings` snapshot, so the rules are unit-tested without a server
and a new rule (for example the Galera checks of a clustered profile) is one more entry
in the list::

    settings = await read_settings(conn)          # SHOW VARIABLES on a service connection
    problems = check_settings(settings)           # [] when the server is fit
    await verify_database(engine)                 # both; raises UnsafeDatabaseSettingsError

Profiles (``docs/database-profiles.md`` documents them for operators):

* **MariaDB 10.6+ / MySQL 8.0+**: READ COMMITTED on every service connection, autocommit
  off (explicit transactions only), a short ``innodb_lock_wait_timeout``, strict SQL
  mode without engine substitution, row-based binary logging when binary logging is on,
  a writable primary, packets large enough for the largest JSON column.
* **TiDB 6.5+**: the same, plus pessimistic transactions, transaction auto-retry off
  and unique constraints checked in place (at the INSERT, not at COMMIT).

The settings are read through a connection of the service's own engine, after its
connect options ran, so what is checked is what the kernel's transactions will see.
SQLite needs no check: its locking is set by :mod:`services.db` on every connection.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.db import LOCK_WAIT_TIMEOUT_S

__all__ = [
    "MAX_LOCK_WAIT_TIMEOUT_S",
    "MIN_MAX_ALLOWED_PACKET",
    "MIN_VERSIONS",
    "RULES",
    "ServerFlavor",
    "ServerSettings",
    "SettingProblem",
    "SettingRule",
    "UnsafeDatabaseSettingsError",
    "check_settings",
    "flavor_of",
    "read_settings",
    "verify_database",
]


class ServerFlavor(enum.Enum):
    """The MySQL-protocol servers the services run on."""

    MARIADB = "MariaDB"
    MYSQL = "MySQL"
    TIDB = "TiDB"


#: Oldest supported release of each flavour (major, minor).
MIN_VERSIONS: Mapping[ServerFlavor, tuple[int, int]] = {
    ServerFlavor.MARIADB: (10, 6),
    ServerFlavor.MYSQL: (8, 0),
    # tidb_constraint_check_in_place_pessimistic exists from 6.3; 6.5 is the LTS after it.
    ServerFlavor.TIDB: (6, 5),
}

#: The largest JSON column is a plan payload of 4 MiB (``runtime_svc.schema``); one
#: statement carries it plus the other columns, so a packet must hold at least twice that.
MIN_MAX_ALLOWED_PACKET = 8 * 1024 * 1024

#: A row-lock wait longer than this holds a worker and a pooled connection far past any
#: step budget; the kernel sets :data:`services.db.LOCK_WAIT_TIMEOUT_S` on connect.
MAX_LOCK_WAIT_TIMEOUT_S = 60

_ALL = frozenset(ServerFlavor)
_INNODB = frozenset({ServerFlavor.MARIADB, ServerFlavor.MYSQL})
_TIDB = frozenset({ServerFlavor.TIDB})


@dataclass(frozen=True)
class ServerSettings:
    """What one service connection sees of its server.

    Attributes:
        version: ``SELECT VERSION()`` (``10.11.6-MariaDB``, ``8.0.36``,
            ``8.0.11-TiDB-v7.5.1``).
        variables: lower-case variable name -> value, as ``SHOW VARIABLES`` reports them
            (session values where a session value exists); absent when the server does
            not know the variable.
    """

    version: str
    variables: Mapping[str, str] = field(default_factory=dict)

    @property
    def flavor(self) -> ServerFlavor:
        return flavor_of(self.version)

    def get(self, *names: str) -> tuple[str, str] | None:
        """The first of ``names`` the server knows, as ``(name, value)``."""
        for name in names:
            if name in self.variables:
                return name, self.variables[name]
        return None


@dataclass(frozen=True)
class SettingProblem:
    """One setting that breaks an assumption of the kernel."""

    setting: str
    found: str
    expected: str
    why: str

    def message(self) -> str:
        return f"{self.setting} is {self.found!r}, needs {self.expected}: {self.why}"


Check = Callable[[ServerSettings], SettingProblem | None]


@dataclass(frozen=True)
class SettingRule:
    """One requirement on the server.

    Attributes:
        name: short identifier (tests and docs refer to it).
        flavors: the flavours the rule applies to.
        variables: variables :func:`read_settings` must fetch for it.
        check: pure function returning the problem, or None when the setting is fine.
    """

    name: str
    flavors: frozenset[ServerFlavor]
    variables: tuple[str, ...]
    check: Check


class UnsafeDatabaseSettingsError(RuntimeError):
    """The database server's settings would break the fencing assumptions."""

    def __init__(self, version: str, problems: Sequence[SettingProblem]) -> None:
        self.version = version
        self.problems = tuple(problems)
        lines = [f"database server {version} is not configured as the services need:"]
        lines += [f"  - {p.message()}" for p in self.problems]
        lines.append("  (docs/database-profiles.md lists the required settings)")
        super().__init__("\n".join(lines))


def flavor_of(version: str) -> ServerFlavor:
    """The flavour a ``VERSION()`` string names (MySQL when it names neither other)."""
    lowered = version.lower()
    if "tidb" in lowered:
        return ServerFlavor.TIDB
    if "mariadb" in lowered:
        return ServerFlavor.MARIADB
    return ServerFlavor.MYSQL


def _release(settings: ServerSettings) -> tuple[int, int] | None:
    """(major, minor) of the product (TiDB: of ``-TiDB-vX.Y``, not the MySQL facade)."""
    version = settings.version
    if settings.flavor is ServerFlavor.TIDB:
        match = re.search(r"tidb-v?(\d+)\.(\d+)", version, re.IGNORECASE)
    else:
        match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _on(value: str) -> bool:
    return value.strip().upper() in ("ON", "1", "TRUE", "YES")


# --- the rules ---------------------------------------------------------------------------


def _check_version(s: ServerSettings) -> SettingProblem | None:
    minimum = MIN_VERSIONS[s.flavor]
    found = _release(s)
    if found is not None and found >= minimum:
        return None
    return SettingProblem(
        "version",
        s.version,
        f"{s.flavor.value} {minimum[0]}.{minimum[1]} or newer",
        "older releases lack the locking and error behaviour the kernel is tested against",
    )


def _check_isolation(s: ServerSettings) -> SettingProblem | None:
    found = s.get("transaction_isolation", "tx_isolation")
    if found is None:
        return SettingProblem(
            "transaction_isolation", "(unknown)", "READ-COMMITTED", "the server hides it"
        )
    name, value = found
    if value.strip().upper().replace(" ", "-") == "READ-COMMITTED":
        return None
    return SettingProblem(
        name,
        value,
        "READ-COMMITTED on every service connection",
        "fences are conditional UPDATEs on the latest committed row; snapshot reads and "
        "gap locks of REPEATABLE READ add deadlocks TiDB does not have, SERIALIZABLE turns "
        "plain reads into locks the lock order (§13.1) does not cover",
    )


def _check_autocommit(s: ServerSettings) -> SettingProblem | None:
    found = s.get("autocommit")
    if found is not None and not _on(found[1]):
        return None
    return SettingProblem(
        "autocommit",
        found[1] if found else "(unknown)",
        "OFF on service connections",
        "every fenced transition must run in an explicit transaction; with autocommit on "
        "a SELECT ... FOR UPDATE releases its lock at once (check init_connect or a proxy "
        "that resets sessions)",
    )


def _check_lock_wait(s: ServerSettings) -> SettingProblem | None:
    found = s.get("innodb_lock_wait_timeout")
    try:
        seconds = int(found[1]) if found else -1
    except ValueError:
        seconds = -1
    if 1 <= seconds <= MAX_LOCK_WAIT_TIMEOUT_S:
        return None
    return SettingProblem(
        "innodb_lock_wait_timeout",
        found[1] if found else "(unknown)",
        f"between 1 and {MAX_LOCK_WAIT_TIMEOUT_S} seconds (the services set "
        f"{LOCK_WAIT_TIMEOUT_S} per session)",
        "a blocked row lock must fail with 1205 and be retried whole, not hold a worker "
        "and a pooled connection for minutes",
    )


def _check_sql_mode(s: ServerSettings) -> SettingProblem | None:
    found = s.get("sql_mode")
    modes = {m.strip().upper() for m in (found[1] if found else "").split(",") if m.strip()}
    strict = bool(modes & {"STRICT_TRANS_TABLES", "STRICT_ALL_TABLES"})
    if strict and "NO_ENGINE_SUBSTITUTION" in modes:
        return None
    return SettingProblem(
        "sql_mode",
        found[1] if found else "(unknown)",
        "STRICT_TRANS_TABLES (or STRICT_ALL_TABLES) and NO_ENGINE_SUBSTITUTION",
        "without strict mode an over-long id, key or digest is truncated silently and a "
        "fence compares against the wrong value; without NO_ENGINE_SUBSTITUTION a missing "
        "InnoDB silently gives tables without transactions",
    )


def _check_binlog(s: ServerSettings) -> SettingProblem | None:
    log_bin = s.get("log_bin")
    if log_bin is None or not _on(log_bin[1]):
        return None
    fmt = s.get("binlog_format")
    if fmt is not None and fmt[1].strip().upper() in ("ROW", "MIXED"):
        return None
    return SettingProblem(
        "binlog_format",
        fmt[1] if fmt else "(unknown)",
        "ROW (or MIXED) while log_bin is ON",
        "statement-based binary logging refuses writes under READ COMMITTED",
    )


def _check_writable(s: ServerSettings) -> SettingProblem | None:
    for names in (("read_only",), ("transaction_read_only", "tx_read_only")):
        found = s.get(*names)
        if found is not None and _on(found[1]):
            return SettingProblem(
                found[0],
                found[1],
                "OFF",
                "the URL points at a read-only server (a replica?); every service writes",
            )
    return None


def _check_packet(s: ServerSettings) -> SettingProblem | None:
    found = s.get("max_allowed_packet")
    try:
        size = int(found[1]) if found else 0
    except ValueError:
        size = 0
    if size >= MIN_MAX_ALLOWED_PACKET:
        return None
    return SettingProblem(
        "max_allowed_packet",
        found[1] if found else "(unknown)",
        f">= {MIN_MAX_ALLOWED_PACKET} bytes",
        "a plan payload of up to 4 MiB must fit in one statement",
    )


def _check_tidb_txn_mode(s: ServerSettings) -> SettingProblem | None:
    found = s.get("tidb_txn_mode")
    # '' is the default, which is pessimistic since TiDB 3.0.8.
    if found is not None and found[1].strip().lower() in ("", "pessimistic"):
        return None
    return SettingProblem(
        "tidb_txn_mode",
        found[1] if found else "(unknown)",
        "pessimistic",
        "the lock order of §12/§13.1 needs SELECT ... FOR UPDATE to lock at once; "
        "optimistic mode reports every conflict only at COMMIT",
    )


def _check_tidb_auto_retry(s: ServerSettings) -> SettingProblem | None:
    found = s.get("tidb_disable_txn_auto_retry")
    # Deprecated (and always on) from TiDB 8.0: absent means no auto-retry.
    if found is None or _on(found[1]):
        return None
    return SettingProblem(
        "tidb_disable_txn_auto_retry",
        found[1],
        "ON (automatic transaction retry off)",
        "a transaction TiDB replays by itself re-runs its statements on newer data, so a "
        "conditional UPDATE can win a fence the caller already lost",
    )


def _check_tidb_constraint_check(s: ServerSettings) -> SettingProblem | None:
    found = s.get("tidb_constraint_check_in_place_pessimistic")
    if found is None or _on(found[1]):
        return None
    return SettingProblem(
        "tidb_constraint_check_in_place_pessimistic",
        found[1],
        "ON",
        "insert-if-absent relies on the duplicate-key error at the INSERT; deferred to "
        "COMMIT it looks like a lost commit instead of a lost race",
    )


#: Every rule, in the order problems are reported.
RULES: tuple[SettingRule, ...] = (
    SettingRule("version", _ALL, (), _check_version),
    SettingRule("isolation", _ALL, ("transaction_isolation", "tx_isolation"), _check_isolation),
    SettingRule("autocommit", _ALL, ("autocommit",), _check_autocommit),
    SettingRule("lock_wait_timeout", _ALL, ("innodb_lock_wait_timeout",), _check_lock_wait),
    SettingRule("sql_mode", _ALL, ("sql_mode",), _check_sql_mode),
    SettingRule("binlog_format", _INNODB, ("log_bin", "binlog_format"), _check_binlog),
    SettingRule(
        "writable",
        _ALL,
        ("read_only", "transaction_read_only", "tx_read_only"),
        _check_writable,
    ),
    SettingRule("max_allowed_packet", _ALL, ("max_allowed_packet",), _check_packet),
    SettingRule("tidb_txn_mode", _TIDB, ("tidb_txn_mode",), _check_tidb_txn_mode),
    SettingRule("tidb_auto_retry", _TIDB, ("tidb_disable_txn_auto_retry",), _check_tidb_auto_retry),
    SettingRule(
        "tidb_constraint_check",
        _TIDB,
        ("tidb_constraint_check_in_place_pessimistic",),
        _check_tidb_constraint_check,
    ),
)


def check_settings(
    settings: ServerSettings, rules: Iterable[SettingRule] = RULES
) -> list[SettingProblem]:
    """Every problem the rules for ``settings.flavor`` find (empty when the server is fit)."""
    flavor = settings.flavor
    problems = []
    for rule in rules:
        if flavor in rule.flavors:
            problem = rule.check(settings)
            if problem is not None:
                problems.append(problem)
    return problems


async def read_settings(
    conn: AsyncConnection, rules: Iterable[SettingRule] = RULES
) -> ServerSettings:
    """``VERSION()`` and every variable the rules name, as seen by ``conn``'s session."""
    names = sorted({v for rule in rules for v in rule.variables})
    version = str((await conn.execute(text("SELECT VERSION()"))).scalar_one())
    variables: dict[str, str] = {}
    if names:
        params = {f"v{i}": n for i, n in enumerate(names)}
        placeholders = ", ".join(f":{p}" for p in params)
        rows = await conn.execute(
            text(f"SHOW VARIABLES WHERE Variable_name IN ({placeholders})"),
            params,
        )
        variables = {str(name).lower(): str(value) for name, value in rows}
    return ServerSettings(version=version, variables=variables)


async def verify_database(
    engine: AsyncEngine, rules: Sequence[SettingRule] = RULES
) -> ServerSettings | None:
    """Check the server behind ``engine``; None for SQLite (nothing to check).

    Raises:
        UnsafeDatabaseSettingsError: a rule found a problem (all problems are listed).
    """
    if engine.dialect.name not in ("mysql", "mariadb"):
        return None
    async with engine.connect() as conn:
        settings = await read_settings(conn, rules)
        await conn.rollback()  # autocommit is off: end the transaction the reads opened
    problems = check_settings(settings, rules)
    if problems:
        raise UnsafeDatabaseSettingsError(settings.version, problems)
    return settings
