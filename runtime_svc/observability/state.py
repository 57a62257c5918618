"""The runtime's authoritative-state gauges (spec §19), probed per org by the bounded
scan of :mod:`services.metrics_state`.

Per org, one statement of capped counts and index seeks:

* ``nexus_flow_runs{state}`` — runs per canonical state (``ix_flow_runs_state_id``;
  accepted, runnable, running, waiting, terminal, quarantined …);
* ``nexus_flow_queue_depth{lane}`` / ``nexus_flow_queue_oldest_age_seconds{lane}`` —
  due claimable steps per admission lane and the oldest one's age
  (``ix_flow_step_executions_claim``: org, state, lane, run_after — ``MIN`` is a seek);
* ``nexus_flow_dependencies_pending`` / ``nexus_flow_dependency_oldest_age_seconds`` —
  pending waits and the oldest one's age (``ix_flow_dependencies_age``);

and a keyset window of at most ``FLOW_METRICS_PROBE_WINDOW`` runs (root joined to its
current step) checked by the pure :func:`classify_run`:

* ``nexus_flow_projection_divergent_runs{kind}`` — a compatibility projection
  (``interview_status``) that is not the one §18.2 derives from the canonical state, or
  a root whose current step is in a state the root cannot have;
* ``nexus_flow_dual_ownership_runs{kind}`` — data showing two schedulers' hands on a run
  (§20.6; must stay zero): an unknown owner, a V2 run without a V2 epoch, a legacy run
  with a V2 epoch or V2 lifecycle rows, a current step of another epoch than its root.

The window walks each org's runs in id order and publishes the org's counts once it has
seen them all, so each run is checked once per rotation at a cost bounded per pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler.kinds import QueueClass
from runtime_svc.kernel.states import ExecutionOwner, RunState, StepState
from runtime_svc.kernel.tables import compatibility_status, root_step_consistent
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.schema import flow_dependencies, flow_runs, flow_step_executions
from services.metrics import StateFamily
from services.metrics_state import Sample, capped_count, distinct_orgs, due_age, oldest

__all__ = [
    "DIVERGENCE_KINDS",
    "DUAL_OWNERSHIP_KINDS",
    "RunFacts",
    "RuntimeStateSource",
    "classify_run",
]

#: Kinds of compatibility-projection divergence (:func:`classify_run`).
DIVERGENCE_KINDS = ("compatibility_status", "root_step_state")
#: Kinds of dual ownership the row-local check finds (names shared with the migration
#: reconciliation report, ``flowctl deploy reconcile``).
DUAL_OWNERSHIP_KINDS = (
    "unknown_owner",
    "v2_epoch_zero",
    "legacy_epoch_nonzero",
    "legacy_with_v2_lifecycle",
    "step_epoch_mismatch",
)
_LANES = tuple(q.value for q in QueueClass)
_CLAIMABLE = (StepState.PENDING.code, StepState.RETRY_SCHEDULED.code)
_PENDING_DEP = DependencyState.PENDING.code
_LEGACY = ExecutionOwner.LEGACY_INTERPRETER.code
_V2 = ExecutionOwner.FLOW_RUNTIME_V2.code


@dataclass(frozen=True)
class RunFacts:
    """What the window reads of one run: root columns and its current step's."""

    runtime_state: str
    interview_status: str | None
    execution_owner: str
    ownership_epoch: int
    step_state: str | None
    step_epoch: int | None
    has_current_step: bool


def classify_run(facts: RunFacts) -> tuple[list[str], list[str]]:
    """The divergence kinds and dual-ownership kinds one run shows (pure).

    Returns:
        ``(divergence kinds, dual-ownership kinds)``, each empty for a healthy run.
    """
    dual: list[str] = []
    if facts.execution_owner not in (_LEGACY, _V2):
        dual.append("unknown_owner")
    elif facts.execution_owner == _V2 and facts.ownership_epoch < 1:
        dual.append("v2_epoch_zero")
    elif facts.execution_owner == _LEGACY:
        if facts.ownership_epoch != 0:
            dual.append("legacy_epoch_nonzero")
        if facts.has_current_step:
            dual.append("legacy_with_v2_lifecycle")
    if facts.step_epoch is not None and facts.step_epoch != facts.ownership_epoch:
        dual.append("step_epoch_mismatch")
    divergent: list[str] = []
    if facts.execution_owner == _V2:
        try:
            state = RunState.from_code(facts.runtime_state)
        except ValueError:
            return ["compatibility_status"], dual
        if facts.interview_status != compatibility_status(state).code:
            divergent.append("compatibility_status")
        step = _step_state(facts.step_state)
        if facts.step_state is not None and (step is None or not root_step_consistent(state, step)):
            divergent.append("root_step_state")
    return divergent, dual


def _step_state(code: str | None) -> StepState | None:
    if code is None:
        return None
    try:
        return StepState.from_code(code)
    except ValueError:
        return None


@dataclass
class _Window:
    """One org's keyset position and the counts of the rotation in progress."""

    cursor: str = ""
    divergent: dict[str, int] = field(default_factory=dict)
    dual: dict[str, int] = field(default_factory=dict)
    published: tuple[dict[str, int], dict[str, int]] | None = None


class RuntimeStateSource:
    """The runtime's :class:`~services.metrics_state.StateSource` (module docstring).

    Args:
        count_cap: cap of each count.
        window: runs per org one pass classifies.
    """

    def __init__(self, *, count_cap: int = 10000, window: int = 500) -> None:
        self._cap = count_cap
        self._window = window
        self._windows: dict[str, _Window] = {}

    @property
    def families(self) -> Sequence[StateFamily]:
        return (
            StateFamily(
                "nexus_flow_runs",
                "Flow runs by canonical state (capped per org and state).",
                ("state",),
            ),
            StateFamily(
                "nexus_flow_queue_depth",
                "Due claimable steps by admission lane (capped per org and state).",
                ("lane",),
            ),
            StateFamily(
                "nexus_flow_queue_oldest_age_seconds",
                "Age of the oldest due claimable step by admission lane (0: none due).",
                ("lane",),
            ),
            StateFamily(
                "nexus_flow_dependencies_pending",
                "Pending durable waits (capped per org).",
            ),
            StateFamily(
                "nexus_flow_dependency_oldest_age_seconds",
                "Age of the oldest pending durable wait (0: none).",
            ),
            StateFamily(
                "nexus_flow_projection_divergent_runs",
                "Runs whose compatibility projection or root/step states diverge from the "
                "canonical state, as of each org's last complete check (must be 0).",
                ("kind",),
            ),
            StateFamily(
                "nexus_flow_dual_ownership_runs",
                "Runs whose data shows two schedulers' ownership, as of each org's last "
                "complete check (must be 0).",
                ("kind",),
            ),
        )

    def baseline(self) -> Sequence[Sample]:
        return [
            *(Sample("nexus_flow_runs", (s.code,), 0) for s in RunState),
            *(Sample("nexus_flow_queue_depth", (lane,), 0) for lane in _LANES),
            *(Sample("nexus_flow_queue_oldest_age_seconds", (lane,), 0, "max") for lane in _LANES),
            Sample("nexus_flow_dependencies_pending", (), 0),
            Sample("nexus_flow_dependency_oldest_age_seconds", (), 0, "max"),
            *(Sample("nexus_flow_projection_divergent_runs", (k,), 0) for k in DIVERGENCE_KINDS),
            *(Sample("nexus_flow_dual_ownership_runs", (k,), 0) for k in DUAL_OWNERSHIP_KINDS),
        ]

    async def orgs(self, conn: AsyncConnection, after: str, limit: int) -> list[str]:
        return await distinct_orgs(conn, flow_runs, after, limit)

    async def probe(self, conn: AsyncConnection, org_id: str, now: datetime) -> list[Sample]:
        samples = await self._counts(conn, org_id, now)
        samples += await self._check_window(conn, org_id)
        return samples

    async def _counts(self, conn: AsyncConnection, org_id: str, now: datetime) -> list[Sample]:
        r, s, d = flow_runs.c, flow_step_executions.c, flow_dependencies.c
        cap = self._cap
        columns: list[Any] = [
            capped_count(flow_runs, r.org_id == org_id, r.runtime_state == st.code, cap=cap)
            for st in RunState
        ]
        pairs = [(lane, state) for lane in _LANES for state in _CLAIMABLE]
        for lane, state in pairs:
            where = (s.org_id == org_id, s.state == state, s.queue_class == lane)
            columns.append(capped_count(flow_step_executions, *where, s.run_after <= now, cap=cap))
            columns.append(oldest(s.run_after, *where))
        columns.append(
            capped_count(flow_dependencies, d.org_id == org_id, d.state == _PENDING_DEP, cap=cap)
        )
        columns.append(oldest(d.created_at, d.org_id == org_id, d.state == _PENDING_DEP))
        row = list((await conn.execute(select(*columns))).one())
        out = [Sample("nexus_flow_runs", (st.code,), float(row.pop(0) or 0)) for st in RunState]
        depth: dict[str, float] = dict.fromkeys(_LANES, 0.0)
        age: dict[str, float] = dict.fromkeys(_LANES, 0.0)
        for lane, _state in pairs:
            depth[lane] += float(row.pop(0) or 0)
            age[lane] = max(age[lane], due_age(row.pop(0), now))
        out += [Sample("nexus_flow_queue_depth", (lane,), depth[lane]) for lane in _LANES]
        out += [
            Sample("nexus_flow_queue_oldest_age_seconds", (lane,), age[lane], "max")
            for lane in _LANES
        ]
        out.append(Sample("nexus_flow_dependencies_pending", (), float(row.pop(0) or 0)))
        out.append(
            Sample("nexus_flow_dependency_oldest_age_seconds", (), due_age(row.pop(0), now), "max")
        )
        return out

    async def _check_window(self, conn: AsyncConnection, org_id: str) -> list[Sample]:
        r, s = flow_runs.c, flow_step_executions.c
        state = self._windows.setdefault(org_id, _Window())
        stmt = (
            select(
                r.flow_run_id,
                r.runtime_state,
                r.interview_status,
                r.execution_owner,
                r.ownership_epoch,
                r.current_step_execution_id,
                s.state,
                s.ownership_epoch.label("step_epoch"),
            )
            .select_from(
                flow_runs.outerjoin(
                    flow_step_executions,
                    and_(
                        s.org_id == r.org_id,
                        s.step_execution_id == r.current_step_execution_id,
                    ),
                )
            )
            .where(r.org_id == org_id, r.flow_run_id > state.cursor)
            .order_by(r.flow_run_id)
            .limit(self._window)
        )
        rows = (await conn.execute(stmt)).all()
        for row in rows:
            divergent, dual = classify_run(
                RunFacts(
                    runtime_state=str(row[1]),
                    interview_status=row[2],
                    execution_owner=str(row[3]),
                    ownership_epoch=int(row[4]),
                    step_state=row[6],
                    step_epoch=None if row[7] is None else int(row[7]),
                    has_current_step=row[5] is not None,
                )
            )
            for kind in divergent:
                state.divergent[kind] = state.divergent.get(kind, 0) + 1
            for kind in dual:
                state.dual[kind] = state.dual.get(kind, 0) + 1
        if len(rows) < self._window:
            # The org's runs are all checked: publish this rotation's counts, start over.
            state.published = (state.divergent, state.dual)
            state.cursor, state.divergent, state.dual = "", {}, {}
        else:
            state.cursor = str(rows[-1][0])
        if state.published is None:
            return []
        divergent_counts, dual_counts = state.published
        return [
            *(
                Sample("nexus_flow_projection_divergent_runs", (k,), float(n))
                for k, n in divergent_counts.items()
            ),
            *(
                Sample("nexus_flow_dual_ownership_runs", (k,), float(n))
                for k, n in dual_counts.items()
            ),
        ]
