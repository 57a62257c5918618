"""The per-process admission controller the durable worker asks before it claims (§16).

Admission happens before a business connection is acquired. The worker's pass over one
org is::

    for lane, limit in await controller.lanes(org_id, served_lanes, batch):   # no query yet
        for candidate in await store.eligible_work(org_id, lane, limit=limit):
            ticket = await controller.admit(org_id, candidate, plan)            # or None
            if ticket is None: continue                                        # deferred
            with admitted(ticket):
                outcome = await worker.process(org_id, candidate)              # claim, txn
            controller.release(ticket, outcome)

* :meth:`AdmissionController.lanes` — the org's visit in the deficit scheduler (its
  credit, :mod:`.scheduler`), the current pressure (:mod:`.pressure`), the org's
  budgets (its newest runtime-policy generation, :mod:`.budgets`), combined into how
  many candidates each lane may fetch. A lane with no allowance is not queried at all:
  overload means fewer claim queries, never more.
* :meth:`AdmissionController.admit` — per candidate, in memory: the environment budget,
  every ``max_inflight`` of the org's policy the candidate falls in (org, lane, profile,
  Flow, Flow version, object class) and the org's credit; then, only for a Flow with
  ``max_concurrent_runs``, the durable slot (:mod:`.slots`) in a short transaction of
  its own. Nothing is written for a deferred candidate: it stays due and is offered
  again on a later pass.
* :meth:`AdmissionController.release` — the attempt's outcome feeds the window the
  lock-wait, deadlock, retry and lease-expiry rates come from.

The environment budget is this process's share of the database: its pool size
(``FLOW_DB_POOL_SIZE``), so admission never hands out more concurrent attempts than
there are connections; pool saturation is read from the engine's pool itself.
``extra_signals`` lets an operator probe (or a test) inject further pressure (e.g. TiDB
request units); each injected signal can only raise pressure.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.budgets import AdmissionPolicy, AdmissionSubject
from runtime_svc.admission.events import Ticket
from runtime_svc.admission.pressure import (
    COLD_LANES,
    MUTATION_LANES,
    OutcomeKind,
    OutcomeWindow,
    PressureSignals,
    mutation_inflight_limit,
    pass_limits,
    pressure_level,
)
from runtime_svc.admission.scheduler import DeficitScheduler
from runtime_svc.admission.slots import (
    RunSlots,
    flow_slot_key,
    record_slot_key,
    subject_object,
)
from runtime_svc.definitions import repository as repo
from services.db import transaction
from services.metrics import metrics

if TYPE_CHECKING:
    from runtime_svc.compiler import ExecutionPlan
    from runtime_svc.kernel import Candidate

__all__ = ["AdmissionController", "Decision", "PolicySource", "SignalSource", "for_process"]

log = logging.getLogger(__name__)

#: Extra pressure signals (operator probes, tests): merged by maximum.
SignalSource = Callable[[], PressureSignals]
#: An org's admission policy.
PolicySource = Callable[[str], Awaitable[AdmissionPolicy]]

_MAX_PLANS = 512
_MAX_HELD = 10_000
_ENV = "env"
#: Worker outcome (``Outcome.value``) -> outcome class of the window.
_OUTCOMES = {
    "committed": OutcomeKind.OK,
    "already_committed": OutcomeKind.OK,
    "retry_scheduled": OutcomeKind.RETRY,
    "fence_lost": OutcomeKind.LEASE_EXPIRED,
    "failed": OutcomeKind.FAILED,
    "quarantined": OutcomeKind.FAILED,
}
_REASONS = {"deadlock": OutcomeKind.DEADLOCK, "lock_wait_timeout": OutcomeKind.LOCK_WAIT}


class Decision:
    """Safe codes of a deferral (metric label ``decision``)."""

    ADMITTED = "admitted"
    ENVIRONMENT = "environment_budget"
    POLICY = "policy_budget"
    CREDIT = "org_credit"
    PRESSURE = "pressure"
    CONCURRENCY = "concurrency_limit"
    #: Not a deferral: an admitted run's next step taken by step continuation.
    CONTINUED = "continued"


@dataclass(frozen=True)
class _PlanFacts:
    flow_api_name: str
    flow_version: int
    profile: str
    object_classes: tuple[str, ...]


class AdmissionController:
    """See the module docstring.

    Args:
        engine: the runtime database (policy reads, slots, pool saturation).
        budget: the environment budget: attempts in flight at once in this process.
        quantum: admissions an org of weight 1 earns per visit (:class:`DeficitScheduler`).
        window: attempt outcomes the §16.2 rates are computed over.
        policy_ttl_s: how long an org's admission policy is cached.
        extra_signals: injected pressure (see the module docstring).
        policies: where an org's admission policy comes from (default: the admission
            section of its newest runtime-policy generation, read-only).
        clock: monotonic clock (tests).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        budget: int,
        quantum: int = 4,
        window: int = 200,
        policy_ttl_s: float = 5.0,
        extra_signals: SignalSource | None = None,
        policies: PolicySource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget < 1:
            raise ValueError("budget must be >= 1")
        self._engine = engine
        self.budget = budget
        self.scheduler = DeficitScheduler(quantum)
        self._slots = RunSlots(engine)
        self._window = OutcomeWindow(window, clock=clock)
        self._ttl = policy_ttl_s
        self._extra = extra_signals
        self._source = policies
        self._clock = clock
        self._inflight: Counter[str] = Counter()
        self._policies: dict[str, tuple[float, AdmissionPolicy]] = {}
        self._plans: OrderedDict[tuple[str, str], _PlanFacts] = OrderedDict()
        #: (org, run, slot key) this process saw the run hold (bounded, oldest dropped).
        self._held: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._queue_age = 0.0
        #: Orgs whose current visit deferred something (see :meth:`finished_org`).
        self._left_behind: set[str] = set()
        self.decisions: Counter[str] = Counter()

    # --- signals -------------------------------------------------------------------------

    def signals(self) -> PressureSignals:
        """The current §16.2 sample (pool from the engine, rates from the window)."""
        pool = self._engine.pool
        checked_out = getattr(pool, "checkedout", None)
        size = getattr(pool, "size", None)
        w = self._window
        own = PressureSignals(
            active_mutations=sum(self._inflight[f"lane:{m}"] for m in MUTATION_LANES),
            pool_in_use=int(checked_out()) if callable(checked_out) else 0,
            pool_size=int(size()) if callable(size) else 0,
            lock_wait_rate=w.rate(OutcomeKind.LOCK_WAIT),
            deadlock_rate=w.rate(OutcomeKind.DEADLOCK),
            retry_rate=w.rate(OutcomeKind.RETRY, OutcomeKind.LOCK_WAIT, OutcomeKind.DEADLOCK),
            queue_age_seconds=self._queue_age,
            lease_expiry_rate=w.rate(OutcomeKind.LEASE_EXPIRED),
        )
        if self._extra is None:
            return own
        extra = self._extra()
        return PressureSignals(
            active_mutations=max(own.active_mutations, extra.active_mutations),
            pool_in_use=max(own.pool_in_use, extra.pool_in_use),
            pool_size=own.pool_size or extra.pool_size,
            lock_wait_rate=max(own.lock_wait_rate, extra.lock_wait_rate),
            deadlock_rate=max(own.deadlock_rate, extra.deadlock_rate),
            retry_rate=max(own.retry_rate, extra.retry_rate),
            queue_age_seconds=max(own.queue_age_seconds, extra.queue_age_seconds),
            lease_expiry_rate=max(own.lease_expiry_rate, extra.lease_expiry_rate),
        )

    def pressure(self, policy: AdmissionPolicy) -> float:
        """The pass's pressure level (the per-signal levels go to the gauge)."""
        sample = self.signals()
        metrics().admission_sampled(sample.levels(policy.pressure))
        return pressure_level(sample, policy.pressure)

    def inflight(self, key: str = _ENV) -> int:
        """Admissions in flight under ``key`` (``env``, ``lane:<lane>``, ``<org>/<scope>``)."""
        return self._inflight[key]

    # --- the org's pass ------------------------------------------------------------------

    async def policy(self, org_id: str) -> AdmissionPolicy:
        """The admission section of the org's newest policy generation (cached)."""
        now = self._clock()
        cached = self._policies.get(org_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        if self._source is not None:
            policy = await self._source(org_id)
        else:
            async with transaction(self._engine, readonly=True) as conn:
                generation = await repo.latest_policy_txn(conn, org_id)
            policy = (
                generation.runtime_policy().admission_policy
                if generation is not None
                else AdmissionPolicy()
            )
        if len(self._policies) > _MAX_HELD:
            self._policies.clear()
        self._policies[org_id] = (now + self._ttl, policy)
        return policy

    async def lanes(self, org_id: str, served: Sequence[str], batch: int) -> list[tuple[str, int]]:
        """How many candidates each lane of ``org_id`` may fetch this pass (cold lanes
        first; lanes with no allowance left out, so they are not queried)."""
        policy = await self.policy(org_id)
        self._left_behind.discard(org_id)
        credit = self.scheduler.visit(org_id, policy.org.weight)
        level = self.pressure(policy)
        limits = pass_limits(
            served,
            capacity=min(batch, credit),
            pressure=level,
            reserved_share=policy.reserved_share,
            lane_caps={
                lane: b.max_inflight
                for lane, b in policy.lanes.items()
                if b.max_inflight is not None
            },
        )
        order = sorted(
            served,
            key=lambda lane: (lane not in COLD_LANES, -policy.lane_weight(lane)),
        )
        out: list[tuple[str, int]] = []
        for lane in order:
            limit = limits.get(lane, 0)
            if limit > 0:
                out.append((lane, limit))
            else:
                decision = Decision.PRESSURE if level > 0 else Decision.ENVIRONMENT
                self._defer(lane, decision, org_id)
        return out

    def order(self, orgs: Sequence[str]) -> list[str]:
        """A pass's orgs in serving order: sparse orgs (their last visit left no work
        behind) ahead of backlogged ones (:meth:`DeficitScheduler.order`)."""
        return self.scheduler.order(orgs)

    def finished_org(self, org_id: str, found: int, *, more: bool = False) -> None:
        """The org's pass fetched ``found`` candidates (0: its bank is dropped);
        ``more``: a lane had more due candidates than it fetched. An org that left work
        behind — ``more``, a deferral, a lane given no allowance — is backlogged until a
        visit drains it; otherwise it is sparse and served first in the next pass."""
        left = org_id in self._left_behind
        self._left_behind.discard(org_id)
        if found == 0 and not left:
            self.scheduler.idle(org_id)
        else:
            self.scheduler.finished(org_id, backlogged=more or left)

    # --- one candidate -------------------------------------------------------------------

    async def admit(
        self, org_id: str, candidate: Candidate, plan: ExecutionPlan | None = None
    ) -> Ticket | None:
        """A ticket when ``candidate`` may be claimed now, else ``None`` (deferred)."""
        lane = candidate.queue_class
        self._observe_age(candidate.run_after)
        policy = await self.policy(org_id)
        if self._inflight[_ENV] >= self.budget:
            return self._defer(lane, Decision.ENVIRONMENT, org_id)
        if lane in MUTATION_LANES and not self._mutation_room(policy):
            return self._defer(lane, Decision.PRESSURE, org_id)
        if self.scheduler.credit(org_id) <= 0:
            return self._defer(lane, Decision.CREDIT, org_id)
        facts = self._facts(org_id, candidate, plan)
        keys = self._scope_keys(org_id, lane, candidate, facts, policy)
        if keys is None:
            return self._defer(lane, Decision.POLICY, org_id)
        limit = policy.concurrent_runs_limit(facts.flow_api_name) if facts.flow_api_name else None
        if limit is not None and not await self._slot(
            org_id, flow_slot_key(facts.flow_api_name), candidate, limit
        ):
            return self._defer(lane, Decision.CONCURRENCY, org_id)
        if policy.records and not await self._record_slot(org_id, policy, candidate):
            return self._defer(lane, Decision.CONCURRENCY, org_id)
        return self._grant(org_id, lane, candidate, keys)

    def admit_now(
        self, org_id: str, candidate: Candidate, plan: ExecutionPlan | None = None
    ) -> Ticket | None:
        """:meth:`admit` decided in memory only, for a claim made inside another
        transaction (the pre-claimed wake, ``docs/adr/0007-pre-claimed-wake.md``): the
        same rules on the org's cached policy, and ``None`` — nothing counted, no
        deferral recorded (the candidate takes the ordinary path, whose :meth:`admit`
        decides it) — wherever :meth:`admit` would defer *or* would need I/O: no fresh
        cached policy, a flow concurrency limit or record limits to acquire a slot for."""
        cached = self._policies.get(org_id)
        if cached is None or cached[0] <= self._clock():
            return None
        policy, lane = cached[1], candidate.queue_class
        if self._inflight[_ENV] >= self.budget or policy.records:
            return None
        if lane in MUTATION_LANES and not self._mutation_room(policy):
            return None
        if self.scheduler.credit(org_id) <= 0:
            return None
        facts = self._facts(org_id, candidate, plan)
        if facts.flow_api_name and policy.concurrent_runs_limit(facts.flow_api_name) is not None:
            return None
        keys = self._scope_keys(org_id, lane, candidate, facts, policy)
        if keys is None:
            return None
        return self._grant(org_id, lane, candidate, keys)

    def _scope_keys(
        self,
        org_id: str,
        lane: str,
        candidate: Candidate,
        facts: _PlanFacts,
        policy: AdmissionPolicy,
    ) -> list[str] | None:
        """The in-flight keys of the policy scopes ``candidate`` falls under, or ``None``
        when one of those scopes is at its ``max_inflight``."""
        subject = AdmissionSubject(
            org_id,
            lane,
            facts.profile or candidate.execution_profile,
            facts.flow_api_name,
            facts.flow_version,
            facts.object_classes,
        )
        scopes = policy.scopes(subject)
        keys = [f"{org_id}/{key}" for key, _ in scopes]
        for (_, budget), key in zip(scopes, keys, strict=True):
            if budget.max_inflight is not None and self._inflight[key] >= budget.max_inflight:
                return None
        return keys

    def _grant(self, org_id: str, lane: str, candidate: Candidate, keys: list[str]) -> Ticket:
        """Count an admission: the environment, lane and scope slots, the org's charge."""
        counted = (_ENV, f"lane:{lane}", *keys)
        for key in counted:
            self._inflight[key] += 1
        self.scheduler.charge(org_id)
        self.decisions[Decision.ADMITTED] += 1
        metrics().admission_decided(lane, Decision.ADMITTED)
        return Ticket(org_id, lane, counted, candidate.flow_run_id)

    def may_continue(self, ticket: Ticket, lane: str) -> bool:
        """May the admitted chain of ``ticket`` go on into its run's next step of ``lane``
        (step continuation, ADR 0002)? Synchronous and in memory: it is asked inside the
        committing transaction.

        A continued step is charged to the org like an admission (its deficit credit, so a
        hot tenant's long runs cannot crowd out a cold tenant), and a mutation step needs
        mutation room under the current pressure — the ticket's own in-flight slot is
        handed on to it, so it is not counted twice. The ticket keeps the lane and scope
        slots it was admitted under until the chain ends.
        """
        if self.scheduler.credit(ticket.org_id) <= 0:
            return False
        if lane in MUTATION_LANES:
            cached = self._policies.get(ticket.org_id)
            policy = cached[1] if cached is not None else AdmissionPolicy()
            handed_on = 1 if ticket.lane in MUTATION_LANES else 0
            if not self._mutation_room(policy, handed_on=handed_on):
                return False
        self.scheduler.charge(ticket.org_id)
        self.decisions[Decision.CONTINUED] += 1
        metrics().admission_decided(lane, Decision.CONTINUED)
        return True

    def observe(self, outcome: str) -> None:
        """Count an outcome of an admitted chain's earlier step (its ticket is still held)."""
        kind = _OUTCOMES.get(outcome)
        if kind is not None:
            self._window.add(kind)

    def release(self, ticket: Ticket, outcome: str) -> None:
        """The admitted attempt ended with ``outcome`` (a worker ``Outcome`` value)."""
        if ticket.released:
            return
        ticket.released = True
        for key in ticket.counted:
            self._inflight[key] -= 1
            if self._inflight[key] <= 0:
                del self._inflight[key]
        kind = _OUTCOMES.get(outcome)
        if kind == OutcomeKind.RETRY and ticket.retry_reasons:
            kind = _REASONS.get(ticket.retry_reasons[-1], OutcomeKind.RETRY)
        if kind is not None:
            self._window.add(kind)

    # --- internals -----------------------------------------------------------------------

    def _mutation_room(self, policy: AdmissionPolicy, *, handed_on: int = 0) -> bool:
        """Room for one more mutation attempt under the current pressure (``handed_on``:
        in-flight mutation slots that the new attempt takes over, not counted twice)."""
        limit = mutation_inflight_limit(
            self.budget, pressure_level(self.signals(), policy.pressure), policy.reserved_share
        )
        return sum(self._inflight[f"lane:{m}"] for m in MUTATION_LANES) - handed_on < limit

    def _defer(self, lane: str, decision: str, org_id: str | None = None) -> Ticket | None:
        """Count a deferral (of a candidate of ``org_id``, which it leaves behind);
        always ``None`` (no ticket), so callers can return it."""
        if org_id is not None and len(self._left_behind) < _MAX_HELD:
            self._left_behind.add(org_id)
        self.decisions[decision] += 1
        metrics().admission_decided(lane, decision)
        return None

    def _observe_age(self, run_after: datetime | None) -> None:
        """Track the oldest due age seen (decays: each sample replaces half of it)."""
        if run_after is None:
            return
        due = run_after if run_after.tzinfo else run_after.replace(tzinfo=UTC)
        age = max(0.0, (datetime.now(UTC) - due).total_seconds())
        self._queue_age = max(age, self._queue_age / 2)

    def _facts(self, org_id: str, candidate: Candidate, plan: ExecutionPlan | None) -> _PlanFacts:
        key = (org_id, candidate.plan_id)
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        if plan is None:
            return _PlanFacts("", 0, candidate.execution_profile, ())
        objects = sorted({r.object for s in plan.steps for r in s.resources if r.object})
        facts = _PlanFacts(
            plan.flow.api_name, plan.flow.version, plan.profile.value, tuple(objects)
        )
        self._plans[key] = facts
        while len(self._plans) > _MAX_PLANS:
            self._plans.popitem(last=False)
        return facts

    async def _record_slot(
        self, org_id: str, policy: AdmissionPolicy, candidate: Candidate
    ) -> bool:
        """The per-record limit: only read the run's subject when the org's policy has
        record limits at all (one indexed point read; none for other orgs)."""
        subject = await self._slots.subject_of(org_id, candidate.flow_run_id)
        if subject is None:
            return True
        limit = policy.record_runs_limit(subject_object(subject))
        if limit is None:
            return True
        return await self._slot(org_id, record_slot_key(subject), candidate, limit)

    async def _slot(self, org_id: str, slot_key: str, candidate: Candidate, limit: int) -> bool:
        held = (org_id, candidate.flow_run_id, slot_key)
        if held in self._held:
            return True
        ok = await self._slots.acquire(org_id, slot_key, candidate.flow_run_id, limit)
        if ok:
            self._held[held] = None
            while len(self._held) > _MAX_HELD:
                self._held.popitem(last=False)
        return ok


def for_process(engine: AsyncEngine, *, workers: int, quantum: int) -> AdmissionController:
    """The controller the workers of one runtime process share: its environment budget
    is the engine's connection pool (``FLOW_DB_POOL_SIZE``), at least one per worker."""
    size = getattr(engine.pool, "size", None)
    pool = int(size()) if callable(size) else 0
    return AdmissionController(engine, budget=max(pool, workers, 1), quantum=quantum)
