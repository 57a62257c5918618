"""Database kernel: engines, transactions, error classes, fencing and schema building blocks.

Every service reaches its database through this module, so the portable rules of
ARCHITECTURE §2 are written once:

* :func:`create_engine` — ``sqlite+aiosqlite`` (embedded default) or ``mysql+asyncmy``
  (MariaDB in CI, TiDB in production), configured for correct locking on each.
* :func:`transaction` / :func:`run_in_transaction` — always an explicit transaction
  (``BEGIN IMMEDIATE`` on SQLite); whole-transaction retry on deadlock/write conflict and
  lock-wait timeout; a connection lost during ``COMMIT`` becomes
  :class:`~services.errors.CommitOutcomeUnknownError` and is never retried.
* :func:`classify_db_error` — the one mapping from driver errors to :class:`DbErrorClass`.
* :func:`cas_update` — the fence: one conditional ``UPDATE`` whose row count must be 1,
  else :class:`~services.errors.FenceLostError`.
* :func:`insert_if_absent` — ``INSERT`` on a unique key, duplicate key → ``False``.
* :func:`scoped_select` — a scoped lookup by key, built once per shape.
* :func:`db_now` — the database clock, in UTC.
* Schema building blocks shared by the three ``schema.py`` modules: :func:`new_metadata`
  (naming convention), :data:`TABLE_OPTIONS`, :class:`UtcDateTime`, :class:`JsonText` and
  the ``*_LEN`` column widths.

What differs between the backends lives in one :class:`DialectStrategy` per dialect
(:func:`strategy_for`); nothing else in the code base branches on the dialect name.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import functools
import logging
import random
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from sqlalchemy import (
    URL,
    BigInteger,
    Column,
    ColumnElement,
    DateTime,
    Dialect,
    Executable,
    Integer,
    MetaData,
    Select,
    String,
    Table,
    Text,
    bindparam,
    case,
    event,
    insert,
    literal_column,
    make_url,
    select,
    text,
    update,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.schema import PrimaryKeyConstraint, UniqueConstraint
from sqlalchemy.sql.elements import ClauseElement, TextClause
from sqlalchemy.types import TypeDecorator, TypeEngine
from sqlalchemy.util.concurrency import greenlet_spawn

from services.db_cluster import install_session_hooks
from services.db_mysql import DRIVERS as MYSQL_DRIVERS
from services.db_mysql import carried_commit, reset_aware_dbapi
from services.db_raw import round_trip
from services.db_sqlite import one_hop_dbapi
from services.errors import CommitOutcomeUnknownError, ConflictError, FenceLostError
from services.invariants import InvariantError
from services.metrics import metrics

__all__ = [
    "BEGIN_MODE_OPTION",
    "CODE_LEN",
    "DEFAULT_BACKOFF",
    "DEFAULT_MAX_ATTEMPTS",
    "DIGEST_LEN",
    "ID_LEN",
    "KEY_LEN",
    "LOCK_WAIT_TIMEOUT_S",
    "NON_ASCII_ID",
    "ROLLED_BACK_AT_COMMIT",
    "SQLITE_BUSY_TIMEOUT_MS",
    "TABLE_OPTIONS",
    "TOKEN_LEN",
    "TRACE_CONTEXT_BYTES",
    "WORK_SCOPE",
    "AsciiId",
    "Backoff",
    "DbErrorClass",
    "DialectStrategy",
    "JsonText",
    "PayloadTooLargeError",
    "SwitchOnNull",
    "UtcDateTime",
    "cas_update",
    "classify_db_error",
    "create_engine",
    "db_now",
    "fenced_update",
    "insert_if_absent",
    "insert_prepared",
    "new_metadata",
    "now_column",
    "outbox_delivery_columns",
    "remember_now",
    "run_in_transaction",
    "scoped_select",
    "strategy_for",
    "transaction",
    "work_scope_columns",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds an InnoDB/TiDB row-lock wait may last before error 1205 (the server default, 50 s,
#: would hold a worker and a pooled connection far past any step budget).
LOCK_WAIT_TIMEOUT_S = 5
#: How long a SQLite writer waits for the single write lock before ``SQLITE_BUSY``.
SQLITE_BUSY_TIMEOUT_MS = 5000

# Column widths. Every key/index must fit InnoDB's and TiDB's 3072-byte index limit at
# 4 bytes per utf8mb4 character (tests/integration/test_schema.py checks every index).
#: App-generated identifiers (ULID/UUID-like) and org/installation/capability ids.
ID_LEN = 64
#: Caller- or producer-supplied keys: idempotency keys, producer keys, handoff keys.
KEY_LEN = 200
#: Opaque tokens: wake tokens, lease tokens, owner/holder names.
TOKEN_LEN = 128
#: ``services.digest`` strings: ``<kind>/v<n>:sha256:<64 hex>`` (75 characters plus the
#: kind at v1-v9, so kinds of up to 25 characters fit).
DIGEST_LEN = 100
#: Enumerated codes: states, kinds, profiles, failure classes.
CODE_LEN = 32
#: A stored W3C trace context (``services.telemetry``: JSON of ``traceparent`` and
#: ``tracestate``): diagnostics that carry a run's trace across asynchronous hops.
TRACE_CONTEXT_BYTES = 1024

#: MySQL/MariaDB/TiDB table options: binary collation so ids, keys and digests compare
#: byte-for-byte (MariaDB's default ``utf8mb4_general_ci`` would make ``"A"`` collide with
#: ``"a"`` in a unique key); ``utf8mb4_bin`` is also TiDB's default. Ignored by SQLite.
TABLE_OPTIONS: Mapping[str, Any] = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
}

_NAMING_CONVENTION: Mapping[str, str] = {
    "pk": "pk_%(table_name)s",
    "fk": "fk_%(table_name)s_%(referred_table_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
}


def new_metadata() -> MetaData:
    """A ``MetaData`` with the project naming convention, so Alembic compares stable names."""
    return MetaData(naming_convention=dict(_NAMING_CONVENTION))


# --- error classes ---------------------------------------------------------------------


class DbErrorClass(enum.Enum):
    """What a database error means for the transaction that hit it (ARCHITECTURE §2)."""

    #: Deadlock or write conflict; the server rolled the transaction back. Retry it whole.
    RETRYABLE_CONFLICT = "retryable_conflict"
    #: A lock wait timed out; only the statement was rolled back. ROLLBACK, then retry.
    LOCK_WAIT_TIMEOUT = "lock_wait_timeout"
    #: The connection was lost. During COMMIT the outcome is unknown: never retry blindly.
    OUTCOME_UNKNOWN = "outcome_unknown"
    #: A unique or primary key already holds the value (insert-if-absent lost the race).
    DUPLICATE_KEY = "duplicate_key"
    #: Anything else: a bug, a constraint violation, a syntax error. Not retried.
    OTHER = "other"


_RETRIED = frozenset({DbErrorClass.RETRYABLE_CONFLICT, DbErrorClass.LOCK_WAIT_TIMEOUT})
#: Errors *at COMMIT* that prove the transaction rolled back: a deadlock/write conflict
#: (on MariaDB Galera a certification failure at COMMIT is 1213; TiDB reports its
#: commit-time write conflicts with its own codes) and a unique-key violation found at
#: COMMIT (TiDB optimistic mode). Any other COMMIT failure — a lost connection, a node
#: leaving the primary component (1047), "error during COMMIT" (1180) — leaves the
#: outcome unknown: the write-set may have been certified elsewhere.
ROLLED_BACK_AT_COMMIT = frozenset({DbErrorClass.RETRYABLE_CONFLICT, DbErrorClass.DUPLICATE_KEY})

# MySQL/MariaDB/TiDB server and client error numbers (pymysql ``err.args[0]``).
_MYSQL_CODES: Mapping[int, DbErrorClass] = {
    1213: DbErrorClass.RETRYABLE_CONFLICT,  # ER_LOCK_DEADLOCK
    1020: DbErrorClass.RETRYABLE_CONFLICT,  # ER_CHECKREAD: record changed since last read
    9007: DbErrorClass.RETRYABLE_CONFLICT,  # TiDB write conflict
    8002: DbErrorClass.RETRYABLE_CONFLICT,  # TiDB SELECT FOR UPDATE write conflict
    8005: DbErrorClass.RETRYABLE_CONFLICT,  # TiDB transaction retry / write conflict
    8028: DbErrorClass.RETRYABLE_CONFLICT,  # TiDB information schema changed
    1205: DbErrorClass.LOCK_WAIT_TIMEOUT,  # ER_LOCK_WAIT_TIMEOUT (also MariaDB NOWAIT)
    3572: DbErrorClass.LOCK_WAIT_TIMEOUT,  # ER_LOCK_NOWAIT (MySQL 8 / TiDB)
    2006: DbErrorClass.OUTCOME_UNKNOWN,  # CR_SERVER_GONE_ERROR
    2013: DbErrorClass.OUTCOME_UNKNOWN,  # CR_SERVER_LOST
    2055: DbErrorClass.OUTCOME_UNKNOWN,  # CR_SERVER_LOST_EXTENDED
    1927: DbErrorClass.OUTCOME_UNKNOWN,  # ER_CONNECTION_KILLED (MariaDB: server shutdown/KILL)
    4031: DbErrorClass.OUTCOME_UNKNOWN,  # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
    1062: DbErrorClass.DUPLICATE_KEY,  # ER_DUP_ENTRY
    1586: DbErrorClass.DUPLICATE_KEY,  # ER_DUP_ENTRY_WITH_KEY_NAME
}

_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6
_SQLITE_CONSTRAINT_PRIMARYKEY, _SQLITE_CONSTRAINT_UNIQUE = 1555, 2067


def _classify_mysql(orig: BaseException) -> DbErrorClass | None:
    # pymysql (and aiomysql, which re-exports its classes) and asyncmy carry
    # (errno, message) in args.
    if type(orig).__module__.split(".")[0] not in ("pymysql", "aiomysql", "asyncmy"):
        return None
    code = orig.args[0] if orig.args and isinstance(orig.args[0], int) else None
    return _MYSQL_CODES.get(code, DbErrorClass.OTHER) if code is not None else DbErrorClass.OTHER


def _classify_sqlite(orig: BaseException) -> DbErrorClass | None:
    if not isinstance(orig, sqlite3.Error):
        return None
    # Python 3.11 sets the extended result code on errors raised by SQLite itself; an
    # exception built by hand (or by an adapter) may only carry the message.
    code = getattr(orig, "sqlite_errorcode", None)
    message = str(orig)
    if isinstance(code, int):
        if code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return DbErrorClass.RETRYABLE_CONFLICT
        if code in (_SQLITE_CONSTRAINT_UNIQUE, _SQLITE_CONSTRAINT_PRIMARYKEY):
            return DbErrorClass.DUPLICATE_KEY
    if "database is locked" in message or "database table is locked" in message:
        return DbErrorClass.RETRYABLE_CONFLICT
    if isinstance(orig, sqlite3.IntegrityError) and message.startswith("UNIQUE constraint failed"):
        return DbErrorClass.DUPLICATE_KEY
    return DbErrorClass.OTHER


def classify_db_error(exc: BaseException) -> DbErrorClass:
    """Classify ``exc`` — a SQLAlchemy ``DBAPIError`` or a raw pymysql/sqlite3 error.

    A SQLAlchemy error whose connection was invalidated (the dialect recognised a
    disconnect) is :attr:`DbErrorClass.OUTCOME_UNKNOWN` even when the driver code is not
    in the table. Anything that is not a database error is :attr:`DbErrorClass.OTHER`.
    """
    orig: BaseException = exc
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return DbErrorClass.OUTCOME_UNKNOWN
        if exc.orig is not None:
            orig = exc.orig
    for classify in (_classify_mysql, _classify_sqlite):
        found = classify(orig)
        if found is not None:
            return found
    return DbErrorClass.OTHER


# --- per-dialect strategy --------------------------------------------------------------

#: Execution option naming the SQLite BEGIN mode of a transaction; ``"DEFERRED"`` marks
#: a read-only :func:`transaction` on every backend (the bench counts write transactions
#: by it).
BEGIN_MODE_OPTION = "flow_sqlite_begin"
_BEGIN_MODE_OPTION = BEGIN_MODE_OPTION


class DialectStrategy(abc.ABC):
    """Everything that differs between the supported backends."""

    #: ``create_async_engine`` driver names this strategy accepts.
    drivers: frozenset[str] = frozenset()
    #: SQL returning the current UTC time of the database.
    now_sql: str = ""
    #: Whether DDL takes part in transactions (a whole migration commits or not at all).
    transactional_ddl: bool = False
    #: Whether one ``UPDATE`` may write rows of several tables (:func:`fenced_updates`).
    multi_table_update: bool = False
    #: Whether several statements may be sent in one round trip
    #: (:func:`services.db_batch.execute_writes`).
    multi_statements: bool = False

    @abc.abstractmethod
    def engine_options(self, url: URL, pool_size: int) -> dict[str, Any]:
        """Keyword arguments for ``create_async_engine``."""

    @abc.abstractmethod
    def install_hooks(self, engine: Engine) -> None:
        """Register connection/transaction event hooks on the engine's sync facade."""

    def parse_now(self, value: Any) -> datetime:
        """Turn the result of :attr:`now_sql` into an aware UTC datetime."""
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if not isinstance(value, datetime):
            raise TypeError(f"database clock returned {value!r}")
        return value.replace(tzinfo=UTC)

    def datetime_type(self) -> TypeEngine[Any]:
        """Storage type of :class:`UtcDateTime`."""
        return DateTime()

    def text_type(self, max_bytes: int) -> TypeEngine[Any]:
        """Storage type of :class:`JsonText` able to hold ``max_bytes`` bytes."""
        return Text()


class _SqliteStrategy(DialectStrategy):
    drivers = frozenset({"sqlite+aiosqlite"})
    transactional_ddl = True
    # Millisecond precision is what SQLite's clock offers.
    now_sql = "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"

    def engine_options(self, url: URL, pool_size: int) -> dict[str, Any]:
        database = url.database or ""
        # One hand-off to the driver thread per statement (services/db_sqlite.py).
        module = {"module": one_hop_dbapi()}
        if database in ("", ":memory:") or database.startswith("file:"):
            return module  # StaticPool: one shared connection
        Path(database).parent.mkdir(parents=True, exist_ok=True)
        return {"pool_size": pool_size, "max_overflow": 0, **module}

    def install_hooks(self, engine: Engine) -> None:
        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            # Take BEGIN away from pysqlite: its deferred BEGIN lets two read-modify-write
            # transactions both read before either writes (lost updates, TOOLING.md).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                if hasattr(dbapi_connection, "busy_timeout_ms"):
                    # Inline statements never wait for a lock; one that would is re-run on
                    # the driver thread with this timeout (services/db_sqlite.py).
                    dbapi_connection.busy_timeout_ms = SQLITE_BUSY_TIMEOUT_MS
                    cursor.execute("PRAGMA busy_timeout=0")
                else:
                    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
                # WAL: readers never block the writer and several processes share a file.
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA foreign_keys=ON")
                # NORMAL in WAL mode survives a process crash (SIGKILL); only an OS crash
                # may lose the last commits, which the embedded default accepts.
                cursor.execute("PRAGMA synchronous=NORMAL")
            finally:
                cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # IMMEDIATE takes the write lock up front, so the SELECT of a read-modify-write
            # is already serialised (SQLite ignores FOR UPDATE); read-only transactions opt
            # into DEFERRED through transaction(readonly=True).
            mode = conn.get_execution_options().get(_BEGIN_MODE_OPTION, "IMMEDIATE")
            conn.exec_driver_sql(f"BEGIN {mode}")


class _MySqlStrategy(DialectStrategy):
    drivers = frozenset(f"{b}+{d}" for b in ("mysql", "mariadb") for d in MYSQL_DRIVERS)
    # UTC_TIMESTAMP, not CURRENT_TIMESTAMP: the latter is in the session time zone.
    now_sql = "SELECT UTC_TIMESTAMP(6)"
    # UPDATE t1, t2 SET … WHERE …: the same syntax on MariaDB, MySQL and TiDB.
    multi_table_update = True
    # CLIENT_MULTI_STATEMENTS: writes checked only by row count share a round trip
    # (services/db_batch.py, ADR 0010).
    multi_statements = True

    def engine_options(self, url: URL, pool_size: int) -> dict[str, Any]:
        return {
            # The URL's driver (asyncmy or aiomysql), without the reset ROLLBACK round
            # trip after a transaction that ended (db_mysql.py).
            "module": reset_aware_dbapi(url.get_driver_name()),
            "pool_pre_ping": True,
            "pool_size": pool_size,
            "max_overflow": 0,  # FLOW_DB_POOL_SIZE is the connection budget, not a hint
            "pool_recycle": 1800,
            # READ COMMITTED, not REPEATABLE READ: correctness never rests on snapshot
            # reads or gap locks — the fence is the conditional UPDATE checked by row
            # count, and rows are locked explicitly with FOR UPDATE in §13.1 order. This
            # is also the isolation TiDB's pessimistic mode is tuned for, and it avoids
            # InnoDB's gap/next-key locks that TiDB does not have (fewer MariaDB-only
            # deadlocks). Needs ROW binlog format when binary logging is on.
            "isolation_level": "READ COMMITTED",
            "connect_args": {
                "charset": "utf8mb4",
                "init_command": f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_TIMEOUT_S}",
            },
        }

    def install_hooks(self, engine: Engine) -> None:
        # The driver runs with autocommit off (the first statement opens the transaction),
        # and isolation and lock-wait timeout are connect options. A Galera node also gets
        # the cluster profile's per-connection settings (causal reads, TOI DDL). Every
        # connection may run multi-statements, and a batched round trip's results are
        # read back in its execution (services/db_batch.py, ADR 0010).
        install_session_hooks(engine)
        from services.db_batch import install_batch_hooks  # imports this module

        install_batch_hooks(engine)

    def datetime_type(self) -> TypeEngine[Any]:
        return mysql.DATETIME(fsp=6)

    def text_type(self, max_bytes: int) -> TypeEngine[Any]:
        if max_bytes <= 65_535:
            return mysql.TEXT()
        if max_bytes <= 16_777_215:
            return mysql.MEDIUMTEXT()
        return mysql.LONGTEXT()


_STRATEGIES: Mapping[str, DialectStrategy] = {
    "sqlite": _SqliteStrategy(),
    "mysql": _MySqlStrategy(),
    "mariadb": _MySqlStrategy(),
}


def strategy_for(dialect: str | Dialect) -> DialectStrategy:
    """The strategy of a dialect (or dialect name)."""
    name = dialect if isinstance(dialect, str) else dialect.name
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unsupported database dialect {name!r}") from None


def create_engine(url: str | URL, pool_size: int = 5) -> AsyncEngine:
    """Create the async engine of one service database.

    Args:
        url: ``sqlite+aiosqlite:///path`` or ``mysql+asyncmy://user:pw@host:port/db``
            (``mysql+aiomysql://`` too: ``services/db_mysql.py``).
        pool_size: connection budget (``ServiceConfig.db_pool_size``).

    Raises:
        ValueError: unsupported driver.
    """
    parsed = make_url(url)
    strategy = strategy_for(parsed.get_backend_name())
    if parsed.drivername not in strategy.drivers:
        raise ValueError(f"unsupported database driver {parsed.drivername!r}")
    engine = create_async_engine(parsed, **strategy.engine_options(parsed, pool_size))
    strategy.install_hooks(engine.sync_engine)
    return engine


# --- transactions ----------------------------------------------------------------------


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff with jitter between whole-transaction retries."""

    initial_s: float = 0.005
    max_s: float = 0.2
    multiplier: float = 2.0

    def delay(self, retry: int) -> float:
        """Delay before retry number ``retry`` (1-based): uniform in [cap/2, cap]."""
        cap = min(self.max_s, self.initial_s * self.multiplier ** max(retry - 1, 0))
        return random.uniform(cap / 2, cap)  # noqa: S311 - jitter, not a secret


DEFAULT_BACKOFF = Backoff()
DEFAULT_MAX_ATTEMPTS = 5


async def _rollback_quietly(conn: AsyncConnection) -> None:
    try:
        await conn.rollback()
    except Exception:
        # The connection is unusable (e.g. lost): drop it rather than return it to the pool.
        _log.warning("rollback failed; invalidating the connection", exc_info=True)
        await conn.invalidate()


@asynccontextmanager
async def transaction(
    engine: AsyncEngine, *, readonly: bool = False
) -> AsyncIterator[AsyncConnection]:
    """One explicit transaction: commit on success, roll back on any exception.

    On SQLite the transaction starts with ``BEGIN IMMEDIATE`` (``BEGIN DEFERRED`` when
    ``readonly``, which must then not write); on MySQL autocommit is off, so the first
    statement opens the transaction and a ``FOR UPDATE`` never runs in autocommit.

    Nothing a caller wrote is won before ``COMMIT`` returns: on a cluster (Galera) every
    conditional UPDATE may report its row count and still lose at ``COMMIT``. A
    ``COMMIT`` that fails with a proven rollback (:data:`ROLLED_BACK_AT_COMMIT`)
    re-raises the driver error (``run_in_transaction`` retries it whole); any other
    ``COMMIT`` failure is an unknown outcome.

    Raises:
        CommitOutcomeUnknownError: the connection was lost during COMMIT, or COMMIT failed
            without a proven rollback.
    """
    # Check-out, BEGIN, and COMMIT with the check-in, each in one hand-off to
    # SQLAlchemy's greenlet (≈ 9 µs of CPU each) rather than one per call.
    sync = await greenlet_spawn(_open, engine.sync_engine, readonly)
    conn = AsyncConnection(engine, sync)
    try:
        try:
            yield conn
        except BaseException as exc:
            # The transaction's last writes may have carried its COMMIT (ADR 0013) before
            # the caller raised: then nothing is rolled back, and the caller must not
            # take the error for a rollback (a read-only one's last reads: no matter).
            carried = _carried(sync)
            await _rollback_quietly(conn)
            if carried:
                metrics().transaction_finished("committed")
                # A read-only transaction wrote nothing: its caller's error stands.
                if isinstance(exc, Exception) and not readonly:
                    raise InvariantError(
                        "the transaction committed with its last writes, then its caller"
                        f" raised {type(exc).__name__}"
                    ) from exc
                raise
            if isinstance(exc, CommitOutcomeUnknownError):  # a carried COMMIT's (ADR 0013)
                metrics().transaction_finished("commit_unknown", DbErrorClass.OUTCOME_UNKNOWN.value)
            else:
                metrics().transaction_finished("rolled_back", classify_db_error(exc).value)
            raise
        try:
            check_in_failure = await greenlet_spawn(_commit_and_close, sync)
        except Exception as exc:
            kind = classify_db_error(exc)
            outcome = "rolled_back" if kind in ROLLED_BACK_AT_COMMIT else "commit_unknown"
            metrics().transaction_finished(outcome, kind.value)
            if kind not in ROLLED_BACK_AT_COMMIT:
                # A connection whose COMMIT outcome is unknown is never reused: its
                # session may still hold the transaction (or be gone).
                with contextlib.suppress(Exception):
                    await conn.invalidate()
                message = (
                    "connection lost during commit"
                    if kind is DbErrorClass.OUTCOME_UNKNOWN
                    else "commit failed without a proven rollback"
                )
                raise CommitOutcomeUnknownError(message) from exc
            await _rollback_quietly(conn)
            raise
        metrics().transaction_finished("committed")
        if check_in_failure is not None:
            raise check_in_failure
    finally:
        if not sync.closed:
            await conn.close()


def _carried(conn: Connection) -> bool:
    """``conn``'s transaction was committed by its last writes' round trip (ADR 0013)."""
    fairy = conn._dbapi_connection  # None once invalidated (never asks for a reconnect)
    return fairy is not None and carried_commit(fairy.dbapi_connection)


def _open(engine: Engine, readonly: bool) -> Connection:
    """A pooled connection inside its transaction (``BEGIN``; ``DEFERRED`` on SQLite when
    ``readonly``), or nothing held if either step fails."""
    conn = engine.connect()
    try:
        if readonly:
            conn.execution_options(**{_BEGIN_MODE_OPTION: "DEFERRED"})
        conn.begin()
    except BaseException:
        conn.close()
        raise
    return conn


def _commit_and_close(conn: Connection) -> Exception | None:
    """``COMMIT`` (raises, the connection still open, if it failed), then return the
    connection to the pool: a failure of that check-in is returned, not raised — the
    ``COMMIT`` stands whatever happens to the connection after it."""
    conn.commit()
    try:
        conn.close()
    except Exception as exc:
        return exc
    return None


async def run_in_transaction(
    engine: AsyncEngine,
    fn: Callable[[AsyncConnection], Awaitable[T]],
    *,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    backoff: Backoff = DEFAULT_BACKOFF,
    readonly: bool = False,
) -> T:
    """Run ``fn`` in a :func:`transaction`, retrying the whole of it on conflicts.

    ``fn`` must be safe to run again from the same input: a retry starts over in a new
    transaction after the old one was rolled back. Retried: deadlock/write conflict and
    lock-wait timeout. Never retried: a lost connection (during COMMIT it surfaces as
    :class:`~services.errors.CommitOutcomeUnknownError`; before COMMIT the raw error is
    re-raised for the caller's durable retry), fence loss, duplicate keys, anything else.

    Raises:
        ConflictError: still conflicting after ``max_attempts`` attempts.
        CommitOutcomeUnknownError: the connection was lost during COMMIT.
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    attempt = 1
    while True:
        try:
            async with transaction(engine, readonly=readonly) as conn:
                return await fn(conn)
        except Exception as exc:
            kind = classify_db_error(exc)
            if kind not in _RETRIED:
                raise
            if attempt >= max_attempts:
                raise ConflictError(
                    f"database conflict persisted after {attempt} attempts"
                ) from exc
            _log.debug("transaction attempt %d: %s, retrying", attempt, kind.value)
            await asyncio.sleep(backoff.delay(attempt))
            attempt += 1


# --- fencing and idempotent inserts ----------------------------------------------------


def _unique_keys(table: Table) -> Iterable[frozenset[str]]:
    for constraint in table.constraints:
        if isinstance(constraint, PrimaryKeyConstraint | UniqueConstraint):
            yield frozenset(c.name for c in constraint.columns)


async def cas_update(
    conn: AsyncConnection,
    table: Table,
    *,
    org_id: str,
    key: Mapping[str, Any],
    expected_version: int,
    values: Mapping[str, Any],
    version_column: str = "state_version",
    extra_predicates: Iterable[ColumnElement[bool]] = (),
) -> int:
    """Fenced update of one row: ``SET version = version + 1, … WHERE org_id AND key AND
    version = expected [AND extra…]`` whose row count must be exactly 1.

    Args:
        conn: the caller's connection, inside its transaction.
        table: a table with an ``org_id`` column and ``version_column``.
        org_id: the trusted org.
        key: the rest of a primary or unique key (column name → value).
        expected_version: the version the caller read.
        values: columns to set; never the version, ``org_id`` or key columns.
        version_column: the compare-and-swap column.
        extra_predicates: further fence conditions (lease token, state, epoch, …).

    Returns:
        The new version (``expected_version + 1``).

    Raises:
        FenceLostError: no row matched; ``found_version`` is what a scoped re-read saw
            (None when the row does not exist in this org).
        ValueError: ``key`` is not a unique key with ``org_id``, or ``values`` touches the
            version or identity columns.
    """
    identity = frozenset({"org_id", *key})
    if identity not in set(_unique_keys(table)):
        raise ValueError(f"{sorted(identity)} is not a unique key of {table.name}")
    touched = identity.union({version_column}).intersection(values)
    if touched:
        raise ValueError(f"cas_update may not set {sorted(touched)} on {table.name}")
    version = table.c[version_column]
    scope = [table.c.org_id == org_id, *(table.c[name] == value for name, value in key.items())]
    stmt = (
        update(table)
        .where(*scope, version == expected_version, *extra_predicates)
        .values({**values, version_column: version + 1})
    )
    result = await conn.execute(stmt)
    if result.rowcount == 1:
        return expected_version + 1
    raise await _fence_lost(conn, table, org_id, key, expected_version, version_column)


@functools.cache
def scoped_select(
    table: Table,
    key: tuple[str, ...],
    *,
    columns: tuple[str, ...] = (),
    for_update: bool = False,
) -> Select[Any]:
    """``SELECT <columns, default every column> FROM table WHERE org_id = :org_id AND
    <each key column> = :<column> [FOR UPDATE]``, built once per shape and reused (bind
    ``{"org_id": …, column: value, …}``): a scoped lookup by a key that pays neither
    statement construction nor cache-key generation per call. The key columns are
    compared with ``=``, so a key value must not be None (``= NULL`` matches nothing).
    """
    c = table.c
    where = [c[name] == bindparam(name, type_=c[name].type) for name in ("org_id", *key)]
    stmt = select(*(c[name] for name in columns) if columns else (table,)).where(*where)
    return stmt.with_for_update() if for_update else stmt


async def _fence_lost(
    conn: AsyncConnection,
    table: Table,
    org_id: str,
    key: Mapping[str, Any],
    expected_version: int,
    version_column: str,
) -> FenceLostError:
    """The error of a fenced UPDATE that matched no row, with the version a scoped
    re-read found (diagnostic only: the decision was the row count)."""
    stmt = scoped_select(table, tuple(key), columns=(version_column,))
    found = (await conn.execute(stmt, {"org_id": org_id, **key})).scalar_one_or_none()
    return FenceLostError(
        table.name,
        ",".join(f"{name}={value}" for name, value in key.items()),
        expected_version,
        found,
    )


#: The reused INSERT construct of each table (:func:`insert_if_absent`).
_INSERTS: dict[Table, Any] = {}
#: The clock statement of each dialect (:func:`db_now`), built once.
_NOW_STATEMENTS: dict[str, TextClause] = {}
#: ``Connection.info`` key of the transaction's clock reading: ``(transaction, now)``.
_NOW_KEY = "flow_db_now"


@dataclass(frozen=True)
class SwitchOnNull:
    """A :func:`fenced_update` value the database chooses under the row lock:
    ``if_not_null`` when ``column`` IS NOT NULL in the row, else ``otherwise``."""

    column: str
    if_not_null: Any
    otherwise: Any


#: :func:`fenced_update` statements by shape, built once (bounded by the code's shapes).
_FENCED: dict[tuple[Any, ...], Any] = {}
#: :func:`fenced_updates` statements by the tuple of their writes' shapes, built once.
_FENCED_TOGETHER: dict[tuple[tuple[Any, ...], ...], Any] = {}
#: The default of :func:`fenced_update`'s optional comparison mappings.
_NOTHING: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class FencedWrite:
    """One :func:`fenced_update` given as data (its arguments, same meaning), so that
    :func:`fenced_updates` can write several in one statement."""

    table: Table
    org_id: str
    key: Mapping[str, Any]
    expected_version: int
    values: Mapping[str, Any]
    equal: Mapping[str, Any]
    at_most: Mapping[str, Any] = field(default_factory=lambda: _NOTHING)
    less_than: Mapping[str, Any] = field(default_factory=lambda: _NOTHING)
    version_column: str = "state_version"

    def shape(self) -> tuple[Any, ...]:
        """What the statement depends on (table, key, set columns, compared columns,
        which comparisons are IS NULL) — not the values, which are bound parameters."""
        return (
            self.table,
            tuple(self.key),
            self.version_column,
            tuple(
                (n, v.column if isinstance(v, SwitchOnNull) else None)
                for n, v in self.values.items()
            ),
            tuple((n, v is None) for n, v in self.equal.items()),
            tuple(self.at_most),
            tuple(self.less_than),
        )

    def params(self, prefix: str = "") -> dict[str, Any]:
        """The bound parameters of :meth:`shape`'s statement, names ``prefix``-ed."""
        params: dict[str, Any] = {
            f"{prefix}k_org": self.org_id,
            f"{prefix}k_version": self.expected_version,
        }
        for name, value in self.key.items():
            params[f"{prefix}k_{name}"] = value
        for name, value in self.values.items():
            if isinstance(value, SwitchOnNull):
                params[f"{prefix}v_{name}"] = value.otherwise
                params[f"{prefix}w_{name}"] = value.if_not_null
            else:
                params[f"{prefix}v_{name}"] = value
        for name, value in self.equal.items():
            if value is not None:
                params[f"{prefix}p_{name}"] = value
        for name, value in self.at_most.items():
            params[f"{prefix}le_{name}"] = value
        for name, value in self.less_than.items():
            params[f"{prefix}lt_{name}"] = value
        return params


def _fenced_clauses(
    table: Table,
    key: tuple[str, ...],
    version_column: str,
    values: tuple[tuple[str, str | None], ...],
    equal: tuple[tuple[str, bool], ...],
    at_most: tuple[str, ...] = (),
    less_than: tuple[str, ...] = (),
    *,
    prefix: str = "",
) -> tuple[list[Any], dict[Any, Any]]:
    """The WHERE predicates and SET values of one fenced UPDATE of ``table``, with bound
    parameters named ``prefix`` + their :meth:`FencedWrite.params` names."""
    identity = frozenset({"org_id", *key})
    if identity not in set(_unique_keys(table)):
        raise ValueError(f"{sorted(identity)} is not a unique key of {table.name}")
    touched = identity.union({version_column}).intersection(name for name, _ in values)
    if touched:
        raise ValueError(f"fenced_update may not set {sorted(touched)} on {table.name}")
    c = table.c

    def bound(name: str, column: str) -> Any:
        return bindparam(f"{prefix}{name}", type_=c[column].type)

    where = [c.org_id == bound("k_org", "org_id")]
    where += [c[name] == bound(f"k_{name}", name) for name in key]
    version = c[version_column]
    where.append(version == bound("k_version", version_column))
    for name, is_null in equal:
        where.append(c[name].is_(None) if is_null else c[name] == bound(f"p_{name}", name))
    where += [c[name] <= bound(f"le_{name}", name) for name in at_most]
    where += [c[name] < bound(f"lt_{name}", name) for name in less_than]
    sets: dict[Any, Any] = {version: version + 1}
    for name, switch in values:
        plain = bound(f"v_{name}", name)
        if switch is None:
            sets[c[name]] = plain
        else:
            sets[c[name]] = case((c[switch].is_not(None), bound(f"w_{name}", name)), else_=plain)
    return where, sets


def _fenced_statement(*shape: Any) -> Any:
    where, sets = _fenced_clauses(*shape)
    return update(shape[0]).where(*where).values(sets)


def _fenced_together_statement(shapes: tuple[tuple[Any, ...], ...]) -> Any:
    """One multi-table ``UPDATE`` carrying every shape's predicates and values
    (parameters prefixed ``u<i>_``); the tables are related by their (equal) ``org_id``
    only — each row is named by its own key, as in its single-table statement."""
    lead = next((i for i, shape in enumerate(shapes) if _sets_wide(shape)), 0)
    first: Table = shapes[lead][0]
    where: list[Any] = []
    sets: dict[Any, Any] = {}
    for i, shape in enumerate(shapes):
        w, s = _fenced_clauses(*shape, prefix=f"u{i}_")
        where += w
        sets.update(s)
        if i != lead:
            where.append(shape[0].c.org_id == first.c.org_id)
    return update(first).where(*where).values(sets)


#: MariaDB stores a temporary-table column longer than this many bytes as a BLOB, and a
#: temporary table with a BLOB on disk (``CONVERT_IF_BIGGER_TO_BLOB``).
_TMP_COLUMN_BYTES = 512


def _sets_wide(shape: tuple[Any, ...]) -> bool:
    """Whether a write of ``shape`` sets a column MariaDB's multi-table ``UPDATE`` would
    keep in an on-disk temporary table (text, or a string wider than 512 bytes) were its
    table not the one updated on the fly — the first of the statement's tables. Such a
    table is named first (ADR 0015): e.g. the attempt row's ``metrics_summary`` in a step
    commit. The order of the tables in the statement is free: every row is already
    locked by the caller's lock read (see :func:`fenced_updates`)."""
    table: Table = shape[0]
    for name, _ in shape[3]:
        column_type = table.c[name].type
        if isinstance(column_type, TypeDecorator):
            column_type = column_type.impl_instance
        if isinstance(column_type, Text) or (
            isinstance(column_type, String)
            and (column_type.length is None or 4 * column_type.length > _TMP_COLUMN_BYTES)
        ):
            return True
    return False


async def fenced_update(
    conn: AsyncConnection,
    table: Table,
    *,
    org_id: str,
    key: Mapping[str, Any],
    expected_version: int,
    values: Mapping[str, Any],
    equal: Mapping[str, Any],
    at_most: Mapping[str, Any] = _NOTHING,
    less_than: Mapping[str, Any] = _NOTHING,
    version_column: str = "state_version",
) -> int:
    """:func:`cas_update` with its fence conditions given as data: ``equal`` maps a
    column to the value it must hold (``None``: IS NULL), ``at_most`` to a bound it may
    not exceed (``column <= value``, e.g. a due time), ``less_than`` to one it must stay
    below (``column < value``, e.g. an expired lease); a value may be a
    :class:`SwitchOnNull`. The statement is built once per *shape* (table, key, set
    columns, compared columns, which comparisons are IS NULL) with bound parameters and
    reused, so a hot path pays neither construction nor cache-key generation per call;
    the predicates and the row-count decision are exactly :func:`cas_update`'s.

    Returns:
        The new version (``expected_version + 1``).

    Raises:
        FenceLostError: no row matched (``found_version`` as :func:`cas_update`).
        ValueError: ``key`` is not a unique key with ``org_id``, or ``values`` touches the
            version or identity columns.
    """
    write = FencedWrite(
        table, org_id, key, expected_version, values, equal, at_most, less_than, version_column
    )
    return await _fenced_one(conn, write)


async def _fenced_one(conn: AsyncConnection, write: FencedWrite) -> int:
    result = await conn.execute(fenced_statement(write), write.params())
    if result.rowcount == 1:
        return write.expected_version + 1
    raise await fence_lost_error(conn, write)


def fenced_statement(write: FencedWrite) -> Executable:
    """The conditional ``UPDATE`` of one :class:`FencedWrite` (built once per shape;
    parameters: :meth:`FencedWrite.params`). It matched iff its row count is 1."""
    shape = write.shape()
    stmt: Executable | None = _FENCED.get(shape)
    if stmt is None:
        stmt = _FENCED[shape] = _fenced_statement(*shape)
    return stmt


async def fence_lost_error(conn: AsyncConnection, write: FencedWrite) -> FenceLostError:
    """The error of ``write``'s statement when it matched no row (as :func:`fenced_update`
    raises it, with the version a scoped re-read found)."""
    return await _fence_lost(
        conn, write.table, write.org_id, write.key, write.expected_version, write.version_column
    )


def _writable_together(writes: Sequence[FencedWrite]) -> bool:
    """Whether ``writes`` can be one multi-table statement with the same meaning: distinct
    tables of one org, and no value chosen on a column the same write sets (a
    multi-table ``UPDATE`` assigns in no defined order)."""
    if len({w.table for w in writes}) != len(writes) or len({w.org_id for w in writes}) != 1:
        return False
    for w in writes:
        switches = {v.column for v in w.values.values() if isinstance(v, SwitchOnNull)}
        if switches.intersection(w.values):
            return False
    return True


async def fenced_updates(conn: AsyncConnection, writes: Sequence[FencedWrite]) -> list[int]:
    """:func:`fenced_update` of each of ``writes``, in order — as **one** multi-table
    ``UPDATE`` where the backend has one (:attr:`DialectStrategy.multi_table_update`:
    MariaDB, MySQL, TiDB), sequential statements elsewhere (SQLite). (The kernel sends
    the same statements as writes of its batches: ``services.db_batch.fenced_writes``.)

    The caller must already hold every row's lock in this transaction (its fenced lock
    read, ``FOR UPDATE`` in §13.1 order): a multi-table ``UPDATE`` locks rows in the
    optimizer's order, which is not the lock order the sequential UPDATEs would keep.
    The decision is the row count, as for one write: the statement carries every write's
    predicates, so it matches all rows (count = number of writes) or none. None matched:
    nothing was written, and the writes run again one by one — the first whose fence is
    lost raises exactly the error :func:`fenced_update` raises (diagnostics included).

    Returns:
        Each write's new version.

    Raises:
        FenceLostError: a write's row did not match (as :func:`fenced_update`).
        RuntimeError: the statement matched some rows and not others (a backend that
            counts rows otherwise; the caller's transaction must roll back).
    """
    together_stmt = fenced_together(conn.dialect, writes)
    if together_stmt is None:
        return [await _fenced_one(conn, w) for w in writes]
    stmt, params = together_stmt
    result = await conn.execute(stmt, params)
    return await settle_fenced_together(conn, writes, result.rowcount)


def fenced_together(
    dialect: Dialect, writes: Sequence[FencedWrite]
) -> tuple[Executable, dict[str, Any]] | None:
    """The one multi-table ``UPDATE`` of ``writes`` and its parameters (see
    :func:`fenced_updates`, whose rules it follows), or ``None`` where they are written
    one by one (one write, a backend without multi-table ``UPDATE``, or writes that are
    not writable together). Its row count is decided by :func:`settle_fenced_together`."""
    if (
        len(writes) < 2
        or not strategy_for(dialect).multi_table_update
        or not _writable_together(writes)
    ):
        return None
    shapes = tuple(w.shape() for w in writes)
    stmt = _FENCED_TOGETHER.get(shapes)
    if stmt is None:
        stmt = _FENCED_TOGETHER[shapes] = _fenced_together_statement(shapes)
    params: dict[str, Any] = {}
    for i, write in enumerate(writes):
        params.update(write.params(f"u{i}_"))
    return stmt, params


async def settle_fenced_together(
    conn: AsyncConnection, writes: Sequence[FencedWrite], rowcount: int
) -> list[int]:
    """Decide :func:`fenced_together`'s statement by its ``rowcount``: every row matched
    → each write's new version; none → the writes run again one by one, and the first
    whose fence is lost raises exactly :func:`fenced_update`'s error; some → RuntimeError
    (the caller's transaction must roll back)."""
    if rowcount == len(writes):
        return [w.expected_version + 1 for w in writes]
    if rowcount:
        raise RuntimeError(f"a multi-table fenced UPDATE matched {rowcount} of {len(writes)} rows")
    return [await _fenced_one(conn, w) for w in writes]


async def insert_if_absent(conn: AsyncConnection, table: Table, values: Mapping[str, Any]) -> bool:
    """``INSERT`` one row; ``False`` when a primary/unique key already holds it.

    The caller's transaction stays usable after a duplicate: MySQL/MariaDB/TiDB roll back
    only the failed statement, and so does SQLite (its default ``ABORT`` conflict
    resolution keeps earlier changes of the transaction), so no savepoint is needed. A
    duplicate on *any* unique key returns ``False``; read back by the key that matters.
    """
    params = dict(values)
    if any(isinstance(v, ClauseElement) for v in params.values()):
        # SQL expressions are inlined, not bound.
        return await insert_prepared(conn, insert(table).values(params), None)
    return await insert_prepared(conn, insert_statement(table), params)


def insert_statement(table: Table) -> Any:
    """The one ``INSERT`` construct of ``table`` (its values bound at execution): reused,
    so no statement is built and no cache key is generated per call."""
    stmt = _INSERTS.get(table)
    if stmt is None:
        stmt = _INSERTS[table] = insert(table)
    return stmt


async def insert_prepared(
    conn: AsyncConnection, stmt: Executable, params: Mapping[str, Any] | None
) -> bool:
    """Execute a pre-built ``INSERT`` of one row (built once, at import, with bound
    parameters; ``params`` None: the statement carries its values); ``False`` when a
    primary/unique key already holds it — the transaction stays usable, as with
    :func:`insert_if_absent`, its per-table form."""
    try:
        if params is None:
            await conn.execute(stmt)
        else:
            await conn.execute(stmt, dict(params))
    except DBAPIError as exc:
        if classify_db_error(exc) is DbErrorClass.DUPLICATE_KEY:
            return False
        raise
    return True


async def db_now(conn: AsyncConnection) -> datetime:
    """The database's current time as an aware UTC datetime.

    Durable times (``RunAfter``, lease expiry, ``RecoveryObservedAt``) are taken from the
    database clock so that replicas with skewed clocks agree (§12.2).

    One read per transaction: the first call in a transaction asks the database and
    every later call in the same transaction returns that instant, so every durable time
    one transaction writes is the same (the business writes', the checkpoint's, the
    lifecycle rows', a continuation's lease start) and no sub-operation pays a round trip
    for it.
    """
    cached = _cached_now(conn)
    if cached is not None:
        return cached
    strategy = strategy_for(conn.dialect)
    if strategy.multi_statements:
        # A MySQL-protocol backend: the driver's own cursor (services/db_raw.py).
        answers: list[tuple[Any, list[Any], int]] = []
        await round_trip(conn, strategy.now_sql, (), 1, answers)
        [(_, [(reading, *_)], _)] = answers
    else:
        stmt = _NOW_STATEMENTS.get(strategy.now_sql)
        if stmt is None:
            stmt = _NOW_STATEMENTS[strategy.now_sql] = text(strategy.now_sql)
        reading = (await conn.execute(stmt)).scalar_one()
    now = strategy.parse_now(reading)
    sync = conn.sync_connection
    if sync is not None:
        # The clock statement itself may have begun the (autobegin) transaction.
        sync.info[_NOW_KEY] = (sync.get_transaction(), now)
    return now


def remember_now(conn: AsyncConnection, now: datetime) -> datetime:
    """Keep ``now`` — a clock reading the caller took with another statement of this
    transaction (e.g. a column of its first lock read) — as the transaction's
    :func:`db_now`, unless the transaction already has one; returns the one kept (the
    first reading wins, as in :func:`db_now`)."""
    sync = conn.sync_connection
    txn = None if sync is None else sync.get_transaction()
    if txn is None or sync is None:
        return now
    cached = _cached_now(conn)
    if cached is not None:
        return cached
    sync.info[_NOW_KEY] = (txn, now)
    return now


def _cached_now(conn: AsyncConnection) -> datetime | None:
    """The clock reading this transaction already kept (:func:`db_now`), if any."""
    sync = conn.sync_connection
    txn = None if sync is None else sync.get_transaction()
    if txn is None or sync is None:
        return None
    cached = sync.info.get(_NOW_KEY)
    if cached is not None and cached[0] is txn:
        return cached[1]  # type: ignore[no-any-return]
    return None


def now_column(dialect: Dialect) -> tuple[ColumnElement[Any], Callable[[Any], datetime]]:
    """The database clock of :func:`db_now` as a select-list column (labelled
    ``db_now``) and the parser of its value, so a statement can carry the clock with
    its rows (:func:`remember_now`). Built once per backend."""
    return _now_column(strategy_for(dialect))


@functools.cache
def _now_column(
    strategy: DialectStrategy,
) -> tuple[ColumnElement[Any], Callable[[Any], datetime]]:
    if not strategy.now_sql.startswith("SELECT "):
        raise ValueError(f"unexpected clock query {strategy.now_sql!r}")
    column: ColumnElement[Any] = literal_column(strategy.now_sql.removeprefix("SELECT ")).label(
        "db_now"
    )
    return column, strategy.parse_now


# --- column types ----------------------------------------------------------------------


class PayloadTooLargeError(ValueError):
    """A :class:`JsonText` value exceeds the column's documented byte bound."""


class UtcDateTime(TypeDecorator[datetime]):
    """A point in time: aware UTC in Python, naive UTC in the column.

    ``DATETIME(6)`` on MySQL (microseconds), ``DATETIME`` text on SQLite. Binding a naive
    datetime raises ``ValueError``: its time zone would be a guess.
    """

    impl = DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(strategy_for(dialect).datetime_type())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is UTC:
            # The common case (every clock reading and decoded column is UTC-aware):
            # ``astimezone(UTC)`` would return the same instant unchanged.
            return value.replace(tzinfo=None)
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError("naive datetime: pass an aware datetime (UTC)")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


#: What a non-ASCII value is bound as on MySQL-family servers (:class:`AsciiId`): ASCII, so
#: the comparison is legal, and longer than any stored identifier, so it equals none and
#: no INSERT in strict mode can store it ("data too long").
NON_ASCII_ID = "non-ascii-identifier:" + "~" * (ID_LEN + 1 - len("non-ascii-identifier:"))


class AsciiId(TypeDecorator[str]):
    """A machine identifier that joins the runtime's hot rows — runs, steps, attempts,
    checkpoints, records — or an object API name: ASCII by construction (``run_<hex>``,
    ``RECORD_ID_RE``, the catalog's object-name rule), stored as ``VARCHAR(64)
    CHARACTER SET ascii COLLATE ascii_bin`` on MySQL-family servers (ADR 0015), text on
    SQLite.

    One byte per character instead of utf8mb4's four keeps a primary key of ``org_id``
    and one or two such columns under the 512 bytes above which MariaDB's multi-table
    ``UPDATE`` (ADR 0009) keeps its row ids in an on-disk temporary table. Comparison is
    byte-for-byte, as with ``utf8mb4_bin``.

    A value that is not ASCII cannot be a stored identifier, but MariaDB refuses to even
    compare one with an ``ascii`` column (error 1267, "illegal mix of collations"). On
    MySQL-family servers such a value is therefore bound as :data:`NON_ASCII_ID`: a
    lookup by it finds nothing (a run id from a request answers NOT_FOUND, as any unknown
    id does), and an INSERT of it fails as too long instead of storing anything. SQLite
    binds every value as it is.
    """

    impl = String(ID_LEN)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(
                mysql.VARCHAR(ID_LEN, charset="ascii", collation="ascii_bin")
            )
        return dialect.type_descriptor(String(ID_LEN))

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        # Directly, not through process_bind_param: one plain call per bound id on the
        # hot path (the VARCHAR itself has no bind processor on either MySQL driver).
        if dialect.name in ("mysql", "mariadb"):
            return _ascii_or_sentinel
        return None


def _ascii_or_sentinel(value: Any) -> Any:
    return value if value is None or value.isascii() else NON_ASCII_ID


class JsonText(TypeDecorator[str]):
    """Serialized JSON (canonical JSON from ``services.digest``) with an enforced byte bound.

    The storage type holds at least ``max_bytes`` (``TEXT``/``MEDIUMTEXT``/``LONGTEXT`` on
    MySQL, ``TEXT`` on SQLite); binding a larger value raises :class:`PayloadTooLargeError`
    before any SQL is sent.
    """

    impl = Text
    cache_ok = True

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(strategy_for(dialect).text_type(self.max_bytes))

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is not None and len(value.encode("utf-8")) > self.max_bytes:
            raise PayloadTooLargeError(f"JSON value exceeds {self.max_bytes} bytes")
        return value


def outbox_delivery_columns() -> list[Column[Any]]:
    """The delivery-state columns every transactional outbox table carries, so one generic
    dispatcher can serve the Runtime outbox and the effect owner's outbox.

    ``delivery_state`` is the transport lifecycle; ``lease_*`` fence the dispatcher that is
    delivering a row; ``state_version`` is the compare-and-swap version of the row;
    ``trace_context`` carries the producer's trace to the delivery.
    """
    return [
        Column("delivery_state", String(CODE_LEN), nullable=False),
        Column("delivery_attempts", Integer, nullable=False),
        Column("next_attempt_at", UtcDateTime(), nullable=False),
        Column("lease_owner", String(TOKEN_LEN), nullable=True),
        Column("lease_token", String(TOKEN_LEN), nullable=True),
        Column("lease_until", UtcDateTime(), nullable=True),
        Column("last_error_code", String(CODE_LEN), nullable=True),
        Column("delivered_at", UtcDateTime(), nullable=True),
        Column("state_version", BigInteger, nullable=False),
        # The W3C trace context of the enqueuing span (``services.telemetry``): the
        # delivery continues the producer's trace. Diagnostics only — written once, never
        # compared on a duplicate enqueue and never part of a digest.
        Column("trace_context", JsonText(TRACE_CONTEXT_BYTES), nullable=True),
    ]


#: Column names of the trusted Runtime work scope (§10.0), in key order.
WORK_SCOPE = (
    "org_id",
    "app_installation_id",
    "runtime_capability_id",
    "runtime_work_binding_digest",
)


def work_scope_columns() -> list[Column[str]]:
    """Fresh ``org_id, app_installation_id, runtime_capability_id,
    runtime_work_binding_digest`` columns: every dependency/wake match, inbox, dedupe and
    receipt check uses all four (§10.0)."""
    return [
        Column("org_id", String(ID_LEN), nullable=False),
        Column("app_installation_id", String(ID_LEN), nullable=False),
        Column("runtime_capability_id", String(ID_LEN), nullable=False),
        Column("runtime_work_binding_digest", String(DIGEST_LEN), nullable=False),
    ]
