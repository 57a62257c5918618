"""V2 trigger admission as a pure decision (§7.4, §22.1 V22.1-07/08): only a plan whose
complete binding and TriggerBindingDigest equal the request-bound view is admitted; a
missing view or any mismatch refuses admission before a business transaction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime_svc.compiler import ExecutionPlan, MetadataViewInput, PlanCompileError
from runtime_svc.definitions import (
    ActivePlanBinding,
    AdmissionError,
    AdmissionErrorCode,
    RequestBoundView,
    TriggerSelection,
    select_for_trigger,
)
from services.errors import FailedPreconditionError
from tests.unit.definitions import corpus

ORG = "org-acme"


def _candidate(p: ExecutionPlan, **changes: object) -> ActivePlanBinding:
    c = ActivePlanBinding(
        flow_api_name=p.flow.api_name,
        flow_version_id=f"fv-{p.flow.api_name}",
        version_number=p.flow.version,
        plan_id=f"plan-{p.flow.api_name}",
        plan_digest=p.plan_digest,
        execution_profile=p.profile.value,
        binding=p.binding,
        trigger_binding_digest=p.trigger_binding_digest,
    )
    return replace(c, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def view() -> MetadataViewInput:
    return corpus.inputs().metadata_view


@pytest.fixture(scope="module")
def request_view(view: MetadataViewInput) -> RequestBoundView:
    return RequestBoundView(corpus.inputs().binding, view)


@pytest.fixture(scope="module")
def opportunity_update_plans(view: MetadataViewInput) -> list[ExecutionPlan]:
    """Plans of the corpus Flows subscribed to Opportunity after-save update that compile."""
    names = sorted(
        {
            s.flow_api_name
            for s in view.trigger_subscriptions
            if s.object == "Opportunity" and s.timing == "after_save" and "update" in s.events
        }
    )
    plans = []
    for n in names:
        try:
            plans.append(corpus.plan(n))
        except PlanCompileError:
            continue
    assert len(plans) >= 3
    return plans


def _only(view: MetadataViewInput, flows: set[str]) -> MetadataViewInput:
    # The same view (same digest) publishing only the subscriptions of ``flows``.
    subs = tuple(s for s in view.trigger_subscriptions if s.flow_api_name in flows)
    return replace(view, trigger_subscriptions=subs)


def test_selects_every_subscribed_plan_in_dispatch_order(
    request_view: RequestBoundView, view: MetadataViewInput, opportunity_update_plans: list
) -> None:
    active = [_candidate(p) for p in opportunity_update_plans]
    view = _only(view, {p.flow.api_name for p in opportunity_update_plans})
    bound = RequestBoundView(request_view.binding, view)
    got = select_for_trigger(ORG, "Opportunity", "after_save", "update", bound, active)
    assert isinstance(got, TriggerSelection)
    order = {s.flow_api_name: s.dispatch_order for s in view.trigger_subscriptions}
    names = [p.flow_api_name for p in got.plans]
    assert sorted(names) == sorted(p.flow.api_name for p in opportunity_update_plans)
    assert names == sorted(names, key=lambda n: (order[n], n))
    assert {p.plan_digest for p in got.plans} == {p.plan_digest for p in opportunity_update_plans}


def test_an_unsubscribed_event_admits_nothing(request_view: RequestBoundView) -> None:
    assert select_for_trigger(ORG, "Payment", "after_save", "delete", request_view, ()) == (
        TriggerSelection(())
    )


def test_a_missing_or_foreign_view_fails_closed(request_view: RequestBoundView) -> None:
    p = corpus.plan("durable_send_email")
    active = [_candidate(p)]
    for req in (None, RequestBoundView(request_view.binding, None)):
        got = select_for_trigger(ORG, "Contact", "after_save", "create", req, active)
        assert isinstance(got, AdmissionError) and got.code is AdmissionErrorCode.VIEW_MISSING
    other_view = replace(request_view.view, digest="metadata-view/v1:sha256:" + "9" * 64)  # type: ignore[type-var]
    got = select_for_trigger(
        ORG,
        "Contact",
        "after_save",
        "create",
        RequestBoundView(request_view.binding, other_view),
        active,
    )
    assert isinstance(got, AdmissionError) and got.code is AdmissionErrorCode.VIEW_MISMATCH
    got = select_for_trigger("org-other", "Contact", "after_save", "create", request_view, active)
    assert isinstance(got, AdmissionError) and got.code is AdmissionErrorCode.SCOPE_MISMATCH
    assert isinstance(got.to_exception(), FailedPreconditionError)
    assert got.to_exception().reason == "admission.scope_mismatch"


def test_a_subscribed_flow_without_an_active_plan_refuses_admission(
    request_view: RequestBoundView,
) -> None:
    got = select_for_trigger(ORG, "Contact", "after_save", "create", request_view, ())
    assert isinstance(got, AdmissionError)
    assert got.code is AdmissionErrorCode.NO_ACTIVE_PLAN
    assert got.flow_api_name == "durable_send_email"
    # An active plan of another installation does not count.
    p = corpus.plan("durable_send_email")
    elsewhere = replace(p.binding, app_installation_id="inst-other")
    got = select_for_trigger(
        ORG, "Contact", "after_save", "create", request_view, [_candidate(p, binding=elsewhere)]
    )
    assert isinstance(got, AdmissionError) and got.code is AdmissionErrorCode.NO_ACTIVE_PLAN


@pytest.mark.parametrize(
    "field",
    [
        "catalog_revision",
        "schema_generation",
        "engine_generation",
        "catalog_snapshot_digest",
        "metadata_view_digest",
        "binding_digest",
    ],
)
def test_any_difference_in_the_complete_binding_refuses_admission(
    request_view: RequestBoundView, field: str
) -> None:
    p = corpus.plan("durable_send_email")
    value = getattr(p.binding, field)
    changed = replace(p.binding, **{field: value + 1 if isinstance(value, int) else value + "x"})
    got = select_for_trigger(
        ORG, "Contact", "after_save", "create", request_view, [_candidate(p, binding=changed)]
    )
    assert isinstance(got, AdmissionError)
    assert got.code is AdmissionErrorCode.BINDING_MISMATCH
    assert field in got.message


def test_a_changed_trigger_set_refuses_admission(request_view: RequestBoundView) -> None:
    p = corpus.plan("durable_send_email")
    view = request_view.view
    assert view is not None
    # Same binding, but the view now also subscribes the Flow to updates.
    subs = tuple(
        replace(s, events=(*s.events, "update")) if s.flow_api_name == "durable_send_email" else s
        for s in view.trigger_subscriptions
    )
    changed = RequestBoundView(request_view.binding, replace(view, trigger_subscriptions=subs))
    got = select_for_trigger(ORG, "Contact", "after_save", "create", changed, [_candidate(p)])
    assert isinstance(got, AdmissionError)
    assert got.code is AdmissionErrorCode.TRIGGER_MISMATCH
    # A view that names another version of the Flow does not select this plan either.
    other = tuple(
        replace(s, flow_version=7) if s.flow_api_name == "durable_send_email" else s
        for s in view.trigger_subscriptions
    )
    moved = RequestBoundView(request_view.binding, replace(view, trigger_subscriptions=other))
    got = select_for_trigger(ORG, "Contact", "after_save", "create", moved, [_candidate(p)])
    assert isinstance(got, AdmissionError) and got.code is AdmissionErrorCode.TRIGGER_MISMATCH


def test_version_less_subscriptions_apply_to_the_active_version(
    request_view: RequestBoundView,
) -> None:
    p = corpus.plan("durable_send_email")
    view = request_view.view
    assert view is not None
    subs = tuple(replace(s, flow_version=0) for s in view.trigger_subscriptions)
    unpinned = RequestBoundView(request_view.binding, replace(view, trigger_subscriptions=subs))
    got = select_for_trigger(ORG, "Contact", "after_save", "create", unpinned, [_candidate(p)])
    assert isinstance(got, TriggerSelection)
    assert [x.plan_digest for x in got.plans] == [p.plan_digest]
