"""The ``record.change`` producer (§14.1): the record engine writes a wake signal in the
same transaction as the record change — producer evidence shares the database, so both
facts commit together (§14.2 step 1).

**Who pays.** Only objects some plan waits on with a record-condition wait: the wait
commit registers ``(work scope, object)`` in ``flow_record_watches``
(:meth:`RecordWatches.watch_txn`), and the record engine consults a per-process memo of
that table (:meth:`RecordWatches.scopes_txn`), reloaded at most once per
``ttl_s`` per org and at once after a local wait commit. A write of an object nobody
waits on costs no query beyond the memo's periodic reload. A memo that is briefly stale
in another process only delays a wake: the dependency's bounded reconciliation re-reads
the record itself (§14.2 step 5).

**The signal.** One per record version and waiting work scope: kind ``record.change``,
key ``<object>/<record id>``, token ``v<version>``, wake version = the record version
(monotonic), evidence ``{"object", "record_id", "version", "deleted"}`` (no field values:
the condition is evaluated against the record itself at resolution). The producer-side
match runs after the record transaction committed (:meth:`RecordChangeProducer.flush`);
a crash in between leaves the signal's owed match for the repair sweep.
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler.kinds import RECORD_CHANGE_PRODUCER
from runtime_svc.kernel.store_waits import insert_signal_txn
from runtime_svc.kernel.wait_model import NewSignal, WorkScopeKey
from runtime_svc.records.model import RecordState
from runtime_svc.schema import flow_record_watches
from runtime_svc.waits.evidence import evidence_digest
from services.db import insert_if_absent
from services.digest import canonical_json

if TYPE_CHECKING:
    from runtime_svc.waits.resolution import Matcher

__all__ = [
    "DEFAULT_WATCH_TTL_S",
    "SIGNAL_RETENTION",
    "RecordChangeProducer",
    "RecordWatches",
    "record_key",
]

log = logging.getLogger(__name__)

#: How long a process trusts its memo of an org's watched objects.
DEFAULT_WATCH_TTL_S = 2.0
#: Unmatched record signals stay queryable for the default maximum wait plus a day.
SIGNAL_RETENTION = timedelta(days=31)
#: Orgs whose watched objects one process remembers.
_MAX_MEMO_ORGS = 10_000
#: A producer-side match is owed this long after commit before the repair sweep takes it.
MATCH_GRACE = timedelta(seconds=2)


def record_key(object_name: str, record_id: str) -> str:
    """The ``record.change`` producer key of one record."""
    return f"{object_name}/{record_id}"


class RecordWatches:
    """The per-process memo of ``flow_record_watches`` (see the module docstring)."""

    def __init__(self, ttl_s: float = DEFAULT_WATCH_TTL_S) -> None:
        self._ttl = ttl_s
        self._memo: dict[str, tuple[float, dict[str, tuple[WorkScopeKey, ...]]]] = {}

    def invalidate(self, org_id: str) -> None:
        """Forget ``org_id``'s memo (the next write of the org reloads it)."""
        self._memo.pop(org_id, None)

    async def scopes_txn(
        self, conn: AsyncConnection, org_id: str, object_name: str
    ) -> tuple[WorkScopeKey, ...]:
        """The work scopes waiting on ``object_name`` records of ``org_id``."""
        entry = self._memo.get(org_id)
        if entry is None or time.monotonic() - entry[0] > self._ttl:
            w = flow_record_watches.c
            rows = (await conn.execute(select(flow_record_watches).where(w.org_id == org_id))).all()
            objects: dict[str, list[WorkScopeKey]] = {}
            for r in rows:
                objects.setdefault(r.object_name, []).append(
                    WorkScopeKey(
                        r.org_id,
                        r.app_installation_id,
                        r.runtime_capability_id,
                        r.runtime_work_binding_digest,
                    )
                )
            entry = (time.monotonic(), {k: tuple(sorted(v, key=str)) for k, v in objects.items()})
            self._memo.pop(org_id, None)
            self._memo[org_id] = entry
            while len(self._memo) > _MAX_MEMO_ORGS:  # bounded: the oldest load goes first
                self._memo.pop(next(iter(self._memo)))
        return entry[1].get(object_name, ())

    async def watch_txn(
        self, conn: AsyncConnection, scope: WorkScopeKey, object_name: str, now: datetime
    ) -> None:
        """Register (or refresh) ``scope``'s watch of ``object_name`` inside the wait
        commit, so the record engine signals that object's changes from now on."""
        w = flow_record_watches.c
        key = [
            w.org_id == scope.org_id,
            w.object_name == object_name,
            w.app_installation_id == scope.app_installation_id,
            w.runtime_capability_id == scope.runtime_capability_id,
            w.runtime_work_binding_digest == scope.runtime_work_binding_digest,
        ]
        result = await conn.execute(
            update(flow_record_watches).where(*key).values(refreshed_at=now)
        )
        if result.rowcount == 0:
            await insert_if_absent(
                conn,
                flow_record_watches,
                {
                    "org_id": scope.org_id,
                    "object_name": object_name,
                    "app_installation_id": scope.app_installation_id,
                    "runtime_capability_id": scope.runtime_capability_id,
                    "runtime_work_binding_digest": scope.runtime_work_binding_digest,
                    "refreshed_at": now,
                },
            )
        self.invalidate(scope.org_id)


#: Signals written by the current task's record transaction, matched after its commit.
_WRITTEN: contextvars.ContextVar[list[tuple[WorkScopeKey, str]] | None] = contextvars.ContextVar(
    "nexus_flow_record_signals", default=None
)


class RecordChangeProducer:
    """Writes ``record.change`` signals inside record transactions and matches them
    after commit.

    Args:
        watches: the memo of waited-on objects.
        matcher: the producer-side matcher (``None``: the repair sweep matches).
    """

    def __init__(self, watches: RecordWatches, matcher: Matcher | None = None) -> None:
        self.watches = watches
        self.matcher = matcher

    async def on_change_txn(
        self, conn: AsyncConnection, org_id: str, record: RecordState, now: datetime
    ) -> int:
        """Inside the record transaction, after the record, history, event and audit rows
        were built (a durable step sends them after this, with its commit — ADR 0011):
        one signal per work scope waiting on the record's object. Returns how many."""
        scopes = await self.watches.scopes_txn(conn, org_id, record.object_name)
        if not scopes:
            return 0
        evidence = {
            "object": record.object_name,
            "record_id": record.record_id,
            "version": record.version,
            "deleted": record.is_deleted,
        }
        written = _WRITTEN.get()
        for scope in scopes:
            signal = NewSignal(
                wake_signal_id=f"sig_{uuid.uuid4().hex}",
                producer_kind=RECORD_CHANGE_PRODUCER,
                producer_key=record_key(record.object_name, record.record_id),
                wake_token=f"v{record.version}",
                wake_version=record.version,
                evidence_digest=evidence_digest(evidence),
                evidence_reference=None,
                evidence_json=canonical_json(evidence).decode(),
            )
            inserted = await insert_signal_txn(
                conn,
                scope,
                signal,
                now,
                expires_at=now + SIGNAL_RETENTION,
                match_at=now + MATCH_GRACE,
            )
            if inserted and written is not None:
                written.append((scope, signal.wake_signal_id))
        return len(scopes)

    @contextmanager
    def collect(self) -> Iterator[list[tuple[WorkScopeKey, str]]]:
        """Collect the signals the enclosed record transaction writes (a retried
        transaction must clear the list it re-runs into: see :meth:`reset`)."""
        written: list[tuple[WorkScopeKey, str]] = []
        token = _WRITTEN.set(written)
        try:
            yield written
        finally:
            _WRITTEN.reset(token)

    @staticmethod
    def reset() -> None:
        """Forget signals collected by a transaction attempt that rolled back."""
        written = _WRITTEN.get()
        if written is not None:
            written.clear()

    async def flush(self, written: list[tuple[WorkScopeKey, str]]) -> None:
        """After commit: the producer-side match of each signal written (§14.2 step 2).
        A failure leaves the owed match to the repair sweep; it never fails the write."""
        if self.matcher is None:
            return
        for scope, signal_id in written:
            try:
                await self.matcher.match_signal(scope, signal_id)
            except Exception:
                log.warning(
                    "record signal %s: match deferred to the sweep", signal_id, exc_info=True
                )
