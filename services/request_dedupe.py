"""Deduplication of mutating RPCs on ``(complete trusted scope, RPC, request_id)``.

The proto contract of every service: a mutating request carries a ``request_id`` the
client generates once per logical operation and repeats on every retry. The server

* answers a retry with the **original response** (the bytes it sent, or would have sent,
  the first time) — never a re-execution that could see newer state;
* refuses the same ``request_id`` with a **different body** with ``INVALID_ARGUMENT``
  (reason ``request_id_reused``, field ``request_id``);
* keys both by the caller's complete trusted scope — org, app installation, runtime
  capability and binding digest as the verified credential carries them (``""`` for a
  component it does not carry) — so two installations of one org can reuse an id
  without seeing each other (§10.0).

One mechanism serves every service:

1. **Schema.** Each service adds one table to its ``MetaData`` with
   :func:`request_dedupe_table` (its Alembic revision creates the same columns) and keeps
   one :class:`RequestLedger` over it.
2. **Key.** A servicer builds :meth:`RequestKey.of` from the trusted scope, the RPC name
   and the request message (``request_id`` validated, the body digested without it).
3. **Single-transaction mutations** (most RPCs) call :meth:`RequestLedger.execute` — or,
   inside a transaction they already own, :meth:`RequestLedger.execute_txn` — with a
   ``work(conn)`` function and an ``encode(value) -> bytes`` function. The ledger row
   (request digest + serialized response) is inserted in the *same* transaction as the
   mutation, so a lost commit response and its retry can never both apply (STYLE 8: the
   dedupe row is the outcome marker). A concurrent duplicate loses the insert race,
   rolls back whole and replays the winner.
4. **Multi-transaction operations** (a remote call or a long wait between transactions;
   the operation must itself be idempotent) call :meth:`RequestLedger.reserve` first —
   it records the body digest so a different body is refused before any side effect, and
   returns a stored response to replay — then do their work and finish with
   :meth:`RequestLedger.complete`; the first completed response is the original one.
   :meth:`RequestLedger.once` does all three and releases the reservation when the
   operation fails, so a refused request leaves no row.
   A mutation may also record a *provisional* response in its own transaction
   (``execute(..., completed=False)``) and complete it later (``StartRun``: accepted in
   one transaction, terminal result after the synchronous execution).
   A mutation whose response is known before its last writes run (it answers with what
   it is about to insert) may put the ledger row's INSERT *last in that round trip*
   (:meth:`RequestLedger.execute_joined_at`, :class:`JoinedRecord`; ADR 0010): the row
   counts as recorded only when its statement ran, otherwise it is recorded after the
   work as usual.
5. **Retention.** Rows older than the service's request-retention window
   (``FLOW_REQUEST_RETENTION_HOURS``) are purged in bounded batches, org by org in
   rotation, by a :class:`services.request_retention.RequestRetention` loop each service
   runs in its background group (:mod:`services.background`). A retry after the window
   is a new request.

Responses are stored as the serialized response message (base64 text, at most
:data:`MAX_RESPONSE_BYTES`); errors are never stored: a request that failed is executed
again on retry (it changed nothing).

Usage in a servicer::

    key = RequestKey.of(DedupeScope.of_identity(current_identity()), "DeleteRun", request)
    done = await ledger.execute(engine, key, work, lambda v: to_proto(v).SerializeToString())
    return done.message(runtime_v1.DeleteRunResponse)
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from sqlalchemy import (
    Boolean,
    Column,
    ColumnElement,
    Index,
    MetaData,
    PrimaryKeyConstraint,
    Row,
    Select,
    String,
    Table,
    and_,
    bindparam,
    delete,
    false,
    insert,
    literal_column,
    select,
    update,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.db import (
    DIGEST_LEN,
    ID_LEN,
    KEY_LEN,
    TABLE_OPTIONS,
    WORK_SCOPE,
    JsonText,
    UtcDateTime,
    db_now,
    insert_prepared,
    now_column,
    remember_now,
    run_in_transaction,
    transaction,
    work_scope_columns,
)
from services.db_batch import Read, Write, execute_reads
from services.digest import versioned_digest
from services.errors import ConflictError, FailedPreconditionError, InvalidArgumentError
from services.invariants import InvariantError

__all__ = [
    "MAX_REQUEST_ID_LEN",
    "MAX_RESPONSE_BYTES",
    "DedupeScope",
    "Deduplicated",
    "DuplicateRequestRace",
    "JoinedRecord",
    "LookupColumn",
    "RequestIdReusedError",
    "RequestKey",
    "RequestLedger",
    "StoredResponse",
    "request_dedupe_table",
    "request_digest",
]

T = TypeVar("T")
M = TypeVar("M", bound=Message)

log = logging.getLogger(__name__)


class LookupColumn(Protocol):
    """A scalar read another part of the same transaction needs, selected by the
    ledger's clocked lookup (:meth:`RequestLedger.execute_at_txn`) instead of by a
    statement of its own: the lookup is the transaction's first statement, so the value
    is read in the same transaction, before any write of it (the before-save trigger
    admission's activation read, ``runtime_svc.embedded``)."""

    #: Names the column's statement shape: the lookup statement with it is built once
    #: per dialect and key (its values are bound parameters, :meth:`params`).
    key: str

    def column(self, dialect: Dialect) -> ColumnElement[Any]:
        """The scalar column (a labelled scalar subquery with bound parameters)."""
        ...

    def params(self) -> Mapping[str, Any]:
        """The column's bound values (names distinct from the ledger's ``k_*``)."""
        ...

    def accept(self, value: Any) -> None:
        """Take the value the lookup read (called once per transaction attempt)."""
        ...


#: Longest accepted ``request_id`` (the column width).
MAX_REQUEST_ID_LEN = KEY_LEN
#: Largest response that can be recorded (base64 in a 16 MiB text column). A gRPC
#: message is bounded far below it by ``FLOW_GRPC_MAX_MESSAGE_BYTES``.
MAX_RESPONSE_BYTES = 12 * 1024 * 1024
_STORED_RESPONSE_BYTES = 16 * 1024 * 1024
#: A concurrent duplicate can only lose the insert race once: the retry reads the winner.
_RACE_ATTEMPTS = 3


def request_dedupe_table(metadata: MetaData, name: str) -> Table:
    """The dedupe table of one service, added to its schema ``metadata``.

    Columns: the four work-scope columns (``""`` for a component the credential does not
    carry), ``rpc_name``, ``request_id``, ``request_digest`` (body without the id),
    ``response_payload`` (base64 of the serialized response; NULL while only reserved),
    ``completed`` (False while reserved or provisional), ``created_at`` (the retention
    anchor). Primary key: scope, RPC, request id; index ``(org_id, created_at)`` for the
    retention purge.
    """
    return Table(
        name,
        metadata,
        *work_scope_columns(),
        Column("rpc_name", String(ID_LEN), nullable=False),
        Column("request_id", String(KEY_LEN), nullable=False),
        Column("request_digest", String(DIGEST_LEN), nullable=False),
        Column("response_payload", JsonText(_STORED_RESPONSE_BYTES), nullable=True),
        Column("completed", Boolean, nullable=False),
        Column("created_at", UtcDateTime(), nullable=False),
        PrimaryKeyConstraint(*WORK_SCOPE, "rpc_name", "request_id"),
        Index(f"ix_{name}_created", "org_id", "created_at"),
        **TABLE_OPTIONS,
    )


class _ScopeComponents(Protocol):
    def scope_components(self) -> Mapping[str, str | None]: ...


class _WorkScope(Protocol):
    @property
    def org_id(self) -> str: ...
    @property
    def app_installation_id(self) -> str: ...
    @property
    def runtime_capability_id(self) -> str: ...
    @property
    def runtime_work_binding_digest(self) -> str: ...


@dataclass(frozen=True, slots=True)
class DedupeScope:
    """The trusted scope a request is deduplicated in (``""`` = not carried)."""

    org_id: str
    app_installation_id: str = ""
    runtime_capability_id: str = ""
    runtime_work_binding_digest: str = ""

    def __post_init__(self) -> None:
        if not self.org_id:
            raise ValueError("a dedupe scope needs the trusted org")

    @classmethod
    def of_identity(cls, identity: _ScopeComponents) -> DedupeScope:
        """Every scope component the verified credential carries
        (``services.auth.TrustedIdentity``)."""
        parts = identity.scope_components()
        return cls(**{name: parts.get(name) or "" for name in WORK_SCOPE})

    @classmethod
    def of_work_scope(cls, scope: _WorkScope) -> DedupeScope:
        """A complete trusted work scope (``TrustedRuntimeWorkScope`` and its twins)."""
        return cls(*(str(getattr(scope, name)) for name in WORK_SCOPE))

    def values(self) -> dict[str, str]:
        """The four scope columns of a row."""
        return {name: getattr(self, name) for name in WORK_SCOPE}


def request_digest(rpc: str, request: Message, *, id_field: str = "request_id") -> str:
    """Digest of ``request`` without its ``request_id``: two requests are "the same" when
    this matches (field presence and values, not the wire bytes)."""
    body = type(request)()
    body.CopyFrom(request)
    body.ClearField(id_field)
    as_dict = json_format.MessageToDict(body, preserving_proto_field_name=True)
    return versioned_digest("rpc_request", {"rpc": rpc, "body": as_dict})


@dataclass(frozen=True, slots=True)
class RequestKey:
    """Identity of one logical request plus the digest of its body."""

    scope: DedupeScope
    rpc: str
    request_id: str
    request_digest: str

    @classmethod
    def of(
        cls,
        scope: DedupeScope,
        rpc: str,
        request: Message,
        *,
        id_field: str = "request_id",
    ) -> RequestKey:
        """The key of a decoded request message.

        Raises:
            InvalidArgumentError: ``request_id`` is empty or longer than
                :data:`MAX_REQUEST_ID_LEN` (``field_path`` names it).
        """
        request_id = getattr(request, id_field)
        if not isinstance(request_id, str) or not request_id.strip():
            raise InvalidArgumentError(
                f"{id_field} is required", reason="missing_field", field_path=id_field
            )
        if len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidArgumentError(
                f"{id_field} must be at most {MAX_REQUEST_ID_LEN} characters",
                reason="out_of_range",
                field_path=id_field,
            )
        return cls(scope, rpc, request_id, request_digest(rpc, request, id_field=id_field))


class RequestIdReusedError(InvalidArgumentError):
    """The ``request_id`` was used before for a request with a different body."""

    reason = "request_id_reused"

    def __init__(self) -> None:
        super().__init__(
            "request_id was already used for a different request; a retry must repeat "
            "the request unchanged, a new request needs a new request_id",
            field_path="request_id",
        )


class DuplicateRequestRace(ConflictError):
    """A concurrent transaction recorded the same request first: roll back and replay.

    :meth:`RequestLedger.execute` handles it; a caller of
    :meth:`RequestLedger.execute_txn` retries its whole transaction on it.
    """

    reason = "request_in_flight"

    def __init__(self, key: RequestKey) -> None:
        super().__init__(
            "the same request is being applied concurrently; retry it",
            entity=key.rpc,
            key=key.request_id,
        )


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """What the ledger holds for a key.

    Attributes:
        payload: the recorded response bytes; ``None`` while the request is only
            reserved (its operation has not completed yet).
        completed: ``False`` while reserved or holding a provisional response.
    """

    payload: bytes | None
    completed: bool


@dataclass(frozen=True, slots=True)
class Deduplicated(Generic[T]):
    """The outcome of a deduplicated request.

    Attributes:
        value: the fresh result of the work; ``None`` when replayed.
        response: the response bytes to answer with (fresh or replayed); ``None`` only
            when the encoder declined (an outcome the service raises after the commit).
        replayed: the response came from the ledger.
        completed: the recorded response is final (``False``: provisional).
    """

    value: T | None
    response: bytes | None
    replayed: bool = False
    completed: bool = True

    def message(self, cls: type[M]) -> M:
        """The response parsed as ``cls``.

        Raises:
            ValueError: no response (the encoder declined).
        """
        if self.response is None:
            raise ValueError("no response was recorded for this request")
        msg = cls()
        msg.ParseFromString(self.response)
        return msg


def _stored(row: Row[Any, Any, Any], key: RequestKey) -> StoredResponse:
    if row.request_digest != key.request_digest:
        raise RequestIdReusedError()
    payload = None if row.response_payload is None else base64.b64decode(row.response_payload)
    return StoredResponse(payload, bool(row.completed))


def _encode(response: bytes) -> str:
    if len(response) > MAX_RESPONSE_BYTES:
        raise FailedPreconditionError(
            f"the response exceeds {MAX_RESPONSE_BYTES} bytes and cannot be recorded",
            reason="response_too_large",
        )
    return base64.b64encode(response).decode("ascii")


class JoinedRecord(Generic[T]):
    """The ledger row of a new request as a write of the work's own last round trip
    (:meth:`RequestLedger.execute_joined_at`).

    The work calls :meth:`write` with the value it will return *if* the round trip that
    carries the write runs through (a new row it is about to insert answers the request),
    and puts the write last in that round trip (``services.db_batch.execute_writes``). The
    write's row count tells the ledger whether it ran: if the round trip stopped before it
    (an insert-if-absent found its row) or the work never executed it, the ledger records
    the value the work returns after the work, as :meth:`RequestLedger.execute_at` does. A
    concurrent duplicate's row makes the write raise :class:`DuplicateRequestRace` (the
    transaction rolls back and replays the winner).
    """

    __slots__ = ("_completed", "_encode", "_key", "_ledger", "_now", "_pending", "_ran")

    def __init__(
        self,
        ledger: RequestLedger,
        key: RequestKey,
        encode: Callable[[T], bytes | None],
        completed: bool | Callable[[T], bool],
        now: datetime,
    ) -> None:
        self._ledger, self._key, self._encode = ledger, key, encode
        self._completed, self._now = completed, now
        self._pending: tuple[T, bytes, bool] | None = None
        self._ran = False

    def write(self, value: T) -> Write | None:
        """The INSERT recording ``value``'s response (``None``: the encoder declined, so
        nothing is recorded for it). Only the last call's write counts."""
        self._pending, self._ran = None, False
        response = self._encode(value)
        if response is None:
            return None
        final = self._completed(value) if callable(self._completed) else self._completed
        self._pending = (value, response, final)
        key = self._key

        def ran(rowcount: int) -> None:
            self._ran = rowcount == 1

        return Write(
            self._ledger._insert,
            self._ledger._row(key, response, final, self._now),
            on_duplicate=lambda: DuplicateRequestRace(key),
            observe=ran,
        )

    def recorded(self, value: T) -> Deduplicated[T] | None:
        """The outcome when the write ran (``value`` must be the one it recorded), else
        ``None``.

        Raises:
            InvariantError: the write ran for another value than the work returned.
        """
        if not self._ran or self._pending is None:
            return None
        written, response, final = self._pending
        if written is not value:
            raise InvariantError("the ledger recorded another response than the work returned")
        return Deduplicated(value, response, completed=final)


class RequestLedger:
    """Reads and writes one service's dedupe table (see the module docstring).

    Args:
        table: the table built by :func:`request_dedupe_table`.
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        t = table
        # The hot statements (lookup and insert of every deduplicated write) are built
        # once with bound parameters (``k_*``: the key; see :func:`_key_params`).
        where = [t.c[name] == bindparam(f"k_{name}") for name in WORK_SCOPE]
        where += [t.c.rpc_name == bindparam("k_rpc"), t.c.request_id == bindparam("k_request")]
        self._where = where
        self._lookup = select(t.c.request_digest, t.c.response_payload, t.c.completed).where(*where)
        self._insert = insert(t)
        self._complete = (
            update(t)
            .where(*where, t.c.completed == false())
            .values(response_payload=bindparam("v_payload"), completed=bindparam("v_completed"))
        )
        self._release = delete(t).where(
            *where, t.c.request_digest == bindparam("k_digest"), t.c.response_payload.is_(None)
        )
        #: :meth:`lookup_clocked_txn`'s statement per dialect name (its clock SQL differs),
        #: and per (dialect name, ``LookupColumn.key``) with that column added.
        self._clocked: dict[str | tuple[str, str], Select[Any]] = {}

    @staticmethod
    def _key_params(key: RequestKey) -> dict[str, Any]:
        params: dict[str, Any] = {f"k_{name}": getattr(key.scope, name) for name in WORK_SCOPE}
        params.update(k_rpc=key.rpc, k_request=key.request_id)
        return params

    # --- composable helpers (caller's transaction) -----------------------------------------

    async def lookup_txn(self, conn: AsyncConnection, key: RequestKey) -> StoredResponse | None:
        """What the ledger holds for ``key``, or ``None`` for a new request.

        Raises:
            RequestIdReusedError: the id was used with another body.
        """
        row = (await conn.execute(self._lookup, self._key_params(key))).first()
        return None if row is None else _stored(row, key)

    async def lookup_clocked_txn(
        self, conn: AsyncConnection, key: RequestKey, also: LookupColumn | None = None
    ) -> tuple[StoredResponse | None, datetime]:
        """:meth:`lookup_txn` and the database clock (:func:`services.db.db_now`) in one
        statement: the clock from a one-row derived table, the ledger row outer-joined to
        it by its primary key (so a new request still returns the clock); the reading is
        kept as the transaction's ``db_now`` (:func:`services.db.remember_now`). ``also``: one
        more scalar column of the same statement, handed to ``also.accept``.

        Raises:
            RequestIdReusedError: the id was used with another body.
        """
        clock, parse_now = now_column(conn.dialect)
        stmt = self._clocked.get(conn.dialect.name)
        if stmt is None:
            stmt = self._clocked[conn.dialect.name] = self._clocked_lookup(clock)
        params = self._key_params(key)
        if also is not None:
            extended = self._clocked.get((conn.dialect.name, also.key))
            if extended is None:
                extended = stmt.add_columns(also.column(conn.dialect))
                self._clocked[(conn.dialect.name, also.key)] = extended
            stmt = extended
            params.update(also.params())
        # One read through the batched-read path: on a MySQL-protocol backend the round
        # trip goes to the driver's cursor (services/db_raw.py), its rows typed alike.
        [rows] = await execute_reads(conn, [Read(stmt, params)])
        if len(rows) != 1:  # pragma: no cover - the clock's derived table is one row
            raise InvariantError("the clocked ledger lookup must return exactly one row")
        row = rows[0]
        if also is not None:
            also.accept(row[-1])
        # Kept as the transaction's ``db_now``: a later clock read of this transaction
        # (``db_now`` itself, or a clock built on it) is answered without a statement.
        now = remember_now(conn, parse_now(row.db_now))
        return (None if row.request_digest is None else _stored(row, key)), now

    def _clocked_lookup(self, clock: ColumnElement[Any]) -> Select[Any]:
        t = self.table
        one = select(literal_column("1").label("one")).subquery("clock_row")
        return select(clock, t.c.request_digest, t.c.response_payload, t.c.completed).select_from(
            one.outerjoin(t, and_(*self._where))
        )

    async def record_txn(
        self,
        conn: AsyncConnection,
        key: RequestKey,
        response: bytes | None,
        *,
        completed: bool = True,
        now: datetime | None = None,
    ) -> None:
        """Insert the ledger row of a new request (``response`` ``None``: reserved only).

        ``now``: the row's ``created_at`` (the retention anchor) when the caller already
        read the database clock in this transaction; ``None`` reads it.

        Raises:
            DuplicateRequestRace: another transaction recorded the key first.
        """
        created = await db_now(conn) if now is None else now
        inserted = await insert_prepared(
            conn, self._insert, self._row(key, response, completed, created)
        )
        if not inserted:
            raise DuplicateRequestRace(key)

    @staticmethod
    def _row(
        key: RequestKey, response: bytes | None, completed: bool, created: datetime
    ) -> dict[str, Any]:
        return {
            **key.scope.values(),
            "rpc_name": key.rpc,
            "request_id": key.request_id,
            "request_digest": key.request_digest,
            "response_payload": None if response is None else _encode(response),
            "completed": completed and response is not None,
            "created_at": created,
        }

    async def complete_txn(
        self, conn: AsyncConnection, key: RequestKey, response: bytes, *, final: bool = True
    ) -> bytes:
        """Complete a reserved or provisional row with ``response`` (``final=False``:
        store it as the provisional response); returns the response to answer with:
        ``response``, or the one a concurrent completion stored first."""
        params = self._key_params(key)
        params.update(v_payload=_encode(response), v_completed=final)
        result = await conn.execute(self._complete, params)
        if result.rowcount == 1:
            return response
        stored = await self.lookup_txn(conn, key)
        if stored is None:  # purged meanwhile (a retention window shorter than the call)
            await self.record_txn(conn, key, response, completed=final)
            return response
        return stored.payload if stored.payload is not None else response

    async def execute_txn(
        self,
        conn: AsyncConnection,
        key: RequestKey,
        work: Callable[[AsyncConnection], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        *,
        completed: bool | Callable[[T], bool] = True,
    ) -> Deduplicated[T]:
        """Replay the stored response of ``key``, or run ``work`` and record its encoded
        response in the same transaction (``conn``).

        ``encode`` returning ``None`` records nothing (the service raises a refusal after
        the commit; a retry decides again). ``completed=False`` records a provisional
        response that :meth:`complete` replaces later; a callable decides per outcome
        (``SubmitWakeSignal``: only a freshly accepted signal has a match still to run).
        A reserved row (no response yet) takes the response.

        Raises:
            RequestIdReusedError: the id was used with another body (nothing ran).
            DuplicateRequestRace: a concurrent transaction recorded the key first; the
                caller's transaction must roll back and run again.
        """
        prior = await self.lookup_txn(conn, key)
        return await self._finish_txn(conn, key, prior, work, encode, completed, None)

    async def execute_at_txn(
        self,
        conn: AsyncConnection,
        key: RequestKey,
        work: Callable[[AsyncConnection, datetime], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        *,
        completed: bool | Callable[[T], bool] = True,
        also: LookupColumn | None = None,
    ) -> Deduplicated[T]:
        """:meth:`execute_txn` whose lookup reads the database clock in the same statement
        (:meth:`lookup_clocked_txn`): ``work`` gets that time as its transaction's clock
        reading, and a new ledger row takes it as ``created_at`` — one statement where a
        deduplicated write otherwise reads the clock separately (the record engine's
        writes, whose every row carries the transaction's time). ``also``: a scalar read
        ``work`` needs, selected by the same statement (accepted before ``work`` runs).

        Raises:
            The errors of :meth:`execute_txn`.
        """
        prior, now = await self.lookup_clocked_txn(conn, key, also)

        async def timed(c: AsyncConnection) -> T:
            return await work(c, now)

        return await self._finish_txn(conn, key, prior, timed, encode, completed, now)

    async def execute_joined_at_txn(
        self,
        conn: AsyncConnection,
        key: RequestKey,
        work: Callable[[AsyncConnection, datetime, JoinedRecord[T] | None], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        *,
        completed: bool | Callable[[T], bool] = True,
        also: LookupColumn | None = None,
    ) -> Deduplicated[T]:
        """:meth:`execute_at_txn` whose ``work`` may write the ledger row itself, last in
        its own final round trip (:class:`JoinedRecord`; ``None`` when the key holds a
        reserved row, which takes the response by an ``UPDATE`` after the work).

        Raises:
            The errors of :meth:`execute_txn`; :class:`InvariantError` when the joined
            write recorded another value than the work returned.
        """
        prior, now = await self.lookup_clocked_txn(conn, key, also)
        if prior is not None:

            async def plain(c: AsyncConnection) -> T:
                return await work(c, now, None)

            return await self._finish_txn(conn, key, prior, plain, encode, completed, now)
        joined = JoinedRecord(self, key, encode, completed, now)
        value = await work(conn, now, joined)
        done = joined.recorded(value)
        if done is not None:
            return done

        async def ready(_c: AsyncConnection) -> T:
            return value

        return await self._finish_txn(conn, key, None, ready, encode, completed, now)

    async def _finish_txn(
        self,
        conn: AsyncConnection,
        key: RequestKey,
        prior: StoredResponse | None,
        work: Callable[[AsyncConnection], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        completed: bool | Callable[[T], bool],
        now: datetime | None,
    ) -> Deduplicated[T]:
        if prior is not None and prior.payload is not None:
            return Deduplicated(None, prior.payload, replayed=True, completed=prior.completed)
        value = await work(conn)
        response = encode(value)
        if response is None:
            return Deduplicated(value, None)
        final = completed(value) if callable(completed) else completed
        if prior is None:
            await self.record_txn(conn, key, response, completed=final, now=now)
        else:
            response = await self.complete_txn(conn, key, response, final=final)
        return Deduplicated(value, response, completed=final)

    # --- public operations (one transaction each) -------------------------------------------

    async def execute_joined_at(
        self,
        engine: AsyncEngine,
        key: RequestKey,
        work: Callable[[AsyncConnection, datetime, JoinedRecord[T] | None], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        *,
        completed: bool | Callable[[T], bool] = True,
        also: LookupColumn | None = None,
    ) -> Deduplicated[T]:
        """:meth:`execute_joined_at_txn` in its own transaction (whole-transaction retry
        on deadlocks; a lost insert race rolls back and replays the winner)."""

        async def fn(conn: AsyncConnection) -> Deduplicated[T]:
            return await self.execute_joined_at_txn(
                conn, key, work, encode, completed=completed, also=also
            )

        return await _racing(engine, fn)

    async def execute(
        self,
        engine: AsyncEngine,
        key: RequestKey,
        work: Callable[[AsyncConnection], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        *,
        completed: bool | Callable[[T], bool] = True,
    ) -> Deduplicated[T]:
        """:meth:`execute_txn` in its own transaction (whole-transaction retry on
        deadlocks; a lost insert race rolls back and replays the winner).

        ``work`` may run more than once (every retry starts over in a new transaction),
        so it must replace, never accumulate, anything it captures.
        """

        async def fn(conn: AsyncConnection) -> Deduplicated[T]:
            return await self.execute_txn(conn, key, work, encode, completed=completed)

        return await _racing(engine, fn)

    async def execute_at(
        self,
        engine: AsyncEngine,
        key: RequestKey,
        work: Callable[[AsyncConnection, datetime], Awaitable[T]],
        encode: Callable[[T], bytes | None],
        *,
        completed: bool | Callable[[T], bool] = True,
    ) -> Deduplicated[T]:
        """:meth:`execute` whose lookup also reads the database clock
        (:meth:`execute_at_txn`): ``work`` gets the transaction's clock reading."""

        async def fn(conn: AsyncConnection) -> Deduplicated[T]:
            return await self.execute_at_txn(conn, key, work, encode, completed=completed)

        return await _racing(engine, fn)

    async def replay(self, engine: AsyncEngine, key: RequestKey) -> StoredResponse | None:
        """A read-only :meth:`lookup_txn` (early exit before expensive work).

        Raises:
            RequestIdReusedError: the id was used with another body.
        """
        async with transaction(engine, readonly=True) as conn:
            return await self.lookup_txn(conn, key)

    async def reserve(self, engine: AsyncEngine, key: RequestKey) -> StoredResponse | None:
        """Start a multi-transaction operation: ``None`` when the caller should run it
        (the key is now reserved, or was reserved by an earlier attempt that did not
        complete), else the stored response to replay (``payload`` set).

        The reservation fixes the body digest: a different body with the same id is
        refused before the operation has any effect.

        Raises:
            RequestIdReusedError: the id was used with another body.
        """

        async def fn(conn: AsyncConnection) -> StoredResponse | None:
            prior = await self.lookup_txn(conn, key)
            if prior is None:
                await self.record_txn(conn, key, None, completed=False)
                return None
            return prior if prior.payload is not None else None

        for _ in range(_RACE_ATTEMPTS - 1):
            try:
                return await run_in_transaction(engine, fn)
            except DuplicateRequestRace:
                continue
        return await run_in_transaction(engine, fn)

    async def complete(self, engine: AsyncEngine, key: RequestKey, response: bytes) -> bytes:
        """Finish a reserved or provisional request: store ``response`` unless another
        attempt completed first; returns the response to answer with (the first)."""
        return await run_in_transaction(engine, lambda conn: self.complete_txn(conn, key, response))

    async def release(self, engine: AsyncEngine, key: RequestKey) -> None:
        """Drop the reservation of an operation that failed: a refused request leaves no
        row behind, and its retry decides again. A row that already holds a response
        (completed, or provisional) is kept."""
        params = {**self._key_params(key), "k_digest": key.request_digest}

        async def fn(conn: AsyncConnection) -> None:
            await conn.execute(self._release, params)

        await run_in_transaction(engine, fn)

    async def once(
        self,
        engine: AsyncEngine,
        key: RequestKey,
        operation: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
    ) -> bytes:
        """Run an idempotent multi-transaction ``operation`` once per request:
        :meth:`reserve`, then ``operation()``, then :meth:`complete` with its encoded
        value; a stored response is replayed instead. When ``operation`` raises, the
        reservation is released (:meth:`release`) and the error propagates.

        Raises:
            RequestIdReusedError: the id was used with another body (nothing ran).
        """
        stored = await self.reserve(engine, key)
        if stored is not None and stored.payload is not None:
            return stored.payload
        try:
            response = encode(await operation())
        except Exception:
            try:
                await self.release(engine, key)
            except Exception:  # the original error is the one the caller must see
                log.warning("could not release request reservation %s", key.rpc, exc_info=True)
            raise
        return await self.complete(engine, key, response)


async def _racing(
    engine: AsyncEngine, fn: Callable[[AsyncConnection], Awaitable[Deduplicated[T]]]
) -> Deduplicated[T]:
    """``fn`` in its own transaction; a lost insert race rolls back and runs again."""
    for _ in range(_RACE_ATTEMPTS - 1):
        try:
            return await run_in_transaction(engine, fn)
        except DuplicateRequestRace:
            continue
    return await run_in_transaction(engine, fn)
