"""Wake-signal acceptance and reads behind ``WakeSignalService`` (§10.6, §14.2).

:meth:`SignalService.submit` is the producer path of the resolution protocol:

1. validate (nothing is written on bad input, :mod:`runtime_svc.waits.evidence`);
2. one transaction: a version not above the producer key's newest accepted version is
   *stale* — a no-op answered with that newer signal; otherwise insert the signal on its
   unique ``(work scope, kind, key, token)``, or find it: the same token with the same
   body is a *duplicate* answered with the stored signal, a different body is refused
   (``FAILED_PRECONDITION``, ``wake_token_reused``) — a token names one notification;
3. only after that commit (``CrashPoint.AFTER_SIGNAL_COMMIT``) the fresh-transaction
   match against pending dependencies (§14.2 step 2), whose failure never fails the
   acknowledged submit: the signal's owed match stays for the repair sweep.

A ``SubmitWakeSignal`` retry with the same ``request_id`` replays the original answer
(:meth:`SignalService.submit_once`; the wake token stays the durable delivery identity).

The work scope is always the caller's trusted one (the credential's, checked against its
persisted binding by the API layer); a signal of another scope answers exactly like a
missing one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.store_waits import signal_insert
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import NewSignal, SignalRecord, SignalState, WorkScopeKey
from runtime_svc.schema import runtime_requests
from runtime_svc.waits import queries
from runtime_svc.waits.evidence import SignalSubmission, validate_submission
from runtime_svc.waits.record_producer import MATCH_GRACE, SIGNAL_RETENTION
from runtime_svc.waits.registry import ProducerRegistry
from runtime_svc.waits.resolution import Matcher, MatchFinish
from services.db import run_in_transaction, transaction
from services.db_batch import execute_writes_if_absent
from services.errors import FailedPreconditionError, NotFoundError
from services.faults import CrashPoint, crash_point
from services.invariants import InvariantError
from services.metrics import metrics
from services.request_dedupe import JoinedRecord, RequestKey, RequestLedger

__all__ = ["SignalService", "SubmitOutcome"]

log = logging.getLogger(__name__)

Clock = Callable[[AsyncConnection], Awaitable[datetime]]


@dataclass(frozen=True)
class SubmitOutcome:
    """The durable receipt of one submission."""

    signal: SignalRecord
    duplicate: bool = False
    stale: bool = False


#: ``(outcome, freshly inserted)`` of one acceptance transaction.
_Accepted = tuple[SubmitOutcome, bool]


def _inserted(
    scope: WorkScopeKey, new: NewSignal, now: datetime, expires_at: datetime
) -> SignalRecord:
    """The row :func:`insert_signal_txn` just wrote (no read-back needed)."""
    return SignalRecord(
        scope=scope,
        wake_signal_id=new.wake_signal_id,
        producer_kind=new.producer_kind,
        producer_key=new.producer_key,
        wake_token=new.wake_token,
        wake_version=new.wake_version,
        evidence_digest=new.evidence_digest,
        evidence_reference=new.evidence_reference,
        evidence_json=new.evidence_json,
        received_at=now,
        expires_at=expires_at,
        state=SignalState.UNMATCHED,
        dependency_id=None,
        state_version=0,
        next_match_at=now + MATCH_GRACE,
        consumed_at=None,
    )


def _final(
    outcome: SubmitOutcome, result: WaitTransition | NoChange, signal_id: str
) -> SubmitOutcome:
    """The answer to a freshly accepted signal after its match: consumed by the
    resolution that matched it (what that transaction wrote), or still unmatched with its
    owed match settled."""
    patch = result.signal if isinstance(result, WaitTransition) else None
    if patch is None or patch.wake_signal_id != signal_id:
        return SubmitOutcome(replace(outcome.signal, next_match_at=None))
    return SubmitOutcome(
        replace(
            outcome.signal,
            state=patch.to_state,
            dependency_id=patch.values["dependency_id"],
            consumed_at=patch.values["consumed_at"],
            next_match_at=None,
            state_version=outcome.signal.state_version + 1,
        )
    )


def _same_body(stored: SignalRecord, new: NewSignal) -> bool:
    return (
        stored.wake_version == new.wake_version
        and stored.evidence_digest == new.evidence_digest
        and stored.evidence_reference == new.evidence_reference
        and stored.evidence_json == new.evidence_json
    )


class SignalService:
    """Accept and read wake signals of trusted work scopes.

    Args:
        engine: the runtime database.
        matcher: the producer-side matcher.
        registry: the producer registry (what may be submitted).
        clock: the durable clock.
        retention: how long an unmatched signal stays queryable.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        matcher: Matcher,
        registry: ProducerRegistry,
        clock: Clock,
        *,
        retention: timedelta = SIGNAL_RETENTION,
    ) -> None:
        self._engine = engine
        self._matcher = matcher
        self._registry = registry
        self._clock = clock
        self._retention = retention
        self._ledger = RequestLedger(runtime_requests)

    async def submit(self, scope: WorkScopeKey, submission: SignalSubmission) -> SubmitOutcome:
        """Accept one notification (see the module docstring).

        Raises:
            InvalidArgumentError: invalid submission (nothing written).
            FailedPreconditionError: the token was accepted with another body.
        """
        new = validate_submission(submission, self._registry)
        outcome, fresh = await run_in_transaction(
            self._engine, lambda conn: self._accept_txn(conn, scope, new)
        )
        self._observed(new, outcome, fresh)
        return await self._matched(scope, new, outcome) if fresh else outcome

    async def submit_once(
        self,
        scope: WorkScopeKey,
        submission: SignalSubmission,
        key: RequestKey,
        encode: Callable[[SubmitOutcome], bytes],
    ) -> bytes:
        """:meth:`submit` deduplicated on the RPC's ``request_id`` (``key``,
        ``services.request_dedupe``): the ledger row commits with the signal. A freshly
        accepted signal records its acceptance as a provisional response and completes
        it with the post-match answer, so a retry replays the original answer (or, when
        the first call died before its match, the acceptance — the owed match is the
        repair sweep's); a duplicate or stale submission is final at once. A reuse of
        the id with another body is refused before anything happens.

        Raises:
            RequestIdReusedError: the id was used with another body.
            InvalidArgumentError, FailedPreconditionError: see :meth:`submit`.
        """
        new = validate_submission(submission, self._registry)
        # The ledger lookup reads the database clock in the same statement and keeps it
        # as the transaction's ``db_now``: the acceptance's clock read is answered from it.
        # For a versioned notification it also tells whether the acceptance read would
        # find anything; a new signal's ledger row rides in the signal INSERT's round trip.
        seen = (
            None
            if new.wake_version is None
            else queries.VersionedKeySeen(
                scope, new.producer_kind, new.producer_key, new.wake_token
            )
        )

        async def work(
            conn: AsyncConnection, _now: datetime, joined: JoinedRecord[_Accepted] | None
        ) -> _Accepted:
            return await self._accept_txn(conn, scope, new, joined=joined, seen=seen)

        done = await self._ledger.execute_joined_at(
            self._engine,
            key,
            work,
            lambda accepted: encode(accepted[0]),
            completed=lambda accepted: not accepted[1],
            also=seen,
        )
        if done.response is None:  # pragma: no cover - encode always answers
            raise InvariantError("a signal submission without a recorded response")
        if not done.replayed and done.value is not None:
            self._observed(new, done.value[0], done.value[1])
        if done.replayed or done.value is None or not done.value[1]:
            return done.response
        accepted = done.value[0]
        answered: list[bytes] = []

        async def finish(
            conn: AsyncConnection, result: WaitTransition | NoChange
        ) -> Callable[[], None]:
            # The post-match answer is known in the match's own transaction: the ledger
            # row is completed there (one write transaction less per wake than a
            # separate completion); it counts only once that transaction committed.
            response = await self._ledger.complete_txn(
                conn, key, encode(_final(accepted, result, new.wake_signal_id))
            )
            return lambda: answered.append(response)

        final = await self._matched(scope, new, accepted, finish)
        if answered:
            return answered[0]
        return await self._ledger.complete(self._engine, key, encode(final))

    async def _accept_txn(
        self,
        conn: AsyncConnection,
        scope: WorkScopeKey,
        new: NewSignal,
        *,
        joined: JoinedRecord[_Accepted] | None = None,
        seen: queries.VersionedKeySeen | None = None,
    ) -> _Accepted:
        """Step 2 of the module docstring: ``(outcome, freshly inserted)``.

        ``joined``: the request ledger's row, written last in the new signal's INSERT
        round trip; ``seen``: the ledger lookup's answer whether a versioned submission's
        acceptance read would find anything (``False``: the read is skipped).
        """
        now = await self._clock(conn)
        existing = None
        if new.wake_version is not None and (seen is None or seen.seen):
            # A versioned notification: a duplicate answers its own receipt, and one at
            # or below the key's newest version is stale — both decided before inserting.
            # One read: the token's row, else the key's newest versioned row.
            found = await queries.token_or_latest_txn(
                conn, scope, new.producer_kind, new.producer_key, new.wake_token
            )
            if found is not None and found.wake_token == new.wake_token:
                existing = found
            elif found is not None and (found.wake_version or 0) >= new.wake_version:
                return SubmitOutcome(found, stale=True), False
        # Unversioned (the common case): the insert itself is the duplicate check — the
        # token's unique key refuses a second row, which is then read back.
        if existing is None:
            fresh = SubmitOutcome(_inserted(scope, new, now, now + self._retention)), True
            writes = [
                signal_insert(
                    scope, new, now, expires_at=now + self._retention, match_at=now + MATCH_GRACE
                )
            ]
            recording = None if joined is None else joined.write(fresh)
            if recording is not None:
                writes.append(recording)
            # The signal's INSERT first: its duplicate key (a retry, a concurrent submit)
            # stops the round trip before the ledger's row (ADR 0010).
            if await execute_writes_if_absent(conn, writes):
                return fresh
            # The token was accepted before (a retry) or by a concurrent submit: read it.
            existing = await queries.signal_by_token_txn(
                conn, scope, new.producer_kind, new.producer_key, new.wake_token
            )
            if existing is None:  # pragma: no cover - the unique key just said so
                raise FailedPreconditionError("wake signal vanished", reason="internal")
        if not _same_body(existing, new):
            raise FailedPreconditionError(
                "wake_token was already accepted for this producer key with a different "
                "wake_version or evidence; a token names one notification",
                reason="wake_token_reused",
                field_path="wake_token",
            )
        return SubmitOutcome(existing, duplicate=True), False

    def _observed(self, new: NewSignal, outcome: SubmitOutcome, fresh: bool) -> None:
        """Count the submission by producer family and kind (new, stale, duplicate)."""
        spec = self._registry.spec(new.producer_kind)
        kind = "new" if fresh else "stale" if outcome.stale else "duplicate"
        metrics().signal_submitted(spec.family.value if spec else "unknown", kind)

    async def _matched(
        self,
        scope: WorkScopeKey,
        new: NewSignal,
        outcome: SubmitOutcome,
        finish: MatchFinish | None = None,
    ) -> SubmitOutcome:
        """Step 3: the fresh-transaction match after the signal's commit (``finish``:
        the request's completion, in the match's transaction when it is one)."""
        crash_point(CrashPoint.AFTER_SIGNAL_COMMIT, new.producer_kind)
        try:
            result = await self._matcher.match_signal(
                scope, new.wake_signal_id, accepted=outcome.signal, finish=finish
            )
        except Exception:
            # Acknowledged already: the owed match is the repair sweep's now.
            log.warning("signal %s: match deferred to the sweep", new.wake_signal_id, exc_info=True)
            return outcome
        return _final(outcome, result, new.wake_signal_id)

    async def get(
        self,
        scope: WorkScopeKey,
        *,
        wake_signal_id: str | None = None,
        natural_key: tuple[str, str, str] | None = None,
    ) -> SignalRecord:
        """One signal of ``scope`` by id or by ``(kind, key, token)``.

        Raises:
            NotFoundError: missing, or in another work scope (indistinguishable).
        """
        async with transaction(self._engine, readonly=True) as conn:
            if wake_signal_id is not None:
                found = await queries.signal_by_id_txn(conn, scope, wake_signal_id)
                shown = wake_signal_id
            else:
                if natural_key is None:
                    raise InvariantError("a signal lookup without an id or a natural key")
                found = await queries.signal_by_token_txn(conn, scope, *natural_key)
                shown = "/".join(natural_key)
        if found is None:
            raise NotFoundError("wake_signal", shown)
        return found
