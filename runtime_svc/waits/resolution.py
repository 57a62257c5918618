"""Matching: which evidence resolves which dependency (§14.2 steps 2, 4, 5).

:class:`Matcher` is called from both sides of the notify-before-wait race and by the
periodic reconciler:

* **producer side** — :meth:`Matcher.match_signal`, in a fresh transaction after the
  signal committed (§14.2 step 2): the pending dependencies of the signal's
  ``(scope, kind, key)`` are tried in creation order;
* **dependency side** — :meth:`Matcher.reconcile`, right after the wait committed
  (§14.2 step 4), and from the reconciler's bounded probes.

Either way :meth:`Matcher.match_dependency` reads the authoritative producer evidence
without locks and, when the dependency is satisfied, hands one root-first resolution to
the kernel (:class:`~runtime_svc.kernel.store_waits.WaitStore`), which re-validates every
row under lock; a lost race answers ``NoChange`` and the caller re-reads. Per family:

* ``runtime.timer`` — due when its ``next_probe_at`` has passed (database clock);
* ``record.change`` — the record is read and the condition evaluated against it
  (``$Event`` = its fields); a deleted record fails the producer's existence check and
  the compiled expiry policy applies at once (``dependency_producer_deleted``);
* external kinds and ``effect.completion`` — the unmatched signals of the key, highest
  wake version first; an event condition is evaluated against each signal's evidence.

A dependency whose producer kind is not registered quarantines
(``dependency_producer_missing``, §10.5): it is never polled forever.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import ExpressionEvalError, evaluate, parse_expression
from runtime_svc.compiler.expressions import Expr, ExpressionError
from runtime_svc.compiler.plan import DependencyDecl, ExecutionPlan
from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.model import RunRecord
from runtime_svc.kernel.states import RunState
from runtime_svc.kernel.store_reads import Candidate, get_run_txn
from runtime_svc.kernel.store_waits import (
    FaultStep,
    HeldRun,
    WaitStore,
    lock_waiting_txn,
    read_dependency_txn,
)
from runtime_svc.kernel.transitions_waits import (
    CAUSE_PRODUCER_DELETED,
    CAUSE_PRODUCER_MISSING,
    WaitTransition,
)
from runtime_svc.kernel.wait_model import (
    DependencyRecord,
    DependencyState,
    SignalRecord,
    WorkScopeKey,
)
from runtime_svc.observability.hooks import wait_resolved
from runtime_svc.records.store import read_record_txn
from runtime_svc.schema import flow_step_executions
from runtime_svc.waits import queries
from runtime_svc.waits.plans import PlanSource, WaitBounds
from runtime_svc.waits.preclaim import PreClaimer, PreClaims
from runtime_svc.waits.registry import ProducerFamily, ProducerRegistry
from runtime_svc.worker.executor import env_of
from services.db import run_in_transaction, scoped_select, transaction
from services.errors import FenceLostError, NotFoundError
from services.faults import CrashPoint, crash_point
from services.metrics import metrics

__all__ = [
    "Clock",
    "MatchFinish",
    "Matcher",
    "ResolvedRun",
    "WaitContext",
    "evaluate_condition",
    "split_record_key",
]

#: The durable clock (the run store's; tests shift it).
Clock = Callable[[AsyncConnection], Awaitable[datetime]]

#: Extra work of the producer's request in the transaction that matched its signal (the
#: ``SubmitWakeSignal`` request-ledger row completed with the final answer, which is
#: known there): called inside that transaction with its result, it returns what to run
#: once the transaction committed (a rolled-back or retried attempt's is never run).
MatchFinish = Callable[[AsyncConnection, WaitTransition | NoChange], Awaitable[Callable[[], None]]]

log = logging.getLogger(__name__)

#: Candidates one match attempt considers (dependencies of a key, signals of a key).
_CANDIDATES = 20

#: A waiting step's plan key (the context read of a dependency whose step is not locked).
_PLAN_STEP_KEY = scoped_select(
    flow_step_executions, ("step_execution_id",), columns=("plan_step_key",)
)


@functools.lru_cache(maxsize=2048)
def _parsed(text: str) -> Expr:
    return parse_expression(text)


def evaluate_condition(condition: str | None, env: Mapping[str, Any]) -> bool:
    """Whether ``condition`` holds in ``env`` (no condition: true). A condition that does
    not evaluate to ``true`` — ``null``, a non-boolean, an evaluation error on this
    evidence — does not hold; the dependency keeps waiting."""
    if not condition:
        return True
    try:
        return evaluate(_parsed(condition), env) is True
    except (ExpressionError, ExpressionEvalError):
        return False


def split_record_key(producer_key: str) -> tuple[str, str]:
    """``(object, record id)`` of a ``record.change`` producer key ``<object>/<id>``."""
    obj, _, rid = producer_key.partition("/")
    return obj, rid


@dataclass(frozen=True)
class WaitContext:
    """What a match needs about the waiting run (read without locks)."""

    root: RunRecord
    plan: ExecutionPlan
    plan_step_key: str
    decl: DependencyDecl | None
    bounds: WaitBounds

    def fault_step(self) -> FaultStep | None:
        """The compiled fault-path successor of the waiting step, if any."""
        if self.decl is None or self.decl.fault_successor is None:
            return None
        try:
            target = self.plan.step(self.decl.fault_successor)
        except (KeyError, LookupError):
            return None
        queue = target.queue_class.value if target.queue_class else "durable_mutation"
        return FaultStep(target.key, target.kind.value, queue)


@dataclass(frozen=True)
class ResolvedRun:
    """A run a resolution made runnable: the workers' wakeup hint (the claim re-validates
    everything; a stale hint claims nothing)."""

    org_id: str
    flow_run_id: str
    #: The resumed step as the resolution left it (versions it wrote): the worker claims
    #: it directly, without a candidate read; ``None`` (a fault path, an expiry) means
    #: the worker reads the run's current candidate first.
    candidate: Candidate | None = None


class Matcher:
    """Matches dependencies and signals and resolves through the kernel.

    Args:
        engine: the runtime database.
        waits: the kernel's root-first wait transitions.
        registry: the producer registry.
        plans: plan and wait-bound caches.
        clock: the durable clock (the run store's).
        on_resolved: called after a transition made a waiting run runnable again, with
            the run (wakes this process's workers; the hint lets one claim it directly).

    Attributes:
        preclaim: the pre-claimed wake (``docs/adr/0007-pre-claimed-wake.md``), set by a
            process whose workers take woken steps (``runtime_svc.worker.background``):
            a resolution then claims the resumed step for a local worker with room in
            its own transaction, and hands it over after ``COMMIT`` instead of
            publishing the hint. ``None`` (an API-only process, tests of the hinted
            path): never.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        waits: WaitStore,
        registry: ProducerRegistry,
        plans: PlanSource,
        clock: Clock,
        *,
        on_resolved: Callable[[ResolvedRun], None] | None = None,
    ) -> None:
        self._on_resolved = on_resolved
        self.preclaim: PreClaimer | None = None
        self._engine = engine
        self.waits = waits
        self.registry = registry
        self.plans = plans
        self._clock = clock

    # --- context ------------------------------------------------------------------------

    async def context_txn(
        self, conn: AsyncConnection, dep: DependencyRecord, held: HeldRun | None = None
    ) -> WaitContext:
        """The waiting run, its plan step's dependency declaration and wait bounds
        (``held``: root and step as the caller's transaction locked them — not read
        again).

        Raises:
            NotFoundError: the run, step or plan is gone.
        """
        key: str | None
        if held is not None:
            root = held.root
            key = None if held.step is None else held.step.plan_step_key
        else:
            root = await get_run_txn(conn, dep.org_id, dep.flow_run_id, include_deleted=True)
            params = {"org_id": dep.org_id, "step_execution_id": dep.step_execution_id}
            key = (await conn.execute(_PLAN_STEP_KEY, params)).scalar_one_or_none()
        if key is None:
            raise NotFoundError("flow_step_execution", dep.step_execution_id)
        row, plan = await self.plans.plan_txn(conn, dep.org_id, root.plan_id)
        try:
            decl = plan.step(str(key)).dependency
        except (KeyError, LookupError):
            decl = None
        bounds = await self.plans.bounds_txn(conn, dep.org_id, row.policy_version)
        return WaitContext(root, plan, str(key), decl, bounds)

    async def _env(self, conn: AsyncConnection, root: RunRecord) -> dict[str, Any]:
        """The run's variables at its resume point (conditions may read them)."""
        if root.current_checkpoint_id is None:
            return {}
        payload = await queries.checkpoint_context_txn(
            conn, root.org_id, root.flow_run_id, root.current_checkpoint_id
        )
        if payload is None:
            raise NotFoundError("flow_checkpoint", root.current_checkpoint_id)
        context = json.loads(payload) or {}
        return env_of(context) if isinstance(context, dict) else {}

    # --- entry points -------------------------------------------------------------------

    async def reconcile(self, org_id: str, dependency_id: str) -> WaitTransition | NoChange:
        """Dependency side (§14.2 step 4): a fresh-snapshot match of one dependency —
        the dependency and its producer's evidence read in ONE read-only transaction
        (round 6: one transaction per wait and effect commit fewer than a read of the
        dependency followed by :meth:`probe`'s), closed before the root-first
        resolution transaction opens, which re-validates everything under its locks."""
        planned: tuple[_Action, WaitBounds | None] | None = None
        async with transaction(self._engine, readonly=True) as conn:
            dep = await read_dependency_txn(conn, org_id, dependency_id)
            if dep is not None and dep.state is DependencyState.PENDING:
                planned = await self._evidence(conn, dep, signals_first=True)
        if dep is None:
            return NoChange("missing")
        if planned is None:
            return NoChange(f"dependency_{dep.state.code.lower()}")
        return await self._run_action(planned[0], dep)

    async def match_signal(
        self,
        scope: WorkScopeKey,
        signal_id: str,
        *,
        accepted: SignalRecord | None = None,
        finish: MatchFinish | None = None,
    ) -> WaitTransition | NoChange:
        """Producer side (§14.2 step 2): read the signal, its key's pending dependencies
        (creation order) and their evidence in one fresh read-only transaction, then try
        the resolutions in that order; the owed match is settled (a consumed signal's
        mark is cleared by the consume itself).

        ``accepted`` is the row the caller's committed acceptance transaction just wrote
        (its identity, key and owed-match mark): the signal is then not read back. Only
        its immutable identity is used; the resolution locks and re-validates the row.
        The match then runs as :meth:`_match_accepted` (one transaction) when it can;
        ``finish`` runs in that transaction only (the caller does its work itself when
        ``finish``'s commit callback was not called)."""
        if accepted is not None and accepted.wake_signal_id == signal_id:
            fused = await self._match_accepted(accepted, finish)
            if fused is not None:
                return fused
        async with transaction(self._engine, readonly=True) as conn:
            if accepted is not None and accepted.wake_signal_id == signal_id:
                signal: SignalRecord | None = accepted
            else:
                signal = await queries.signal_by_id_txn(conn, scope, signal_id)
            if signal is None:
                return NoChange("missing")
            deps = await queries.pending_for_key_txn(
                conn, scope, signal.producer_kind, signal.producer_key, _CANDIDATES
            )
            planned = [(dep, await self._evidence(conn, dep)) for dep in deps]
        result: WaitTransition | NoChange = NoChange("no_dependency")
        for dep, (action, _bounds) in planned:
            result = await self._run_action(action, dep)
            if isinstance(result, WaitTransition) and (
                result.signal is None or result.signal.wake_signal_id == signal.wake_signal_id
            ):
                break
        if signal.next_match_at is not None and not _consumed(result, signal):
            async with transaction(self._engine) as conn:
                await queries.clear_signal_match_txn(conn, signal)
        return result

    async def _match_accepted(
        self, signal: SignalRecord, finish: MatchFinish | None = None
    ) -> WaitTransition | NoChange | None:
        """The producer-side match of a just-accepted signal in ONE fresh transaction:
        the key's pending dependency and its evidence are read without locks, then the
        root-first resolution (root → step → dependency → signal) runs in the same
        transaction — one transaction less on every wake than a read-only discovery
        transaction followed by the resolution's. A signal no dependency waits for yet
        has its owed-match mark cleared in that transaction too.

        The dependency's root and waiting step are locked (root → step) right after the
        discovery and the evidence read uses them, so the resolution continues the
        lifecycle order at the dependency and signal: the run and the step are read
        once, not read and then locked again (three statements less per wake than an
        unlocked evidence read followed by ``resolve_in``'s own discovery and locks).
        Nor are the dependency and the signal locked and read again after their
        discovery and evidence reads: the resolution decides on those reads and their
        conditional UPDATEs (expected version and from-state) are the fence, taking the
        dependency's and the signal's row locks in the same order (two statements less).

        Only the common shape is fused: at most one pending dependency of the key and an
        evidence read that decides a resolution or nothing. Anything else (several
        waiters of one key — whose resolutions must not hold one run's locks while
        locking another's root — or an expiry) answers ``None`` with nothing written,
        and the caller runs the two-transaction match. So does a lost compare-and-swap
        (a row moved after this transaction read it): the whole transaction rolls back
        and the two-transaction match re-reads, locks, and decides again.
        ``finish`` (the producer request's own completion) runs last in the transaction;
        its commit callback runs after the commit.

        With :attr:`preclaim`, the resolution also claims the resumed step for a local
        worker with room (ADR 0007); a rolled-back or retried attempt gives its
        reservation back, a committed one is handed over after the commit.
        """
        claims = None if self.preclaim is None else self.preclaim.begin()

        async def fn(
            conn: AsyncConnection,
        ) -> tuple[
            WaitTransition | NoChange,
            DependencyRecord | None,
            _Action | None,
            Callable[[], None] | None,
        ]:
            if claims is not None:
                claims.rolled_back()  # a previous attempt of this transaction, if any
            deps = await queries.pending_for_key_txn(
                conn, signal.scope, signal.producer_kind, signal.producer_key, 2
            )
            if len(deps) > 1:
                raise _Unfused
            result: WaitTransition | NoChange = NoChange("no_dependency")
            dep = deps[0] if deps else None
            action = None
            if dep is not None:
                held = await lock_waiting_txn(conn, dep)
                if held is None:  # the run is gone: the general path answers it
                    raise _Unfused
                action, _bounds = await self._evidence(conn, dep, held)
                if action.expire is not None:
                    raise _Unfused
                # The dependency and signals this transaction read are not locked and
                # read again: their compare-and-swaps fence them (HeldRun).
                seen = replace(held, dependency=dep, signals=action.seen)
                result = await action.resolve_in(self.waits, conn, dep, seen, claims)
            if signal.next_match_at is not None and not _consumed(result, signal):
                await queries.clear_signal_match_txn(conn, signal)
            done = None if finish is None else await finish(conn, result)
            return result, dep, action, done

        try:
            result, dep, action, done = await run_in_transaction(self._engine, fn)
        except (_Unfused, FenceLostError):
            # _Unfused: nothing was written. FenceLostError: a row moved after this
            # transaction read it (a concurrent transition, or a signal another
            # dependency consumed): everything rolled back, and the two-transaction
            # match re-reads and locks before it decides — it settles the owed match
            # and answers like a lost resolution when nothing is left.
            if claims is not None:
                claims.rolled_back()
            return None
        except BaseException:
            if claims is not None:
                claims.rolled_back()
            raise
        if done is not None:
            done()
        if isinstance(result, WaitTransition) and dep is not None and action is not None:
            action.committed(dep, result)
            result = self._woken(result, dep, claims)
        elif claims is not None:
            claims.rolled_back()
        return result

    async def match_dependency(self, dep: DependencyRecord) -> WaitTransition | NoChange:
        """Resolve (or, for a failed existence check or a missing producer, expire)
        ``dep`` when its producer's authoritative evidence satisfies it.

        Evidence is read in one read-only transaction that is closed before the
        root-first resolution transaction opens (no transaction waits on another)."""
        result, _ = await self.probe(dep)
        return result

    async def probe(
        self, dep: DependencyRecord
    ) -> tuple[WaitTransition | NoChange, WaitBounds | None]:
        """:meth:`match_dependency`, also returning the dependency's wait bounds (the
        reconciler reschedules an unsuccessful probe with them)."""
        if dep.state is not DependencyState.PENDING:
            return NoChange(f"dependency_{dep.state.code.lower()}"), None
        async with transaction(self._engine, readonly=True) as conn:
            action, bounds = await self._evidence(conn, dep)
        return await self._run_action(action, dep), bounds

    async def _run_action(
        self, action: _Action, dep: DependencyRecord
    ) -> WaitTransition | NoChange:
        """``action`` in its own root-first transaction(s), pre-claiming the resumed
        step when this process takes woken steps (:attr:`preclaim`), then
        :meth:`_woken`."""
        claims = None if self.preclaim is None else self.preclaim.begin()
        try:
            result = await action.run(self.waits, dep, claims)
        except BaseException:
            if claims is not None:
                claims.rolled_back()
            raise
        return self._woken(result, dep, claims)

    def _woken(
        self,
        result: WaitTransition | NoChange,
        dep: DependencyRecord,
        claims: PreClaims | None = None,
    ) -> WaitTransition | NoChange:
        # The resolution claimed the resumed step for a local worker (ADR 0007): hand
        # the committed claim over — no hint, nothing left for anyone to claim.
        preclaimed = result.preclaimed if isinstance(result, WaitTransition) else None
        if claims is not None and claims.deliver(preclaimed):
            return result
        # A run became runnable (resumed or on its fault path): wake the local workers,
        # naming the run so a worker claims its step without a discovery pass.
        if preclaimed is None and (
            self._on_resolved is not None
            and isinstance(result, WaitTransition)
            and result.transition.run is not None
            and result.transition.run.to_state is RunState.RUNNABLE
        ):
            self._on_resolved(ResolvedRun(dep.scope.org_id, dep.flow_run_id, result.resumed))
        return result

    async def _evidence(
        self,
        conn: AsyncConnection,
        dep: DependencyRecord,
        held: HeldRun | None = None,
        *,
        signals_first: bool = False,
    ) -> tuple[_Action, WaitBounds | None]:
        """What the producer's evidence says about ``dep`` (read, never written;
        ``held``: its root and step as the caller's transaction locked them).

        ``signals_first`` (the fresh reconciliation right after a wait's commit, which
        needs no wait bounds): a signal-evidence wait reads its key's unmatched signals
        before the run's context and answers ``no_signal`` at once when there are none —
        the common case, a dependency nothing has notified yet (an effect's completion
        dependency cannot have a receipt before its own submit committed): two
        statements instead of five."""
        spec = self.registry.spec(dep.producer_kind)
        if spec is None:
            log.warning(
                "dependency %s: producer %s is not registered", dep.dependency_id, dep.producer_kind
            )
            metrics().producer_missing()
            return _Action(expire=CAUSE_PRODUCER_MISSING, quarantine=True), None
        if spec.family is ProducerFamily.TIMER:
            return replace(await self._timer(conn, dep), family=spec.family.value), None
        candidates: list[SignalRecord] | None = None
        if signals_first and spec.family is not ProducerFamily.RECORD_CHANGE:
            candidates = await self._candidates(conn, dep)
            if not candidates:
                return _Action(NoChange("no_signal")), None
        try:
            ctx = await self.context_txn(conn, dep, held)
        except NotFoundError:
            return _Action(NoChange("run_missing")), None
        if spec.family is ProducerFamily.RECORD_CHANGE:
            return replace(await self._record(conn, dep, ctx), family=spec.family.value), ctx.bounds
        return await self._signals(conn, dep, ctx, spec.family, candidates), ctx.bounds

    # --- families (evidence reads; the transitions run after the read closed) ----------

    async def _timer(self, conn: AsyncConnection, dep: DependencyRecord) -> _Action:
        now = await self._clock(conn)
        due = dep.next_probe_at
        if due is None or due > now:
            return _Action(NoChange("not_due"))
        receipt = {"producer": dep.producer_kind, "due_at": due.isoformat()}
        return _Action(resolve=[(None, receipt, None)], notified={None: _Notice(due)})

    async def _record(
        self, conn: AsyncConnection, dep: DependencyRecord, ctx: WaitContext
    ) -> _Action:
        obj, rid = split_record_key(dep.producer_key)
        record = await read_record_txn(conn, dep.org_id, obj, rid)
        if record is None:
            # The producer's existence check failed: the condition can never hold.
            return _Action(expire=CAUSE_PRODUCER_DELETED, fault=ctx.fault_step())
        env = await self._env(conn, ctx.root)
        env["$Event"] = {**record.fields, "Id": record.record_id}
        if not evaluate_condition(None if ctx.decl is None else ctx.decl.condition, env):
            return _Action(NoChange("condition_false"))
        # The newest signal at or below the version just evaluated is consumed as the
        # wake receipt; without one (the record matched before any signal), the record
        # itself is the evidence.
        candidates = await queries.unmatched_for_key_txn(
            conn, dep.scope, dep.producer_kind, dep.producer_key, _CANDIDATES
        )
        signal = next(
            (s for s in candidates if s.wake_version is None or s.wake_version <= record.version),
            None,
        )
        receipt = {
            "producer": dep.producer_kind,
            "record_version": record.version,
            "condition_digest": dep.condition_digest,
        }
        signal_id = None if signal is None else signal.wake_signal_id
        notified = {} if signal is None else {signal_id: _Notice.of(signal)}
        return _Action(
            resolve=[(signal_id, receipt, record.version)],
            notified=notified,
            seen=() if signal is None else (signal,),
        )

    async def _candidates(self, conn: AsyncConnection, dep: DependencyRecord) -> list[SignalRecord]:
        return await queries.unmatched_for_key_txn(
            conn, dep.scope, dep.producer_kind, dep.producer_key, _CANDIDATES
        )

    async def _signals(
        self,
        conn: AsyncConnection,
        dep: DependencyRecord,
        ctx: WaitContext,
        family: ProducerFamily,
        candidates: list[SignalRecord] | None = None,
    ) -> _Action:
        """``candidates``: the key's unmatched signals when the caller read them in this
        transaction already."""
        if candidates is None:
            candidates = await self._candidates(conn, dep)
        if not candidates:
            return _Action(NoChange("no_signal"))
        # An effect completion's plan condition is the owner receipt itself; an event
        # wait's condition reads the signal's evidence as $Event.
        condition = None
        if family is ProducerFamily.EXTERNAL and ctx.decl is not None:
            condition = ctx.decl.condition
        env = await self._env(conn, ctx.root) if condition else {}
        attempts: list[tuple[str | None, dict[str, Any], int | None]] = []
        notified: dict[str | None, _Notice] = {}
        for signal in candidates:
            if condition:
                evidence = json.loads(signal.evidence_json) if signal.evidence_json else {}
                if not evaluate_condition(condition, {**env, "$Event": evidence}):
                    continue
            receipt = {
                "producer": dep.producer_kind,
                "wake_signal_id": signal.wake_signal_id,
                "wake_token": signal.wake_token,
                "wake_version": signal.wake_version,
                "evidence_digest": signal.evidence_digest,
            }
            if family is ProducerFamily.EFFECT_COMPLETION:
                # The dependency keeps what the owner reported (a later cancellation
                # names an effect that happened; §10.1): command and outcome.
                receipt.update(_effect_outcome(signal.evidence_json))
            attempts.append((signal.wake_signal_id, receipt, None))
            notified[signal.wake_signal_id] = _Notice.of(signal)
        if not attempts:
            return _Action(NoChange("condition_false"))
        return _Action(
            resolve=attempts, notified=notified, family=family.value, seen=tuple(candidates)
        )


class _Unfused(Exception):
    """The fused match does not apply: roll back (nothing was written) and run the
    two-transaction match instead."""


def _consumed(result: WaitTransition | NoChange, signal: SignalRecord) -> bool:
    """Whether ``result`` consumed ``signal`` (the consume clears its owed match)."""
    return (
        isinstance(result, WaitTransition)
        and result.signal is not None
        and result.signal.wake_signal_id == signal.wake_signal_id
    )


def _effect_outcome(evidence_json: str | None) -> dict[str, Any]:
    """``command_id`` and ``outcome`` of a completion receipt's evidence (safe fields)."""
    try:
        doc = json.loads(evidence_json) if evidence_json else {}
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: doc[k] for k in ("command_id", "outcome") if isinstance(doc.get(k), str)}


#: A signal that another dependency consumed (or that is stale) between the read and
#: the resolution: the next candidate is tried.
_NEXT_CANDIDATE = frozenset(
    {"signal_consumed", "signal_mismatch", "stale_signal", "signal_expired"}
)


@dataclass(frozen=True)
class _Notice:
    """When a candidate's notification arrived and the producer's trace context."""

    at: datetime | None
    trace_context: str | None = None

    @classmethod
    def of(cls, signal: SignalRecord) -> _Notice:
        return cls(signal.received_at, signal.trace_context)


@dataclass(frozen=True)
class _Action:
    """What an evidence read decided: nothing, resolutions to try in order (signal id,
    receipt, wake version), or an expiry (with its fault-path successor). ``notified``
    (when each candidate's notification arrived) and ``family`` feed the wait metrics."""

    outcome: NoChange | None = None
    resolve: list[tuple[str | None, dict[str, Any], int | None]] | None = None
    expire: str | None = None
    fault: FaultStep | None = None
    quarantine: bool = False
    notified: dict[str | None, _Notice] = field(default_factory=dict)
    family: str = ""
    #: The candidate signals as the evidence read saw them (unlocked; see ``HeldRun``).
    seen: tuple[SignalRecord, ...] = ()

    async def run(
        self, waits: WaitStore, dep: DependencyRecord, claim: PreClaims | None = None
    ) -> WaitTransition | NoChange:
        if self.expire is not None:
            fault = self.fault

            async def lookup(_root: RunRecord, _dep: DependencyRecord) -> FaultStep | None:
                return fault

            return await waits.expire(
                dep.org_id,
                dep.dependency_id,
                cause=self.expire,
                fault_lookup=lookup,
                quarantine=self.quarantine,
            )
        result = await self._each(dep, functools.partial(waits.resolve, claim=claim))
        if isinstance(result, WaitTransition):
            self.committed(dep, result)
        return result

    async def resolve_in(
        self,
        waits: WaitStore,
        conn: AsyncConnection,
        dep: DependencyRecord,
        held: HeldRun | None = None,
        claim: PreClaims | None = None,
    ) -> WaitTransition | NoChange:
        """The resolutions of :meth:`run` inside the caller's transaction (no expiry;
        the caller calls :meth:`committed` after its commit). The candidates are one
        dependency's signals: the locks stay root → step → dependency → signal(s)
        (``held``: root and step are locked already; ``claim``: the pre-claimed wake)."""
        return await self._each(
            dep, functools.partial(waits.resolve_in, conn, held=held, claim=claim)
        )

    async def _each(
        self, dep: DependencyRecord, resolve: Callable[..., Awaitable[WaitTransition | NoChange]]
    ) -> WaitTransition | NoChange:
        """Try the candidate resolutions in order until one commits or one fails for
        another reason than its candidate (then the next would fail the same way)."""
        result: WaitTransition | NoChange = self.outcome or NoChange("nothing")
        for signal_id, receipt, version in self.resolve or ():
            result = await resolve(
                dep.org_id,
                dep.dependency_id,
                receipt=receipt,
                signal_id=signal_id,
                wake_version=version,
                expected_version=dep.state_version,
            )
            if isinstance(result, WaitTransition) or result.reason not in _NEXT_CANDIDATE:
                return result
        return result

    def committed(self, dep: DependencyRecord, result: WaitTransition) -> None:
        """After the resolution's commit (the scheduler has not claimed the step yet):
        the crash point and the wait metrics."""
        crash_point(CrashPoint.AFTER_RESOLUTION_COMMIT, dep.producer_kind)
        signal_id = None if result.signal is None else result.signal.wake_signal_id
        notice = self.notified.get(signal_id) or _Notice(None)
        wait_resolved(
            flow_run_id=dep.flow_run_id,
            dependency_id=dep.dependency_id,
            producer_kind=dep.producer_kind,
            family=self.family or "unknown",
            created_at=dep.created_at,
            notified_at=notice.at,
            signal_trace=notice.trace_context,
        )
