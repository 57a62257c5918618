"""Several writes of one transaction in one round trip (MariaDB/MySQL/TiDB multi-statements).

A durable step on MariaDB is bound by round trips: each statement is a packet out, a wait
and a packet back, and the client's CPU per statement is mostly that exchange (the
driver's socket work and the event loop's), not SQL. Writes whose results the
transaction needs only to *check* — a row count, "no duplicate key" — do not need a
round trip each: :func:`execute_writes` sends them as one multi-statement
(``CLIENT_MULTI_STATEMENTS``, ADR 0010) and reads their results back in order.

Meaning is unchanged, on purpose:

* the statements are the ones the caller would have executed one by one (prebuilt
  constructs, compiled once per shape for the connection's dialect, parameters bound
  and typed by SQLAlchemy's own bind processors — never inlined as literals);
* they run in order in the caller's transaction, and the server stops at the first
  that fails (an error): the ones after it never run, as when executing them one by one.
  A row count that a check refuses (a lost fence) is not an error to the server: the
  statements after it run and are rolled back with the transaction — so batch only
  writes whose existing rows the transaction already holds locked, except the last of
  the round trip, after which nothing runs (ADR 0010 and its addendum);
* an insert whose duplicate is an answer rather than an error
  (:func:`insert_if_absent_write`, :func:`execute_writes_if_absent`) stops the round
  trip there like any error; the call answers ``False``;
* each write's :attr:`Write.check` sees its row count, and a duplicate key raises the
  write's :attr:`Write.on_duplicate`, strictly in statement order — so the first
  failure the sequential code would have met is the one raised, with the same error;
* the round trip goes to the driver's own cursor (``services.db_raw.round_trip``: no
  SQLAlchemy execution context or result object) with what SQLAlchemy's execution does
  around it: its statement events fire once, with every statement joined by
  :data:`BATCH_SEPARATOR`; a driver error is wrapped and a lost connection invalidated
  as for any statement. A single statement takes the same path (one round trip of one).

Elsewhere (SQLite, a statement with Python-side defaults or ``RETURNING``) the writes run
one by one through ``conn.execute`` with the same checks: :func:`execute_writes` is the
one code path for both.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from sqlalchemy import Dialect, Engine, Executable, Table, event
from sqlalchemy.exc import DBAPIError, InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from services.db import (
    BEGIN_MODE_OPTION,
    ROLLED_BACK_AT_COMMIT,
    DbErrorClass,
    FencedWrite,
    classify_db_error,
    fence_lost_error,
    fenced_statement,
    fenced_together,
    insert_statement,
    settle_fenced_together,
    strategy_for,
)
from services.db_mysql import is_reset_aware
from services.db_raw import round_trip
from services.errors import CommitOutcomeUnknownError
from services.invariants import InvariantError

__all__ = [
    "BATCH_SEPARATOR",
    "CARRY_COMMIT_OPTION",
    "Companion",
    "Read",
    "Write",
    "commit_writes",
    "execute_reads",
    "execute_writes",
    "execute_writes_if_absent",
    "fenced_write",
    "fenced_writes",
    "if_absent",
    "insert_if_absent_write",
    "install_batch_hooks",
    "is_if_absent",
    "is_row_guard",
    "row_guard",
    "statements_of",
]

#: Joins the statements of one round trip (what statement listeners see; see
#: :func:`statements_of`).
BATCH_SEPARATOR = ";\n"
#: Ends the SQL of a round trip that carries its transaction's ``COMMIT``
#: (:func:`commit_writes`; not one of its statements for :func:`statements_of`).
_CARRIED_COMMIT = BATCH_SEPARATOR + "COMMIT"
#: Execution option (engine or connection): ``False`` keeps every ``COMMIT`` on its own
#: — for a tool that must hold a transaction between its last write and its ``COMMIT``
#: (the cluster tests' commit gate); the statements are the same either way.
CARRY_COMMIT_OPTION = "nexus_carry_commit"
#: ``CLIENT_MULTI_STATEMENTS`` of the MySQL protocol (the same bit in every driver).
_CLIENT_MULTI_STATEMENTS = 1 << 16
#: :func:`row_guard`'s statement without its count and closing parenthesis (the user
#: variable it assigns is never read).
_ROW_GUARD_SQL = (
    "SET @nexus_row_guard = (SELECT 1 UNION ALL SELECT 2 FROM DUAL WHERE ROW_COUNT() <> "
)


def row_guard(rows: int) -> str:
    """The statement that follows a write of :attr:`Write.rows` in a round trip that
    carries the ``COMMIT`` (ADR 0014): it fails — the scalar subquery returns two rows,
    error 1242 — unless ``ROW_COUNT()``, the server's row count of the statement before
    it (matched rows under ``CLIENT_FOUND_ROWS``, as the client's count), is ``rows``; a
    failing statement stops the server's multi-statement there, before the ``COMMIT``.
    (A ``SET``, not a ``DO``: MariaDB's ``DO`` turns that error into a warning.)"""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise InvariantError(f"a row guard needs a row count, not {rows!r}")
    # An int checked above, never caller text: a literal is safe (and keeps the
    # round trip's parameters those of its writes).
    return _ROW_GUARD_SQL + str(rows) + ")"


def is_row_guard(statement: str) -> bool:
    """``statement`` (one of :func:`statements_of`'s) is a :func:`row_guard`."""
    return statement.startswith(_ROW_GUARD_SQL)


@dataclass(frozen=True)
class Write:
    """One write statement of :func:`execute_writes`."""

    #: A prebuilt ``INSERT``/``UPDATE``/``DELETE`` construct with bound parameters (built
    #: once, e.g. at import: its compiled form is cached by identity).
    statement: Executable
    #: Its parameters, by bind name.
    params: Mapping[str, Any]
    #: Called with the statement's row count, in statement order, before the next
    #: statement's outcome is looked at; raises to fail the transaction (e.g. a fence).
    check: Callable[[int], Awaitable[None]] | None = None
    #: The error a duplicate key in this statement raises (``None``: the driver error).
    on_duplicate: Callable[[], BaseException] | None = None
    #: Told the statement's row count, in statement order, if the statement ran; it only
    #: observes (it cannot refuse, unlike :attr:`check`), so a write with no ``check``
    #: may ride in the round trip that carries the ``COMMIT`` (:func:`commit_writes`).
    observe: Callable[[int], None] | None = None
    #: The one row count :attr:`check` accepts (a fenced ``UPDATE``'s: one per row it
    #: fences), when it accepts exactly one. Declared, the write may ride in the round
    #: trip that carries the ``COMMIT``: a guard statement right after it
    #: (:func:`row_guard`) fails unless the server's ``ROW_COUNT()`` of the write is this
    #: count, so the server stops before the ``COMMIT`` whenever the check would refuse,
    #: and the check then decides on the count as always (ADR 0014).
    rows: int | None = None


@dataclass(frozen=True)
class Read:
    """One ``SELECT`` of :func:`execute_reads`."""

    #: A prebuilt ``SELECT`` construct with bound parameters (built once: its compiled
    #: form is cached by identity).
    statement: Executable
    #: Its parameters, by bind name.
    params: Mapping[str, Any]


@dataclass
class Companion:
    """A read that may ride in the round trip of a read its owner knows comes right
    before it in the lock order (:func:`execute_reads`): whoever sends it fills
    :attr:`rows`; while they are ``None`` the owner runs the read itself."""

    read: Read
    #: The read's rows, once another caller sent it.
    rows: list[Any] | None = None


@dataclass(frozen=True)
class _CompiledRead:
    compiled: _Compiled
    #: Result column key names, in select-list order.
    keys: tuple[str, ...]
    #: Each column's type (its result processor is chosen per the cursor's description).
    types: tuple[Any, ...]
    #: The row type (read by position or by column key).
    row_type: Any
    #: The columns that have a result processor, as ``(position, processor)``, by the
    #: description's type codes (chosen once per shape of result set: the same statement
    #: gets the same codes); a column without one is the driver's value as it is.
    processors: dict[tuple[Any, ...], tuple[tuple[int, Any], ...]] = field(
        default_factory=dict, compare=False, repr=False
    )


@dataclass(frozen=True)
class _Compiled:
    compiled: SQLCompiler
    positions: tuple[str, ...]
    processors: Mapping[str, Callable[[Any], Any]]
    #: Per position: ``(parameter key, None, processor)`` for a value of the caller's
    #: parameters, ``(None, value, None)`` for a bind with a fixed value (already
    #: processed) — what ``construct_params`` and the bind processors make, found once
    #: (:func:`_binder`); ``None``: every execution goes through ``construct_params``.
    binder: tuple[tuple[str | None, Any, Callable[[Any], Any] | None], ...] | None = None


#: Per dialect (an engine's: its server flags shape the SQL), per statement and parameter
#: names: the compiled form, or ``None`` for a statement that must run on its own.
_COMPILED: weakref.WeakKeyDictionary[
    Dialect, dict[tuple[Executable, frozenset[str]], _Compiled | None]
] = weakref.WeakKeyDictionary()


def statements_of(sql: str) -> list[str]:
    """The statements one cursor execution sent (several for a batched round trip); the
    ``COMMIT`` a round trip carries (:func:`commit_writes`) is not one of them, as the
    frame's own ``COMMIT`` is no statement to SQLAlchemy's events."""
    return sql.removesuffix(_CARRIED_COMMIT).split(BATCH_SEPARATOR)


def install_batch_hooks(engine: Engine) -> None:
    """Let ``engine``'s connections run multi-statements (MySQL-protocol backends only)."""

    @event.listens_for(engine, "do_connect")
    def _multi_statements(
        _dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]
    ) -> None:
        # OR'ed into the flags the dialect chose (FOUND_ROWS: fences count matched rows).
        cparams["client_flag"] = int(cparams.get("client_flag", 0)) | _CLIENT_MULTI_STATEMENTS


async def execute_reads(
    conn: AsyncConnection, reads: Sequence[Read], *, commit: bool = False
) -> list[list[Any]]:
    """The rows of each of ``reads``, run in order in ``conn``'s transaction — in one
    round trip where the backend runs multi-statements, one by one elsewhere.

    ``commit``: the reads are the last statements of a read-only transaction
    (``services.db.transaction(readonly=True)``, e.g. claim discovery): their round trip
    carries its ``COMMIT`` where the backend allows, as :func:`commit_writes` does for
    writes (ADR 0013). Nothing was written, so every failure is raised as the read's own
    and nothing is left in doubt; in a transaction that may have written, the frame
    commits as usual.

    Meant for locking reads that follow each other in the lock order anyway (a step's
    business row, then its lifecycle rows): the server runs them in order, so the locks
    are taken in the same order as by separate statements, and a failing statement
    stops the ones after it. The rows are typed as SQLAlchemy types them (each column's
    result processor, chosen from the statement's compiled form and the cursor's
    description) and read by position or by column key, like a ``Row``.

    Raises:
        The driver error (wrapped by SQLAlchemy) of the first statement that failed.
    """
    batched = _read_batch(conn.dialect, reads)
    if batched is None:
        return [list(await conn.execute(r.statement, dict(r.params))) for r in reads]
    sql, params, compiled = batched
    carries = commit and _read_only(conn) and _can_carry(conn)
    if carries:
        sql += _CARRIED_COMMIT
    results: list[tuple[Any, list[Any], int]] = []
    await round_trip(conn, sql, params, len(reads), results, carries_commit=carries)
    if len(results) != len(reads):  # pragma: no cover - round_trip reads every set
        raise InvariantError("a batched read returned fewer result sets than statements")
    return [
        _typed(conn.dialect, read, description, rows)
        for read, (description, rows, _) in zip(compiled, results, strict=True)
    ]


def _read_batch(
    dialect: Dialect, reads: Sequence[Read]
) -> tuple[str, list[Any], list[_CompiledRead]] | None:
    if not reads or not strategy_for(dialect).multi_statements:
        return None
    parts: list[str] = []
    params: list[Any] = []
    compiled: list[_CompiledRead] = []
    for read in reads:
        found = _compiled_read(dialect, read)
        if found is None:
            return None
        compiled.append(found)
        parts.append(found.compiled.compiled.string)
        params.extend(_bound(Write(read.statement, read.params), found.compiled))
    return BATCH_SEPARATOR.join(parts), params, compiled


#: Per dialect, per statement and parameter names: a read's compiled form and its result
#: columns (``None``: the statement must run on its own).
_COMPILED_READS: weakref.WeakKeyDictionary[
    Dialect, dict[tuple[Executable, frozenset[str]], _CompiledRead | None]
] = weakref.WeakKeyDictionary()


def _compiled_read(dialect: Dialect, read: Read) -> _CompiledRead | None:
    cache = _COMPILED_READS.get(dialect)
    if cache is None:
        cache = _COMPILED_READS[dialect] = {}
    cache_key = (read.statement, frozenset(read.params))
    if cache_key in cache:
        return cache[cache_key]
    base = _compiled(dialect, Write(read.statement, read.params))
    found: _CompiledRead | None = None
    if base is not None:
        compiler = base.compiled
        columns = compiler._result_columns
        keys = tuple(c.keyname for c in columns)
        if (
            not (compiler.isinsert or compiler.isupdate or compiler.isdelete)
            and keys
            # Read by key like a Row: every key a distinct public identifier (otherwise
            # the statement runs on its own, through SQLAlchemy's own rows).
            and len(set(keys)) == len(keys)
            and all(k.isidentifier() and not k.startswith("_") for k in keys)
        ):
            found = _CompiledRead(
                compiled=base,
                keys=keys,
                types=tuple(c.type for c in columns),
                row_type=_row_type(keys),
            )
    cache[cache_key] = found
    return found


def _typed(dialect: Dialect, read: _CompiledRead, description: Any, rows: list[Any]) -> list[Any]:
    if not rows:
        return []
    if description is None or len(description) != len(read.keys):
        raise InvariantError("a batched read's result set does not match its statement")
    codes = tuple(map(_TYPE_CODE, description))
    processed = read.processors.get(codes)
    if processed is None:
        processed = read.processors[codes] = tuple(
            (position, processor)
            for position, (t, code) in enumerate(zip(read.types, codes, strict=True))
            if (processor := t._cached_result_processor(dialect, code)) is not None
        )
    make = read.row_type._make
    if not processed:
        return [make(raw) for raw in rows]
    typed = []
    for raw in rows:
        values = list(raw)
        for position, processor in processed:
            values[position] = processor(values[position])
        typed.append(make(values))
    return typed


#: A description entry's type code (its second item).
_TYPE_CODE = operator.itemgetter(1)


@functools.cache
def _row_type(keys: tuple[str, ...]) -> Any:
    """A tuple type read by position or by column key (as a ``Row``)."""
    return collections.namedtuple("BatchedRow", keys)


def _compiled(dialect: Dialect, write: Write) -> _Compiled | None:
    keys = frozenset(write.params)
    cache_key = (write.statement, keys)
    cache = _COMPILED.get(dialect)
    if cache is None:
        cache = _COMPILED[dialect] = {}
    if cache_key in cache:
        return cache[cache_key]
    statement = cast(ClauseElement, write.statement)
    compiled = statement.compile(dialect=dialect, column_keys=sorted(keys))
    found: _Compiled | None = None
    if (
        isinstance(compiled, SQLCompiler)
        and compiled.positiontup is not None
        # Python-side defaults and RETURNING need SQLAlchemy's execution context; an
        # expanding IN is rendered per execution: such statements run on their own.
        and not compiled.insert_prefetch
        and not compiled.update_prefetch
        and not compiled.effective_returning
        and not compiled.literal_execute_params
        and not compiled.post_compile_params
    ):
        positions = tuple(compiled.positiontup)
        processors = {
            name: cast(Callable[[Any], Any], processor)
            for name, processor in compiled._bind_processors.items()
        }
        found = _Compiled(
            compiled=compiled,
            positions=positions,
            processors=processors,
            binder=_binder(compiled, keys, positions, processors),
        )
    cache[cache_key] = found
    return found


class _Key:
    """Stands for the caller's parameter ``key`` in :func:`_binder`'s probe."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _binder(
    compiled: SQLCompiler,
    keys: frozenset[str],
    positions: tuple[str, ...],
    processors: Mapping[str, Callable[[Any], Any]],
) -> tuple[tuple[str | None, Any, Callable[[Any], Any] | None], ...] | None:
    """Where each position's value comes from, found by running ``construct_params`` once
    on stand-ins for the caller's parameters: a stand-in that comes back names the key
    the position takes (then its bind processor runs per execution); any other value is
    the bind's own fixed value (processed here, once). ``None`` — construct_params per
    execution — for a bind whose value a function computes each time, or one it refuses
    without a value (the execution then raises its error)."""
    if any(bind.callable is not None for bind in compiled.binds.values()):
        return None
    try:
        probed = compiled.construct_params({key: _Key(key) for key in keys})
    except InvalidRequestError:  # a required bind without a value (see above)
        return None
    binder: list[tuple[str | None, Any, Callable[[Any], Any] | None]] = []
    for name in positions:
        value, processor = probed[name], processors.get(name)
        if isinstance(value, _Key):
            binder.append((value.key, None, processor))
        else:
            binder.append((None, value if processor is None else processor(value), None))
    return tuple(binder)


def _bound(write: Write, compiled: _Compiled) -> list[Any]:
    """The statement's DBAPI parameters, as SQLAlchemy's execution context makes them
    (``construct_params``, then each bind's type processor, in position order) — from
    the compiled form's :attr:`_Compiled.binder` where it has one."""
    params = write.params
    binder = compiled.binder
    if binder is None:
        values = compiled.compiled.construct_params(dict(params))
        processors = compiled.processors
        return [
            processors[name](values[name]) if name in processors else values[name]
            for name in compiled.positions
        ]
    bound: list[Any] = []
    for key, fixed, processor in binder:
        if key is None:
            bound.append(fixed)
        elif processor is None:
            bound.append(params[key])
        else:
            bound.append(processor(params[key]))
    return bound


async def execute_writes(conn: AsyncConnection, writes: Sequence[Write]) -> list[int]:
    """Execute ``writes`` in order in ``conn``'s transaction and return their row counts
    — in one round trip where the backend runs multi-statements, one by one elsewhere;
    checks and duplicate-key errors are decided in statement order on both paths (see
    the module docstring).

    Raises:
        Whatever a write's ``check`` or ``on_duplicate`` raises, or the driver error
        (wrapped by SQLAlchemy) of the first statement that failed.
    """
    return await _execute(conn, writes, commit=False)


async def commit_writes(
    conn: AsyncConnection,
    writes: Sequence[Write],
    *,
    before_commit: Callable[[], None] | None = None,
) -> list[int]:
    """:func:`execute_writes` of the transaction's **last** writes — and its ``COMMIT`` in
    the same round trip where the backend runs multi-statements and every write's
    :attr:`Write.check` is decided on the server before the ``COMMIT`` (ADR 0013): a
    write without one, or one that declares the row count its check accepts
    (:attr:`Write.rows`: a :func:`row_guard` follows it, ADR 0014); a write with any
    other check must see its row count before anything commits, so it keeps the frame's
    ``COMMIT``. The transaction frame's ``COMMIT`` then sends nothing; a
    statement on ``conn`` before the frame ends the transaction raises an
    ``InvariantError`` (it would run outside the committed transaction), and so does the
    frame when the caller raises after this call returned. Elsewhere this is
    :func:`execute_writes` and the frame commits as usual.

    The server runs the ``COMMIT`` only if every write before it succeeded: a failed
    write raises as from :func:`execute_writes`, nothing committed, the transaction still
    open (e.g. :func:`execute_writes_if_absent`'s duplicate). A ``COMMIT`` that fails
    raises what the frame's own would: its error when the server proved the rollback
    (``services.db.ROLLED_BACK_AT_COMMIT``: a deadlock or certification failure is then
    retried whole by ``run_in_transaction``), else ``CommitOutcomeUnknownError``; and a
    connection lost during this round trip is ``CommitOutcomeUnknownError`` too (the
    server may have committed) — the connection is then invalidated, never reused.

    ``before_commit``: called once, right before the ``COMMIT`` goes out — before the
    round trip that carries it (whatever the server then answers), or (not carried)
    after the writes ran and passed their checks, never after a write that failed — for
    a named crash point: "the transaction's work is decided, its ``COMMIT`` not sent".

    Raises:
        CommitOutcomeUnknownError: see above.
        InvariantError: a row guard refused a row count its write's check accepted.
        The errors of :func:`execute_writes`.
    """
    return await _execute(conn, writes, commit=True, before_commit=before_commit)


def _carriable(write: Write) -> bool:
    """``write`` may ride in the round trip that carries the ``COMMIT``: its check (if
    any) is decided on the server first (:attr:`Write.rows`)."""
    return write.check is None or write.rows is not None


async def _execute(
    conn: AsyncConnection,
    writes: Sequence[Write],
    *,
    commit: bool,
    before_commit: Callable[[], None] | None = None,
    then: Companion | None = None,
) -> list[int]:
    # ``then`` (execute_writes_if_absent's): a read riding after the writes — never after
    # a COMMIT, and only where they share a round trip.
    carries = commit and all(_carriable(w) for w in writes) and _can_carry(conn)
    batched = _batch(conn.dialect, writes, guarded=carries)
    read: _CompiledRead | None = None
    if batched is not None and then is not None and not commit:
        read = _compiled_read(conn.dialect, then.read)
        if read is not None:
            sql, params, positions, statements = batched
            params = [*params, *_bound(Write(then.read.statement, then.read.params), read.compiled)]
            batched = (
                sql + BATCH_SEPARATOR + read.compiled.compiled.string,
                params,
                positions,
                statements + 1,
            )
    if batched is None:
        counts: list[int] = []
        for write in writes:
            try:
                result = await conn.execute(write.statement, dict(write.params))
            except DBAPIError as exc:
                _raise_mapped(write, exc)
            counts.append(result.rowcount)
            if write.observe is not None:
                write.observe(result.rowcount)
            if write.check is not None:
                await write.check(result.rowcount)
        if before_commit is not None:
            before_commit()
        return counts
    sql, params, positions, statements = batched
    if carries:
        sql += _CARRIED_COMMIT
        if before_commit is not None:
            before_commit()
    results: list[tuple[Any, list[Any], int]] = []
    failure: DBAPIError | None = None
    try:
        await round_trip(conn, sql, params, statements, results, carries_commit=carries)
    except DBAPIError as exc:
        if exc.connection_invalidated:
            if carries:
                raise CommitOutcomeUnknownError(
                    "connection lost during the round trip that carried COMMIT"
                ) from exc
            # The connection is gone (outcome unknown to this transaction): no check may
            # run another statement on it, and nothing else is worth reporting.
            raise
        failure = exc
    ran = len(results)
    rowcounts = [results[p][2] for p in positions if p < ran]
    for write, count in zip(writes, rowcounts, strict=False):
        if write.observe is not None:
            write.observe(count)
        if write.check is not None:
            await write.check(count)
    if failure is not None:
        if ran >= statements:  # the error came after every result (not a statement's)
            if carries:  # the COMMIT's own
                await _commit_failed(conn, failure)
            raise failure
        if ran in positions:
            _raise_mapped(writes[positions.index(ran)], failure)
        if read is not None and ran == statements - 1:
            raise failure  # the riding read's own (e.g. a lock wait timeout), not a write's
        # A row guard stopped the round trip, and its write's check accepted the count.
        raise InvariantError(
            f"a row guard refused the row count {rowcounts[-1]} that its write's check accepted"
        ) from failure
    if read is not None and then is not None:
        # Every write ran and passed its check: the read ran after them (the last set).
        description, rows, _ = results[-1]
        then.rows = _typed(conn.dialect, read, description, rows)
    if not carries and commit and before_commit is not None:
        before_commit()
    return rowcounts


def _read_only(conn: AsyncConnection) -> bool:
    """``conn`` is a ``services.db.transaction(readonly=True)``."""
    sync = conn.sync_connection
    return sync is not None and sync.get_execution_options().get(BEGIN_MODE_OPTION) == "DEFERRED"


def _can_carry(conn: AsyncConnection) -> bool:
    sync = conn.sync_connection
    return (
        sync is not None
        and is_reset_aware(sync.connection.dbapi_connection)
        and sync.get_execution_options().get(CARRY_COMMIT_OPTION, True) is not False
    )


async def _commit_failed(conn: AsyncConnection, failure: DBAPIError) -> None:
    """Raise what the frame's own failed ``COMMIT`` raises (``services.db.transaction``)."""
    kind = classify_db_error(failure)
    if kind in ROLLED_BACK_AT_COMMIT:
        raise failure  # the frame rolls back (a no-op now); a conflict is retried whole
    # Its session may still hold the transaction (or be gone): never reused.
    with contextlib.suppress(Exception):
        await conn.invalidate()
    raise CommitOutcomeUnknownError("commit failed without a proven rollback") from failure


def fenced_writes(
    conn: AsyncConnection, writes: Sequence[FencedWrite], *, together: bool
) -> list[Write]:
    """``services.db.fenced_updates(conn, writes)`` as writes of a batch: one multi-table
    ``UPDATE`` where it would be one and ``together`` (every row already held), else one
    ``UPDATE`` each, in order — with the checks that decide them there (the first lost
    fence raises the same error)."""
    combined = fenced_together(conn.dialect, writes) if together else None
    if combined is not None:
        statement, params = combined

        async def settle(rowcount: int) -> None:
            await settle_fenced_together(conn, writes, rowcount)

        return [Write(statement, params, check=settle, rows=len(writes))]
    return [fenced_write(conn, w) for w in writes]


def fenced_write(conn: AsyncConnection, write: FencedWrite) -> Write:
    """``services.db.fenced_update`` of ``write`` as a write of a batch: its row-count
    check raises the same :class:`~services.errors.FenceLostError`."""
    return Write(fenced_statement(write), write.params(), check=_one_row(conn, write), rows=1)


class _Present(Exception):
    """The duplicate key of an :func:`insert_if_absent_write` (caught by
    :func:`execute_writes_if_absent`)."""


def insert_if_absent_write(table: Table, values: Mapping[str, Any]) -> Write:
    """``services.db.insert_if_absent(conn, table, values)`` as a write of
    :func:`execute_writes_if_absent`: a duplicate on any unique key is not an error
    there but the answer ``False``."""
    return Write(insert_statement(table), values, on_duplicate=_Present)


def if_absent(write: Write) -> Write:
    """``write`` (a prebuilt single-row ``INSERT``) as the insert-if-absent of
    :func:`execute_writes_if_absent`, like :func:`insert_if_absent_write`."""
    return Write(
        write.statement, write.params, check=write.check, on_duplicate=_Present, rows=write.rows
    )


def is_if_absent(write: Write) -> bool:
    """``write`` is an :func:`insert_if_absent_write`."""
    return write.on_duplicate is _Present


async def execute_writes_if_absent(
    conn: AsyncConnection,
    writes: Sequence[Write],
    *,
    commit: bool = False,
    then: Companion | None = None,
) -> bool:
    """:func:`execute_writes` with one :func:`insert_if_absent_write` among ``writes``:
    ``False`` when its row was already there — the writes before it ran and passed their
    checks, the ones after it did not run (the server stops at the duplicate, as the
    statements one by one would), and the transaction stays usable (only the failed
    statement is rolled back: ``services.db.insert_if_absent``).

    ``commit``: the writes are the transaction's last if they all run — sent as by
    :func:`commit_writes`, whose ``COMMIT`` the server does not reach when the duplicate
    stops the round trip (the transaction then goes on, uncommitted, as above).

    ``then``: a read the caller knows comes right after these writes in its lock order
    (a durable step's lifecycle locking read after its created record and history row,
    ADR 0016): where the backend runs multi-statements, it rides after the writes in
    their round trip — the server runs it only once every write ran — and its rows are
    set on it once every write's check passed; elsewhere, with ``commit``, or when a
    duplicate stopped the writes, it is left unsent (its rows stay ``None``) and the
    caller runs it itself.

    Raises:
        ValueError: not exactly one of ``writes`` is an :func:`insert_if_absent_write`.
    """
    if sum(1 for w in writes if is_if_absent(w)) != 1:
        raise ValueError("execute_writes_if_absent needs exactly one insert_if_absent_write")
    try:
        await _execute(conn, writes, commit=commit, then=then)
    except _Present:
        return False
    return True


def _one_row(conn: AsyncConnection, write: FencedWrite) -> Callable[[int], Awaitable[None]]:
    async def check(rowcount: int) -> None:
        if rowcount != 1:
            raise await fence_lost_error(conn, write)

    return check


def _raise_mapped(write: Write, exc: DBAPIError) -> NoReturn:
    if write.on_duplicate is not None and classify_db_error(exc) is DbErrorClass.DUPLICATE_KEY:
        raise write.on_duplicate() from exc
    raise exc


def _batch(
    dialect: Dialect, writes: Sequence[Write], *, guarded: bool
) -> tuple[str, list[Any], list[int], int] | None:
    """The round trip's SQL, its parameters, each write's statement position and the
    number of statements — ``guarded``: a :func:`row_guard` after each write that
    declares :attr:`Write.rows`."""
    if not writes or not strategy_for(dialect).multi_statements:
        return None
    parts: list[str] = []
    params: list[Any] = []
    positions: list[int] = []
    for write in writes:
        compiled = _compiled(dialect, write)
        if compiled is None:
            return None
        positions.append(len(parts))
        parts.append(compiled.compiled.string)
        params.extend(_bound(write, compiled))
        if guarded and write.rows is not None:
            parts.append(row_guard(write.rows))
    return BATCH_SEPARATOR.join(parts), params, positions, len(parts)
