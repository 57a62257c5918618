"""V2 trigger admission: which activated plans a record event may start (§7.4, §22.1).

A record mutation is admitted against the *request-bound* metadata view: the exact
``RuntimeWorkBinding`` (and its view) the request was bound to when it entered. The
dispatch selection comes only from that view's trigger subscriptions — never from live
repository state or a process-global cache — and each subscribed Flow is admitted only
through an ACTIVE activation whose plan was compiled against exactly that binding and
whose ``TriggerBindingDigest`` equals the digest of the view's subscriptions of that
Flow. Anything else (a missing view, a binding or trigger-set mismatch, a subscribed
Flow without a matching activation) rejects the whole admission, before any business
transaction begins: an already activated plan can never gain writes, locks or a newly
subscribed Flow.

:func:`select_for_trigger` is the pure decision; :func:`select_plan_for_trigger` loads
the candidates (one read-only transaction) and applies it. Outcomes are values
(:class:`TriggerSelection` or :class:`AdmissionError`), not exceptions (STYLE 5).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import MetadataViewInput, RuntimeWorkBindingRef
from runtime_svc.compiler.plan import trigger_binding_digest
from runtime_svc.definitions import repository as repo
from services.db import transaction
from services.errors import FailedPreconditionError

__all__ = [
    "ActivePlanBinding",
    "AdmissionError",
    "AdmissionErrorCode",
    "AdmittedPlan",
    "ImmutableRowCache",
    "RequestBoundView",
    "TriggerSelection",
    "load_active_plan_bindings",
    "load_active_plan_bindings_txn",
    "select_for_trigger",
    "select_plan_for_trigger",
    "select_plan_for_trigger_txn",
    "subscribed_flows",
]


@dataclass(frozen=True)
class RequestBoundView:
    """The binding a request was bound to, and its view (``None``: could not be loaded)."""

    binding: RuntimeWorkBindingRef
    view: MetadataViewInput | None


@dataclass(frozen=True)
class ActivePlanBinding:
    """An ACTIVE activation with the complete binding of its plan."""

    flow_api_name: str
    flow_version_id: str
    version_number: int
    plan_id: str
    plan_digest: str
    execution_profile: str
    binding: RuntimeWorkBindingRef
    trigger_binding_digest: str


@dataclass(frozen=True)
class AdmittedPlan:
    """One plan the event starts a run of."""

    flow_api_name: str
    flow_version_id: str
    plan_id: str
    plan_digest: str
    execution_profile: str
    dispatch_order: int


@dataclass(frozen=True)
class TriggerSelection:
    """Admission succeeded: the plans to run, in dispatch order (may be empty)."""

    plans: tuple[AdmittedPlan, ...]


class AdmissionErrorCode(StrEnum):
    """Why admission was refused."""

    VIEW_MISSING = "admission.view_missing"
    VIEW_MISMATCH = "admission.view_mismatch"
    SCOPE_MISMATCH = "admission.scope_mismatch"
    NO_ACTIVE_PLAN = "admission.no_active_plan"
    BINDING_MISMATCH = "admission.binding_mismatch"
    TRIGGER_MISMATCH = "admission.trigger_mismatch"


@dataclass(frozen=True)
class AdmissionError:
    """Admission refused before any business transaction."""

    code: AdmissionErrorCode
    message: str
    flow_api_name: str | None = None

    def to_exception(self) -> FailedPreconditionError:
        """The error to raise at an RPC boundary."""
        attrs = {"flow_api_name": self.flow_api_name} if self.flow_api_name else {}
        return FailedPreconditionError(self.message, reason=self.code.value, attributes=attrs)


def _differences(a: RuntimeWorkBindingRef, b: RuntimeWorkBindingRef) -> list[str]:
    return [f.name for f in fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def select_for_trigger(
    org_id: str,
    object_api_name: str,
    timing: str,
    event: str,
    request: RequestBoundView | None,
    active: Sequence[ActivePlanBinding],
) -> TriggerSelection | AdmissionError:
    """Decide admission of one record event (see module docstring).

    Args:
        org_id: the trusted org of the request.
        object_api_name: object of the mutated record.
        timing: ``before_save`` or ``after_save``.
        event: ``create``, ``update`` or ``delete``.
        request: the request-bound binding and view.
        active: ACTIVE activations of the request's installation and capability.
    """
    if request is None or request.view is None:
        return AdmissionError(
            AdmissionErrorCode.VIEW_MISSING,
            "the request-bound metadata view is not available; admission fails closed",
        )
    binding, view = request.binding, request.view
    if view.digest != binding.metadata_view_digest:
        return AdmissionError(
            AdmissionErrorCode.VIEW_MISMATCH,
            f"the metadata view {view.digest} is not the view of the request-bound binding "
            f"({binding.metadata_view_digest})",
        )
    if binding.org_id != org_id:
        return AdmissionError(
            AdmissionErrorCode.SCOPE_MISMATCH,
            "the request-bound binding belongs to another org",
        )
    matching = [
        s
        for s in view.trigger_subscriptions
        if s.object == object_api_name and s.timing == timing and event in s.events
    ]
    by_flow: dict[str, list[int]] = {}
    for s in matching:
        by_flow.setdefault(s.flow_api_name, []).append(s.dispatch_order)
    admitted: list[AdmittedPlan] = []
    for flow in sorted(by_flow):
        candidates = [
            c
            for c in active
            if c.flow_api_name == flow
            and c.binding.app_installation_id == binding.app_installation_id
            and c.binding.runtime_capability_id == binding.runtime_capability_id
        ]
        if not candidates:
            return AdmissionError(
                AdmissionErrorCode.NO_ACTIVE_PLAN,
                f"Flow {flow} is subscribed by the request-bound view but has no active plan",
                flow,
            )
        c = candidates[0]
        diff = _differences(c.binding, binding)
        if diff:
            return AdmissionError(
                AdmissionErrorCode.BINDING_MISMATCH,
                f"the active plan of Flow {flow} was compiled against another "
                f"RuntimeWorkBinding (differs in {', '.join(diff)})",
                flow,
            )
        # A subscription names the Flow by API name (version 0, as the catalog publishes
        # it) or by exact version; it applies to the active version either way.
        own = tuple(
            replace(s, flow_version=c.version_number)
            for s in view.trigger_subscriptions
            if s.flow_api_name == flow and s.flow_version in (0, c.version_number)
        )
        expected = trigger_binding_digest(flow, c.version_number, own)
        if expected != c.trigger_binding_digest:
            return AdmissionError(
                AdmissionErrorCode.TRIGGER_MISMATCH,
                f"the trigger subscriptions of Flow {flow}@{c.version_number} in the "
                "request-bound view differ from those its active plan was compiled with",
                flow,
            )
        admitted.append(
            AdmittedPlan(
                flow_api_name=flow,
                flow_version_id=c.flow_version_id,
                plan_id=c.plan_id,
                plan_digest=c.plan_digest,
                execution_profile=c.execution_profile,
                dispatch_order=min(by_flow[flow]),
            )
        )
    admitted.sort(key=lambda p: (p.dispatch_order, p.flow_api_name))
    return TriggerSelection(tuple(admitted))


async def select_plan_for_trigger_txn(
    conn: AsyncConnection,
    org_id: str,
    object_api_name: str,
    timing: str,
    event: str,
    request_binding: RequestBoundView | None,
    *,
    cache: ImmutableRowCache | None = None,
    active_ids: Sequence[tuple[str, str, str | None]] | None = None,
) -> TriggerSelection | AdmissionError:
    """:func:`select_plan_for_trigger` inside the caller's transaction.

    ``active_ids``: the activation read (:func:`repository.active_plan_ids_txn`'s rows for
    :func:`subscribed_flows`' names) when this transaction already made it in another
    statement (``repository.active_plan_ids_column``); ``None`` reads it here (with
    ``cache``)."""
    if request_binding is None or request_binding.view is None:
        return select_for_trigger(org_id, object_api_name, timing, event, request_binding, ())
    b, view = request_binding.binding, request_binding.view
    if cache is None:
        active = await load_active_plan_bindings_txn(
            conn,
            org_id,
            b.app_installation_id,
            b.runtime_capability_id,
            _subscribed(view, object_api_name, timing, event),
        )
        return select_for_trigger(org_id, object_api_name, timing, event, request_binding, active)
    # The per-write path: one lean activation read; the decision is a pure function of
    # the request binding, the view (by content digest) and the ACTIVE (Flow, version,
    # plan) triples — all immutable rows — so it is memoized on exactly those.
    names_key = (view.digest, object_api_name, timing, event)
    names = subscribed_flows(view, object_api_name, timing, event, cache)
    if not names:
        return select_for_trigger(org_id, object_api_name, timing, event, request_binding, ())
    acts = (
        list(active_ids)
        if active_ids is not None
        else await repo.active_plan_ids_txn(
            conn, org_id, b.app_installation_id, b.runtime_capability_id, names
        )
    )
    key = (org_id, names_key, b, tuple(acts))
    decision = cache.decisions.get(key)
    if decision is None:
        active = await _bindings_of(conn, org_id, acts, cache)
        decision = select_for_trigger(
            org_id, object_api_name, timing, event, request_binding, active
        )
        cache.remember(cache.decisions, key, decision)
    return decision


def subscribed_flows(
    view: MetadataViewInput,
    object_api_name: str,
    timing: str,
    event: str,
    cache: ImmutableRowCache,
) -> tuple[str, ...]:
    """The Flow API names ``view`` subscribes to ``(object, timing, event)``, sorted —
    the names the per-write activation read asks for (memoized by the view's content
    digest)."""
    key = (view.digest, object_api_name, timing, event)
    names = cache.names.get(key)
    if names is None:
        names = _subscribed(view, object_api_name, timing, event)
        cache.remember(cache.names, key, names)
    return names


def _subscribed(
    view: MetadataViewInput, object_api_name: str, timing: str, event: str
) -> tuple[str, ...]:
    return tuple(
        sorted(
            {
                s.flow_api_name
                for s in view.trigger_subscriptions
                if s.object == object_api_name and s.timing == timing and event in s.events
            }
        )
    )


def _binding_of(plan: repo.PlanRow) -> RuntimeWorkBindingRef:
    return RuntimeWorkBindingRef(
        org_id=plan.scope.org_id,
        app_installation_id=plan.scope.app_installation_id,
        runtime_capability_id=plan.scope.runtime_capability_id,
        catalog_revision=plan.catalog_revision,
        schema_generation=plan.schema_generation,
        engine_generation=plan.engine_generation,
        catalog_snapshot_digest=plan.catalog_snapshot_digest,
        metadata_view_digest=plan.metadata_view_digest,
        binding_digest=plan.scope.runtime_work_binding_digest,
    )


async def load_active_plan_bindings(
    engine: AsyncEngine,
    org_id: str,
    app_installation_id: str,
    runtime_capability_id: str,
    flow_api_names: Sequence[str],
) -> list[ActivePlanBinding]:
    """ACTIVE activations of the named Flows with their plans' complete bindings."""
    if not flow_api_names:
        return []
    async with transaction(engine, readonly=True) as conn:
        return await load_active_plan_bindings_txn(
            conn, org_id, app_installation_id, runtime_capability_id, flow_api_names
        )


class ImmutableRowCache:
    """A bounded per-process cache of immutable definition rows (plans and Flow versions
    never change once written, so an entry can never go stale; activations are never
    cached)."""

    def __init__(self, max_entries: int = 512) -> None:
        self._max = max_entries
        self.plans: OrderedDict[tuple[str, str], repo.PlanRow] = OrderedDict()
        self.versions: OrderedDict[tuple[str, str], repo.FlowVersionRow] = OrderedDict()
        #: Memoized :func:`select_for_trigger` decisions (a pure function of its inputs,
        #: which the key holds completely: the view by its content digest).
        self.decisions: OrderedDict[Any, TriggerSelection | AdmissionError] = OrderedDict()
        #: Flows a view subscribes per (view digest, object, timing, event).
        self.names: OrderedDict[Any, tuple[str, ...]] = OrderedDict()

    def remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        """Insert ``key`` (most recent) and evict the oldest entries beyond the bound."""
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._max:
            cache.popitem(last=False)


async def load_active_plan_bindings_txn(
    conn: AsyncConnection,
    org_id: str,
    app_installation_id: str,
    runtime_capability_id: str,
    flow_api_names: Sequence[str],
    *,
    cache: ImmutableRowCache | None = None,
) -> list[ActivePlanBinding]:
    """:func:`load_active_plan_bindings` inside the caller's transaction (the before-save
    path selects its plans inside the record transaction). With ``cache``, plan and Flow
    version rows are read once per process; the activation query always runs."""
    if not flow_api_names:
        return []
    acts = await repo.active_plan_ids_txn(
        conn, org_id, app_installation_id, runtime_capability_id, flow_api_names
    )
    return await _bindings_of(conn, org_id, acts, cache)


async def _bindings_of(
    conn: AsyncConnection,
    org_id: str,
    acts: Sequence[tuple[str, str, str | None]],
    cache: ImmutableRowCache | None,
) -> list[ActivePlanBinding]:
    """The complete bindings of ACTIVE ``(Flow, version, plan)`` triples (plan and version
    rows read once per process with ``cache``)."""
    version_ids = [version_id for _, version_id, _ in acts]
    versions: dict[str, repo.FlowVersionRow] = {}
    missing = [v for v in version_ids if cache is None or (org_id, v) not in cache.versions]
    if missing:
        versions.update(await repo.get_flow_versions_txn(conn, org_id, missing))
    if cache is not None:
        for vid in version_ids:
            if vid in versions:
                cache.remember(cache.versions, (org_id, vid), versions[vid])
            elif (org_id, vid) in cache.versions:
                versions[vid] = cache.versions[(org_id, vid)]
    out = []
    for flow_api_name, flow_version_id, plan_id in acts:
        plan = None
        if plan_id is not None:
            key = (org_id, plan_id)
            plan = None if cache is None else cache.plans.get(key)
            if plan is None:
                plan = await repo.get_plan_txn(conn, org_id, plan_id)
                if plan is not None and cache is not None:
                    cache.remember(cache.plans, key, plan)
        version = versions.get(flow_version_id)
        if plan is None or version is None:
            continue
        out.append(
            ActivePlanBinding(
                flow_api_name=flow_api_name,
                flow_version_id=flow_version_id,
                version_number=version.version_number,
                plan_id=plan.plan_id,
                plan_digest=plan.plan_digest,
                execution_profile=plan.execution_profile,
                binding=_binding_of(plan),
                trigger_binding_digest=plan.trigger_binding_digest,
            )
        )
    return out


async def select_plan_for_trigger(
    engine: AsyncEngine,
    org_id: str,
    object_api_name: str,
    timing: str,
    event: str,
    request_binding: RequestBoundView | None,
) -> TriggerSelection | AdmissionError:
    """Load the candidates of the request-bound view and decide admission.

    Only Flows the request-bound view subscribes to (object, timing, event) are loaded;
    the decision is :func:`select_for_trigger`. No business transaction is opened.
    """
    async with transaction(engine, readonly=True) as conn:
        return await select_plan_for_trigger_txn(
            conn, org_id, object_api_name, timing, event, request_binding
        )
