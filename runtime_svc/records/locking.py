"""The lock phase of a record transaction (§13.1 steps 1-3).

:func:`plan_mutation` derives the :class:`~runtime_svc.resources.LockPlan` of one mutation
(pure); :func:`acquire_locks_txn` takes the plan's business/parent locks, then its
history-sequence locks, each in canonical key order, and returns :class:`HeldLocks` — the
proof, handed to :func:`runtime_svc.records.engine.apply_mutation_txn`, that those locks
are held on the connection.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.records import store
from runtime_svc.records.model import MutationKind, RecordMutation, RecordState
from runtime_svc.records.validation import parent_refs_of, references_of
from runtime_svc.records.view import RecordView
from runtime_svc.resources import (
    LockPlan,
    ResourceClass,
    ResourceKey,
    business_key,
    history_key,
    plan_record_mutation,
)
from services.db import db_now
from services.db_batch import Companion, execute_writes_if_absent
from services.errors import AlreadyExistsError
from services.metrics import metrics

__all__ = [
    "RECORD_ENTITY",
    "HeldLocks",
    "LockHook",
    "acquire_locks_txn",
    "lock_relevant_relationships",
    "plan_mutation",
]

#: Entity name in NOT_FOUND / ALREADY_EXISTS errors of records.
RECORD_ENTITY = "Record"


def lock_relevant_relationships(view: RecordView, object_name: str) -> frozenset[str]:
    """Names of the relationships whose parent a write of ``object_name`` locks."""
    return view.lock_relevant(object_name)


#: Awaited after each lock of :func:`acquire_locks_txn` (test seam for interleavings).
LockHook = Callable[[ResourceKey], Awaitable[None]]


# --- planning ----------------------------------------------------------------------------


def plan_mutation(
    view: RecordView, mutation: RecordMutation, current: RecordState | None = None
) -> LockPlan:
    """The lock plan of ``mutation`` (pure).

    Args:
        view: the bound metadata view.
        mutation: the validated mutation.
        current: the record as last read (``None`` for a create). Its parents are in the
            plan too: a child write locks the parent it leaves as well as the one it joins.
    """
    refs: list[tuple[str, str | None]] = []
    if current is not None:
        refs += references_of(view, mutation.object_name, current.fields)
    if mutation.kind is not MutationKind.DELETE:
        refs += references_of(view, mutation.object_name, mutation.fields)
    return plan_record_mutation(
        view.metadata,
        mutation.object_name,
        mutation.record_id,
        refs,
        creates=mutation.kind is MutationKind.CREATE,
    )


# --- lock acquisition ----------------------------------------------------------------------


@dataclass
class HeldLocks:
    """The business/parent and history locks of ``plan``, held on one connection.

    Built only by :func:`acquire_locks_txn`; :func:`apply_mutation_txn` keeps the row
    images current as it writes, so several mutations of one transaction (even of one
    record) see each other.

    Attributes:
        org_id: the trusted org the locks were taken in.
        plan: the admitted lock plan.
        now: the database clock at acquisition (every write of the transaction uses it).
        rows: business rows read (or inserted) under lock; ``None`` = no such row.
        history: ``last_sequence`` of history rows read under lock; ``None`` = no row.
        pending_creates: inserted rows whose create mutation is not applied yet.
        reserved_creates: history rows of created records inserted at sequence 1 — the
            create's own sequence, reserved by that ``INSERT`` (no separate advance).
        encoded_fields: the stored fields JSON of the rows inserted here
            (:func:`runtime_svc.records.store.fields_json`), for the create's digest.
    """

    org_id: str
    plan: LockPlan
    now: datetime
    rows: dict[ResourceKey, RecordState | None] = field(default_factory=dict)
    history: dict[ResourceKey, int | None] = field(default_factory=dict)
    pending_creates: set[ResourceKey] = field(default_factory=set)
    reserved_creates: set[ResourceKey] = field(default_factory=set)
    encoded_fields: dict[ResourceKey, str] = field(default_factory=dict)


def _new_record(
    org_id: str, view: RecordView, mutation: RecordMutation, now: datetime
) -> RecordState:
    return RecordState(
        org_id=org_id,
        object_name=mutation.object_name,
        record_id=mutation.record_id,
        version=1,
        fields=dict(mutation.fields),
        parent_refs=parent_refs_of(view, mutation.object_name, mutation.fields),
        is_deleted=False,
        created_at=now,
        updated_at=now,
    )


def _exists(obj: str, rid: str) -> Callable[[], AlreadyExistsError]:
    return lambda: AlreadyExistsError(RECORD_ENTITY, f"{obj}/{rid}")


async def acquire_locks_txn(
    conn: AsyncConnection,
    org_id: str,
    view: RecordView,
    plan: LockPlan,
    mutations: Sequence[RecordMutation] = (),
    *,
    on_locked: LockHook | None = None,
    now: datetime | None = None,
    locked: Mapping[ResourceKey, RecordState | None] | None = None,
    locked_history: Mapping[ResourceKey, int | None] | None = None,
    then: Companion | None = None,
) -> HeldLocks:
    """Take the business/parent, then history-sequence locks of ``plan`` (§13.1 steps 1-3).

    Keys of the Flow lifecycle classes are left to the caller, who takes them next
    (§13.1 step 4); derived rows come after both (step 5, :func:`apply_mutation_txn`).

    Args:
        conn: the caller's connection, inside its transaction.
        org_id: the trusted org.
        view: the bound metadata view.
        plan: the admitted plan (canonical order by construction).
        mutations: the CREATE mutations of ``plan.creates`` (others are ignored): a new
            row is inserted at its key's position, which is how its lock is taken.
        on_locked: awaited after each lock (test seam).
        now: the database time the caller already read in this transaction (every row
            of the mutations carries it); ``None`` reads the clock here.
        locked: business rows the caller already read ``FOR UPDATE`` on ``conn``
            (``None`` = no such row); they must head the plan's order (no other key of
            the plan before them), so taking them early kept the §13.1 order, and they
            are not read again.
        locked_history: ``last_sequence`` of history rows the caller already read
            ``FOR UPDATE`` on ``conn`` (``None`` = no such row;
            :func:`runtime_svc.records.store.lock_record_history_txn`); with ``locked``
            they must head the plan's order, and are not read again.
        then: the caller's next lock after the plan's last (a durable step's lifecycle
            locking read, ``FlowRunStateStore.lifecycle_lock``): when the plan ends with a
            created record and its history row, it rides in their round trip
            (``services.db_batch.execute_writes_if_absent``) and its rows are left in it
            (ADR 0016); otherwise — or with ``on_locked``, which pauses lock by lock —
            it is left unsent (its rows stay ``None``) for the caller to run.

    Raises:
        AlreadyExistsError: a record the plan creates exists (even soft-deleted).
        ValueError: a created key has no CREATE mutation.
    """
    creates = {
        business_key(m.object_name, m.record_id): m
        for m in mutations
        if m.kind is MutationKind.CREATE
    }
    missing = plan.creates - creates.keys()
    if missing:
        raise ValueError("every record the lock plan creates needs its CREATE mutation")
    pre = dict(locked or {})
    pre_history = dict(locked_history or {})
    ahead = len(pre) + len(pre_history)
    if ahead and set(plan.keys[:ahead]) != pre.keys() | pre_history.keys():
        raise ValueError("rows locked before the plan must head its canonical order")
    held = HeldLocks(org_id, plan, await db_now(conn) if now is None else now)
    began = time.perf_counter()
    keys = plan.keys
    #: History rows locked with their record (the plan's next key) in one statement.
    fused: dict[ResourceKey, int | None] = {}
    #: History rows of created records inserted with their record (the plan's next key)
    #: in one round trip: whether each was inserted.
    created: dict[ResourceKey, bool] = {}
    for index, key in enumerate(keys):
        obj, rid = key.object_or_namespace, key.record_identity
        if key.resource_class is ResourceClass.BUSINESS_RECORD:
            if key in plan.creates:
                state = _new_record(org_id, view, creates[key], held.now)
                encoded = store.fields_json(state.fields)
                lock_relevant = lock_relevant_relationships(view, obj)
                hkey = history_key(obj, rid)
                if index + 1 < len(keys) and keys[index + 1] == hkey:
                    # The new row and its history row — the plan's very next lock — in one
                    # round trip where the backend batches writes, record first (the §13.1
                    # order is the same); an existing record stops it before the history.
                    created[hkey] = await execute_writes_if_absent(
                        conn,
                        [
                            store.record_insert_write(
                                state,
                                lock_relevant,
                                encoded_fields=encoded,
                                on_duplicate=_exists(obj, rid),
                            ),
                            store.history_insert_write(org_id, obj, rid, 1, held.now),
                        ],
                        # The plan's last locks: the caller's next lock follows them in
                        # the §13.1 order with nothing between (ADR 0016).
                        then=then if index + 2 == len(keys) and on_locked is None else None,
                    )
                elif not await store.insert_record_txn(
                    conn, state, lock_relevant, encoded_fields=encoded
                ):
                    raise _exists(obj, rid)()
                held.rows[key] = state
                held.encoded_fields[key] = encoded
                held.pending_creates.add(key)
            elif key in pre:
                held.rows[key] = pre[key]
            elif index + 1 < len(keys) and keys[index + 1] == history_key(obj, rid):
                # Its history row is the plan's very next lock: both in one statement, the
                # record's row first (the §13.1 order is the same).
                row, last = await store.lock_record_history_txn(
                    conn, org_id, obj, rid, clocked=False
                )
                held.rows[key] = row
                fused[keys[index + 1]] = last
            else:
                held.rows[key] = await store.read_record_txn(conn, org_id, obj, rid, lock=True)
        elif key.resource_class is ResourceClass.HISTORY_SEQUENCE:
            if business_key(obj, rid) in plan.creates:
                # The new record's history row is inserted at 1: the create's own sequence,
                # reserved here under the new row's lock (one statement, no advance). Should
                # a row of that identity exist (its foreign key to the record forbids it),
                # the create's advance from 0 fences on it, as before.
                inserted = created.pop(key, None)
                if inserted is None:
                    inserted = await store.insert_history_txn(conn, org_id, obj, rid, 1, held.now)
                held.history[key] = 1 if inserted else 0
                if inserted:
                    held.reserved_creates.add(key)
            elif key in pre_history:
                held.history[key] = pre_history[key]
            elif key in fused:
                held.history[key] = fused.pop(key)
            else:
                held.history[key] = await store.lock_history_txn(conn, org_id, obj, rid)
        else:
            break  # Flow lifecycle classes follow; they are the caller's (canonical order)
        if on_locked is not None:
            await on_locked(key)
    metrics().locks_acquired(time.perf_counter() - began)
    return held
