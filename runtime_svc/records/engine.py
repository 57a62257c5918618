"""The record engine: business-record mutations under the §13.1 lock order.

Two layers (STYLE 6):

* **Composable ``_txn`` functions** that run inside a caller-supplied connection, for
  callers that own the transaction (the Flow worker's step commit); steps 1-2 live in
  :mod:`runtime_svc.records.locking` and are re-exported here:

  1. :func:`plan_mutation` — pure: the :class:`~runtime_svc.resources.LockPlan` of one
     mutation (record row, lock-relevant parent rows, history-sequence row).
     Plans of several mutations combine with :meth:`LockPlan.union`.
  2. :func:`acquire_locks_txn` — takes the plan's business/parent locks, then its
     history-sequence locks, each class in canonical key order (``SELECT … FOR UPDATE``;
     a record the plan creates is locked by its ``INSERT`` at its own position). It
     returns :class:`HeldLocks`, the proof that those locks are held on this connection.
  3. *(the caller's Flow lifecycle locks: root, steps, attempts, …; §13.1 step 4)*
  4. :func:`apply_mutation_txn` — per mutation: the record's compare-and-swap write on
     its already-locked row, the history-sequence reservation on its already-locked row,
     then the derived business event and audit record (§13.1 step 5). It refuses any
     record, parent or history row that is not in the admitted plan with
     :class:`~runtime_svc.resources.LateResourceDiscoveryError` *before* touching it.

* **:class:`RecordEngine`** — the public methods of ordinary (non-Flow) record writes. Each
  opens exactly one transaction through :func:`services.db.run_in_transaction`: a
  deadlock victim or lock-wait timeout is rolled back and the whole transaction runs again
  from the same validated input (same generated record id). Late discovery — the row was
  re-parented between the plan read and the lock — restarts the whole transaction with a
  fresh plan, a bounded number of times (§13.3).

**Version semantics.** ``version`` is 1 after create and +1 per write. An update or delete
whose ``expected_version`` is not the stored one fails with :class:`StaleVersionError`,
a :class:`~services.errors.ConflictError` (``ABORTED``), as the proto comments say: the
caller re-reads and decides; resending the same request cannot succeed.

**Soft delete.** Delete sets ``is_deleted``; normal reads and writes treat a deleted record
as missing (``NOT_FOUND``). Every function takes the trusted org; a record of another org
is indistinguishable from a missing one.

**What is written per mutation, in one transaction:** the record row, one history
sequence (strictly increasing per record, no gaps, reserved under the record's lock), one
business event ordered by that sequence, one audit record. Audit and event payloads carry
field *names*, versions and digests, never field values (§17.3: no credential material or
raw context in audit rows).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.records import store
from runtime_svc.records.locking import (
    RECORD_ENTITY,
    HeldLocks,
    LockHook,
    acquire_locks_txn,
    lock_relevant_relationships,
    plan_mutation,
)
from runtime_svc.records.model import (
    Actor,
    Lineage,
    MutationKind,
    MutationResult,
    RecordMutation,
    RecordState,
    RequestRef,
)
from runtime_svc.records.validation import (
    RecordValidationError,
    check_required,
    parent_refs_of,
    require_object,
)
from runtime_svc.records.view import RecordView
from runtime_svc.resources import (
    LateResourceDiscoveryError,
    LockRole,
    ResourceKey,
    business_key,
    history_key,
)
from runtime_svc.schema import runtime_requests
from services.db import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_ATTEMPTS,
    Backoff,
    DbErrorClass,
    classify_db_error,
    run_in_transaction,
    strategy_for,
)
from services.db_batch import Write, commit_writes, execute_writes
from services.digest import digest_bytes, versioned_digest
from services.errors import (
    AlreadyExistsError,
    ConflictError,
    FenceLostError,
    NotFoundError,
    PermissionDeniedError,
)
from services.evolve import evolve
from services.invariants import InvariantError
from services.request_dedupe import (
    Deduplicated,
    DuplicateRequestRace,
    JoinedRecord,
    LookupColumn,
    RequestKey,
    RequestLedger,
)

__all__ = [
    "DEFAULT_MAX_REPLANS",
    "ChangeSink",
    "EngineStats",
    "HeldLocks",
    "LockHook",
    "RecordEngine",
    "StaleVersionError",
    "Transform",
    "acquire_locks_txn",
    "apply_mutation_txn",
    "get_record_txn",
    "plan_mutation",
]


class ChangeSink(Protocol):
    """Derived rows written for a record change inside its own transaction, after the
    record, history, event and audit rows were built (sent before them when the
    mutation's writes are deferred to its step's commit, ADR 0011; they commit together)
    — the ``record.change`` wake-signal producer
    (:class:`runtime_svc.waits.RecordChangeProducer`, §14.1: producer evidence shares the
    database, so the signal commits with the change)."""

    async def on_change_txn(
        self, conn: AsyncConnection, org_id: str, record: RecordState, now: datetime
    ) -> int:
        """Write the derived rows of ``record``'s new state; returns how many."""
        ...

    def collect(self) -> AbstractContextManager[list[Any]]:
        """Collect what the enclosed transaction wrote (for :meth:`flush`)."""
        ...

    def reset(self) -> None:
        """Forget what a rolled-back transaction attempt collected."""
        ...

    async def flush(self, written: list[Any]) -> None:
        """After commit: follow-up of the collected rows (never fails the write)."""
        ...


#: The before-save hook of :meth:`RecordEngine.mutate`: ``(conn, mutation, stored row or
#: None) -> mutation to write``.
Transform = Callable[
    [AsyncConnection, RecordMutation, RecordState | None], Awaitable[RecordMutation]
]

T = TypeVar("T")

#: How often a public write re-plans after late resource discovery before giving up.
DEFAULT_MAX_REPLANS = 3
#: Entity name in NOT_FOUND / ALREADY_EXISTS errors.
_ENTITY = RECORD_ENTITY


class StaleVersionError(ConflictError):
    """The record is not at the version the caller expected (``ABORTED``; re-read first)."""

    reason = "stale_version"

    def __init__(
        self, object_name: str, record_id: str, expected_version: int, found: int | None
    ) -> None:
        shown = "absent" if found is None else str(found)
        super().__init__(
            f"record version is {shown}, expected {expected_version}",
            entity=_ENTITY,
            key=f"{object_name}/{record_id}",
        )
        self.expected_version, self.found_version = expected_version, found
        self.attributes.update(expected_version=str(expected_version), found_version=shown)


def _not_found(object_name: str, record_id: str) -> NotFoundError:
    return NotFoundError(_ENTITY, f"{object_name}/{record_id}")


# --- applying one mutation ------------------------------------------------------------------


def _check_parents(
    view: RecordView,
    mutation: RecordMutation,
    before: RecordState | None,
    after: RecordState,
    locks: HeldLocks,
) -> None:
    """Every lock-relevant parent of the old and new state is admitted; set ones exist."""
    own = business_key(mutation.object_name, mutation.record_id)
    issues: list[tuple[str, str]] = []
    for rel in view.child_relationships(mutation.object_name):
        if not rel.lock_parent:
            continue
        for state in (before, after):
            value = None if state is None else state.fields.get(rel.field)
            if isinstance(value, str) and business_key(rel.parent_object, value) != own:
                locks.plan.require(business_key(rel.parent_object, value), LockRole.PARENT)
        value = after.fields.get(rel.field)
        if rel.field in mutation.fields and isinstance(value, str):
            key = business_key(rel.parent_object, value)
            parent = after if key == own else locks.rows.get(key)
            if parent is None or parent.is_deleted:
                issues.append((f"fields.{rel.field}", "parent_not_found"))
    if issues:
        raise RecordValidationError(issues)


def _fields_digest(record: RecordState, encoded: str | None) -> str:
    """The ``record-fields`` digest of ``record``: over the fields JSON the write stored
    (``encoded``, the same canonical bytes ``versioned_digest`` would make) when there is
    one, else computed."""
    if encoded is None:
        return versioned_digest("record-fields", record.fields)
    return digest_bytes("record-fields", encoded.encode("utf-8"))


def _changed(mutation: RecordMutation, before: RecordState | None, after: RecordState) -> list[str]:
    if mutation.kind is MutationKind.CREATE:
        return sorted(after.fields)
    if mutation.kind is MutationKind.DELETE or before is None:
        return []
    return sorted(k for k in mutation.fields if before.fields.get(k) != after.fields.get(k))


async def _reserve_history(
    conn: AsyncConnection, org_id: str, mutation: RecordMutation, locks: HeldLocks
) -> int:
    key = history_key(mutation.object_name, mutation.record_id)
    if mutation.kind is MutationKind.CREATE and key in locks.reserved_creates:
        # Inserted at 1 by the create's lock phase (acquire_locks_txn): already reserved.
        locks.reserved_creates.discard(key)
        return 1
    last = locks.history.get(key)
    obj, rid = mutation.object_name, mutation.record_id
    if last is None:
        # A record written before the engine kept history rows: its row is created now, at
        # sequence 1, under the record's lock (a concurrent writer waits on that lock).
        if not await store.insert_history_txn(conn, org_id, obj, rid, 1, locks.now):
            raise FenceLostError("record_history_sequences", f"{obj}/{rid}", 0, None)
        sequence = 1
    else:
        sequence = await store.advance_history_txn(conn, org_id, obj, rid, last, locks.now)
    locks.history[key] = sequence
    return sequence


def _settle_advance(
    conn: AsyncConnection,
    org_id: str,
    after: RecordState,
    expected: int,
    lock_relevant: frozenset[str],
    encoded: str,
    last: int,
    now: datetime,
) -> Callable[[int], Awaitable[None]]:
    """The row-count check of a batched record + history UPDATE: nothing matched → the
    two statements run alone and raise what they raise there (``StaleVersionError`` for
    the record, ``FenceLostError`` for the history row)."""

    async def settle(rowcount: int) -> None:
        if store.advanced_together(rowcount):
            return
        await _update_record(conn, org_id, after, expected, lock_relevant, encoded)
        obj, rid = after.object_name, after.record_id
        await store.advance_history_txn(conn, org_id, obj, rid, last, now)
        raise RuntimeError("the record + history UPDATE matched no row, each UPDATE alone did")

    return settle


async def _update_record(
    conn: AsyncConnection,
    org_id: str,
    after: RecordState,
    expected: int,
    lock_relevant: frozenset[str],
    encoded: str,
) -> int:
    """The record's own fenced UPDATE (its new version); a lost fence is the caller's
    stale version (``StaleVersionError``)."""
    try:
        return await store.update_record_txn(
            conn, org_id, after, expected, lock_relevant, encoded_fields=encoded
        )
    except FenceLostError as exc:
        raise StaleVersionError(
            after.object_name, after.record_id, expected, exc.found_version
        ) from exc


async def apply_mutation_txn(
    conn: AsyncConnection,
    org_id: str,
    view: RecordView,
    mutation: RecordMutation,
    locks: HeldLocks,
    *,
    actor: Actor,
    lineage: Lineage | None = None,
    request: RequestRef | None = None,
    changes: ChangeSink | None = None,
    defer: list[Write] | None = None,
) -> MutationResult:
    """Apply one validated mutation under locks the caller already holds.

    ``changes`` (the record-change wake-signal producer) writes its derived rows last,
    in this transaction (with ``defer``: before the deferred rows are sent — they commit
    together; the producer reads only its watch table).

    ``defer``: instead of executing the mutation's checked writes (the record's
    compare-and-swap with its history advance where both rows are held, the event and
    audit INSERTs), append them to this list, in order, for the caller to execute later
    in the same transaction — a durable step sends them in its commit's round trip, after
    the lifecycle locks (§12.2 step 11, ADR 0011). Statements the mutation cannot defer
    (a history row reserved or a record updated on its own) still run here. Only for
    a caller that runs no other mutation of the transaction and reads no record row
    before executing them.

    Assumes the caller took ``locks`` with :func:`acquire_locks_txn` on ``conn`` (and then
    any Flow lifecycle locks); writes only rows of ``locks.plan`` and appends the derived
    event and audit rows last.

    Raises:
        LateResourceDiscoveryError: the record, its history row or one of its
            lock-relevant parents (before or after the write) is not in the plan.
        NotFoundError: the record does not exist in ``org_id`` or is deleted.
        AlreadyExistsError: a CREATE of an existing record.
        StaleVersionError: ``expected_version`` is not the stored version.
        RecordValidationError: a required field would be empty, or a newly referenced
            lock-relevant parent does not exist.
        PermissionDeniedError: ``locks`` were taken for another org.
        ValueError: a mutation of a record whose CREATE in ``locks`` is not applied yet.
    """
    if locks.org_id != org_id:
        raise PermissionDeniedError("lock plan belongs to another org", reason="org_mismatch")
    obj, rid = mutation.object_name, mutation.record_id
    rkey = business_key(obj, rid)
    locks.plan.require(rkey, LockRole.RECORD)
    locks.plan.require(history_key(obj, rid), LockRole.HISTORY)
    rules = require_object(view, obj)
    current = locks.rows.get(rkey)
    lock_relevant = lock_relevant_relationships(view, obj)

    before: RecordState | None
    sequence: int | None = None
    # Writes that go out with the event and audit INSERTs (one round trip where the
    # backend batches writes).
    first: list[Write] = []
    if mutation.kind is MutationKind.CREATE:
        if rkey not in locks.pending_creates or current is None:
            if current is not None:
                raise AlreadyExistsError(_ENTITY, f"{obj}/{rid}")
            # The plan admitted the row as existing, not as created by this transaction.
            raise LateResourceDiscoveryError(rkey, LockRole.RECORD)
        before, after = None, current
        _check_parents(view, mutation, before, after, locks)
        locks.pending_creates.discard(rkey)
        encoded = locks.encoded_fields.pop(rkey, None)
    else:
        if rkey in locks.pending_creates:
            # History order must follow mutation order: the create's event comes first.
            raise ValueError("apply the CREATE of a record before its other mutations")
        if current is None or current.is_deleted:
            raise _not_found(obj, rid)
        before = current
        fields = dict(current.fields)
        if mutation.kind is MutationKind.UPDATE:
            for name, value in mutation.fields.items():
                if value is None:
                    fields.pop(name, None)
                else:
                    fields[name] = value
            check_required(rules, fields)
        after = evolve(
            current,
            fields=fields,
            parent_refs=parent_refs_of(view, obj, fields),
            is_deleted=mutation.kind is MutationKind.DELETE,
            updated_at=locks.now,
        )
        _check_parents(view, mutation, before, after, locks)
        expected = (
            current.version if mutation.expected_version is None else mutation.expected_version
        )
        encoded = store.fields_json(after.fields)
        hkey = history_key(obj, rid)
        last = locks.history.get(hkey)
        if last is not None and strategy_for(conn.dialect).multi_table_update:
            # Both rows held: one multi-table UPDATE (ADR 0009), sent with the event and
            # audit INSERTs below — one round trip where the backend batches (ADR 0010).
            first.append(
                store.advancing_history_write(
                    org_id,
                    after,
                    expected,
                    lock_relevant,
                    encoded_fields=encoded,
                    last_sequence=last,
                    now=locks.now,
                    check=_settle_advance(
                        conn, org_id, after, expected, lock_relevant, encoded, last, locks.now
                    ),
                )
            )
            version, sequence = expected + 1, last + 1
            locks.history[hkey] = sequence
        else:
            version = await _update_record(conn, org_id, after, expected, lock_relevant, encoded)
        after = evolve(after, version=version)
        locks.rows[rkey] = after

    if sequence is None:
        sequence = await _reserve_history(conn, org_id, mutation, locks)
    changed = _changed(mutation, before, after)
    lineage = lineage or Lineage()
    event_id, audit_id = f"evt_{uuid.uuid4().hex}", f"aud_{uuid.uuid4().hex}"
    event = store.event_write(
        store.EventRow(
            org_id=org_id,
            event_id=event_id,
            object_name=obj,
            record_id=rid,
            history_sequence=sequence,
            event_type=mutation.kind.value,
            payload={
                "version": after.version,
                "changed_fields": changed,
                "fields_digest": _fields_digest(after, encoded),
                "view_digest": view.digest,
            },
            occurred_at=locks.now,
            flow_run_id=lineage.flow_run_id,
            step_execution_id=lineage.step_execution_id,
            attempt_id=lineage.attempt_id,
            request_rpc=None if request is None else request.rpc,
            request_id=None if request is None else request.request_id,
            request_digest=None if request is None else request.request_digest,
        ),
        # The sequence is reserved under the record's lock: a collision means a writer that
        # did not hold it (a broken invariant); the transaction rolls back.
        on_duplicate=lambda: ConflictError(
            "the record's history sequence was taken concurrently",
            entity=_ENTITY,
            key=f"{obj}/{rid}",
        ),
    )
    audit = store.audit_write(
        store.AuditRow(
            org_id=org_id,
            audit_record_id=audit_id,
            actor_kind=actor.kind,
            actor_id=actor.id,
            action=f"record.{mutation.kind.value}",
            object_name=obj,
            record_id=rid,
            details={
                "changed_fields": changed,
                "version": after.version,
                "history_sequence": sequence,
                "event_id": event_id,
                "view_digest": view.digest,
                **({} if request is None else {"request_rpc": request.rpc}),
            },
            occurred_at=locks.now,
            flow_run_id=lineage.flow_run_id,
            step_execution_id=lineage.step_execution_id,
            attempt_id=lineage.attempt_id,
        ),
    )
    if defer is None:
        await execute_writes(conn, [*first, event, audit])
    else:
        defer.extend((*first, event, audit))
    if changes is not None:
        await changes.on_change_txn(conn, org_id, after, locks.now)
    return MutationResult(after, sequence, event_id, audit_id, tuple(changed), prior=before)


async def get_record_txn(
    conn: AsyncConnection, org_id: str, object_name: str, record_id: str
) -> RecordState:
    """The live (not deleted) record in ``org_id``.

    Raises:
        NotFoundError: absent, deleted, or in another org (indistinguishable).
    """
    state = await store.read_record_txn(conn, org_id, object_name, record_id)
    if state is None:
        raise _not_found(object_name, record_id)
    return state


# --- the public engine ------------------------------------------------------------------------


@dataclass
class EngineStats:
    """Counters of one :class:`RecordEngine` (exported as metrics; read by tests).

    Attributes:
        conflict_retries: transactions rolled back by a deadlock/write conflict (MySQL 1213,
            TiDB 9007, ``SQLITE_BUSY``, …) and run again whole.
        lock_wait_timeouts: transactions rolled back by a lock-wait timeout and run again.
        replans: transactions restarted with a fresh lock plan after late discovery.
    """

    conflict_retries: int = 0
    lock_wait_timeouts: int = 0
    replans: int = 0


class RecordEngine:
    """Ordinary record writes and reads, one transaction per call.

    Args:
        engine: the runtime database.
        max_attempts: whole-transaction attempts on deadlock/lock-wait timeout.
        backoff: jittered backoff between those attempts.
        max_replans: restarts after late resource discovery.
        lock_hook: awaited after each lock a write takes (test seam for interleavings;
            ``None`` in production).
        ledger: the request-dedupe ledger of :meth:`mutate_once` (``runtime_requests``).
        changes: the record-change wake-signal producer (``None``: no signals).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff: Backoff = DEFAULT_BACKOFF,
        max_replans: int = DEFAULT_MAX_REPLANS,
        lock_hook: LockHook | None = None,
        ledger: RequestLedger | None = None,
        changes: ChangeSink | None = None,
    ) -> None:
        self._engine = engine
        self._ledger = ledger or RequestLedger(runtime_requests)
        self._lock_hook = lock_hook
        self._changes = changes
        self._max_attempts = max_attempts
        self._backoff = backoff
        self._max_replans = max_replans
        self.stats = EngineStats()

    async def get(self, org_id: str, object_name: str, record_id: str) -> RecordState:
        """The live record ``object_name``/``record_id`` of ``org_id``.

        Raises:
            NotFoundError: absent, deleted, or in another org.
        """

        async def read(conn: AsyncConnection) -> RecordState:
            return await get_record_txn(conn, org_id, object_name, record_id)

        return await run_in_transaction(
            self._engine, read, max_attempts=self._max_attempts, readonly=True
        )

    async def transact(self, fn: Callable[[AsyncConnection], Awaitable[T]], *, key: str = "") -> T:
        """Run ``fn`` in one transaction of this engine's policy: a deadlock victim or
        lock-wait timeout runs again whole (counted in :attr:`stats`), late resource
        discovery and a lost request-ledger race restart with a fresh plan, a bounded
        number of times. The record-change signals the committed attempt wrote are
        matched after the commit (§14.2 step 2); a rolled-back attempt's are forgotten.

        Raises:
            ConflictError: still conflicting (or re-planning) after every attempt
                (``key`` names the record in the error).
        """
        changes = self._changes

        async def attempt(conn: AsyncConnection) -> T:
            if changes is not None:
                changes.reset()  # a retried attempt writes its signals again
            return await fn(conn)

        collector = nullcontext([]) if changes is None else changes.collect()
        with collector as written:
            for _ in range(self._max_replans):
                try:
                    result = await run_in_transaction(
                        self._engine,
                        self._observed(attempt),
                        max_attempts=self._max_attempts,
                        backoff=self._backoff,
                    )
                except LateResourceDiscoveryError:
                    # Rolled back (the exception left the transaction); plan again from
                    # the same input: the next plain read sees the committed re-parenting.
                    self.stats.replans += 1
                    continue
                except DuplicateRequestRace:
                    continue  # a concurrent duplicate recorded first: the next attempt replays
                if changes is not None and written:
                    await changes.flush(list(written))
                return result
        raise ConflictError(
            "the record's parents kept changing while it was written", entity=_ENTITY, key=key
        )

    async def mutate_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        view: RecordView,
        mutation: RecordMutation,
        *,
        actor: Actor,
        request: RequestRef | None = None,
        on_applied: Callable[[AsyncConnection, MutationResult], Awaitable[None]] | None = None,
        transform: Transform | None = None,
        now: datetime | None = None,
        joined: JoinedRecord[MutationResult] | None = None,
    ) -> MutationResult:
        """One attempt of :meth:`mutate` in the caller's transaction: plain read of the
        current row → ``transform`` → :func:`plan_mutation` → :func:`acquire_locks_txn` →
        :func:`apply_mutation_txn` → ``on_applied``. For an object without lock-relevant
        relationships the plan can only be the record and its history row, so the read
        is the record's ``FOR UPDATE`` (the plan's first lock) and is not repeated.

        Args:
            request: the RPC request that drives the mutation, stored on its business event
                as evidence (deduplication is :meth:`mutate_once`'s request ledger).
            on_applied: awaited inside the same transaction after the record, history,
                event and audit rows, so rows it writes commit or roll back with the
                mutation (the after-save trigger's run rows). It runs again on every
                whole-transaction retry, so it must replace, never accumulate, anything it
                captures.
            transform: awaited after the stored row was read (``None`` for a create) and
                before the lock plan is made: it returns the mutation to write instead
                (the Embedded Before-Save Flows); raising rolls everything back.
            now: the database time this transaction already read (every row written
                carries it); ``None`` reads the clock at the lock phase.
            joined: the request ledger's row for the result (:meth:`mutate_once`, never
                with ``on_applied``): written last in the round trip of the mutation's
                own writes (``services.request_dedupe.JoinedRecord``).

        Raises:
            NotFoundError, AlreadyExistsError, StaleVersionError, RecordValidationError,
                LateResourceDiscoveryError: see :func:`apply_mutation_txn`.
            InvariantError: ``joined`` with ``on_applied``.
        """
        if joined is not None and on_applied is not None:
            raise InvariantError("the ledger row joins the last round trip: no on_applied")
        obj, rid = mutation.object_name, mutation.record_id
        current = None
        locked: dict[ResourceKey, RecordState | None] = {}
        locked_history: dict[ResourceKey, int | None] = {}
        if mutation.kind is not MutationKind.CREATE:
            if lock_relevant_relationships(view, obj):
                current = await store.read_record_txn(conn, org_id, obj, rid)
            else:
                # No parent can enter the plan: it is this record, then its history row.
                # The read the plan needs is then the record's lock itself, taken first
                # as §13.1 orders it, with the history row's lock, the plan's next key
                # (one statement instead of a read, a re-read and the history lock; it
                # carries the clock too when this transaction has not read it).
                row, last = await store.lock_record_history_txn(
                    conn, org_id, obj, rid, clocked=now is None
                )
                locked[business_key(obj, rid)] = row
                locked_history[history_key(obj, rid)] = last
                current = None if row is None or row.is_deleted else row
            if current is None:
                raise _not_found(obj, rid)
        write = mutation
        if transform is not None:
            write = await transform(conn, mutation, current)
        plan = plan_mutation(view, write, current)
        locks = await acquire_locks_txn(
            conn,
            org_id,
            view,
            plan,
            [write],
            on_locked=self._lock_hook,
            now=now,
            locked=locked,
            locked_history=locked_history,
        )
        deferred: list[Write] | None = None if joined is None else []
        result = await apply_mutation_txn(
            conn,
            org_id,
            view,
            write,
            locks,
            actor=actor,
            request=request,
            changes=self._changes,
            defer=deferred,
        )
        if joined is not None and deferred is not None:
            # The transaction's last writes (no on_applied): they carry its COMMIT where
            # the backend allows (ADR 0013).
            ledger = joined.write(result)
            await commit_writes(conn, deferred if ledger is None else [*deferred, ledger])
        if on_applied is not None:
            await on_applied(conn, result)
        return result

    async def mutate(
        self,
        org_id: str,
        view: RecordView,
        mutation: RecordMutation,
        *,
        actor: Actor,
        on_applied: Callable[[AsyncConnection, MutationResult], Awaitable[None]] | None = None,
        transform: Transform | None = None,
    ) -> MutationResult:
        """Apply one validated mutation in its own transaction (:meth:`mutate_txn` under
        :meth:`transact`); a retry starts again from ``mutation``.

        Raises:
            NotFoundError, AlreadyExistsError, StaleVersionError, RecordValidationError:
                see :func:`apply_mutation_txn`.
            ConflictError: still conflicting after every attempt.
        """

        async def attempt(conn: AsyncConnection) -> MutationResult:
            return await self.mutate_txn(
                conn,
                org_id,
                view,
                mutation,
                actor=actor,
                on_applied=on_applied,
                transform=transform,
            )

        return await self.transact(attempt, key=f"{mutation.object_name}/{mutation.record_id}")

    async def mutate_once(
        self,
        org_id: str,
        view: RecordView,
        mutation: RecordMutation,
        *,
        actor: Actor,
        key: RequestKey,
        encode: Callable[[MutationResult], bytes],
        on_applied: Callable[[AsyncConnection, MutationResult], Awaitable[None]] | None = None,
        transform: Transform | None = None,
        also: LookupColumn | None = None,
    ) -> Deduplicated[MutationResult]:
        """:meth:`mutate` deduplicated on ``key`` (``services.request_dedupe``): the
        mutation, ``on_applied`` and the ledger row with ``encode(result)`` commit in one
        transaction; a retry replays the original response bytes without touching the
        record (not even ``transform`` or ``on_applied`` run), a reuse of the id with
        another body is refused. ``also``: a scalar read ``transform`` needs, selected by
        the ledger lookup's statement (the before-save activation read,
        :meth:`runtime_svc.embedded.BeforeSaveDispatcher.activation_read`).

        Raises:
            RequestIdReusedError: the id was used with another body.
            The errors of :meth:`mutate`.
        """
        ref = RequestRef(key.rpc, key.request_id, key.request_digest)

        async def work(
            conn: AsyncConnection, now: datetime, joined: JoinedRecord[MutationResult] | None
        ) -> MutationResult:
            return await self.mutate_txn(
                conn,
                org_id,
                view,
                mutation,
                actor=actor,
                request=ref,
                on_applied=on_applied,
                transform=transform,
                now=now,
                # Without on_applied the mutation's own writes are the transaction's
                # last: the ledger row goes out with them (one round trip fewer).
                joined=joined if on_applied is None else None,
            )

        async def attempt(conn: AsyncConnection) -> Deduplicated[MutationResult]:
            # The ledger lookup reads the transaction's clock too (one statement); the
            # mutation's rows and the ledger row all carry that time.
            return await self._ledger.execute_joined_at_txn(conn, key, work, encode, also=also)

        return await self.transact(attempt, key=f"{mutation.object_name}/{mutation.record_id}")

    def _observed(
        self, fn: Callable[[AsyncConnection], Awaitable[T]]
    ) -> Callable[[AsyncConnection], Awaitable[T]]:
        async def run(conn: AsyncConnection) -> T:
            try:
                return await fn(conn)
            except Exception as exc:
                kind = classify_db_error(exc)
                if kind is DbErrorClass.RETRYABLE_CONFLICT:
                    self.stats.conflict_retries += 1
                elif kind is DbErrorClass.LOCK_WAIT_TIMEOUT:
                    self.stats.lock_wait_timeouts += 1
                raise

        return run
