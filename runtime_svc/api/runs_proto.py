"""Proto mapping of :mod:`runtime_svc.runs` values (``runtime_v1.FlowRun``,
``RunSupportView`` and its parts) and of ``StartRun``/``ListRuns`` request fields.

The kernel's lifecycle enums carry the proto numbers (``runtime_svc.kernel.states``), so
they map by value; compiler string enums map by member name. Nothing here exposes a raw
lease token or a checkpoint payload: steps and attempts carry the token *digest*, the
checkpoint only its metadata (§19, §17.3).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, timedelta
from typing import Any

from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from runtime_svc.api.definitions_proto import plan_proto, profile_proto, timestamp
from runtime_svc.api.signals import dependency_proto
from runtime_svc.compiler.kinds import QueueClass, StepKind
from runtime_svc.effects.support import EffectSupport
from runtime_svc.kernel import CompatibilityStatus, RunFilters, RunState
from runtime_svc.kernel.model import AttemptRecord, CheckpointMeta, StepRecord
from runtime_svc.runs import RunSupport, RunView, caller_key
from runtime_svc.runs.resolve import FlowTarget
from services.errors import InvalidArgumentError
from services.json_limits import MAX_JSON_DEPTH, JsonLimitError, loads_bounded
from services.outbox import DeliveryState
from services.proto import common_v1, runtime_v1
from services.telemetry import trace_id_of

__all__ = [
    "attempt_proto",
    "checkpoint_meta_proto",
    "input_variables_from_request",
    "list_filters_from_request",
    "run_proto",
    "step_proto",
    "support_proto",
    "target_from_request",
    "wait_budget_seconds",
]


def _ev(value: int | None) -> Any:
    # Kernel lifecycle enums carry the proto numbers; generated fields want ``ValueType``.
    return 0 if value is None else int(value)


def _queue_class(code: str | None) -> Any:
    try:
        return common_v1.QueueClass.Value(f"QUEUE_CLASS_{QueueClass(code or '').name}")
    except ValueError:
        return common_v1.QueueClass.QUEUE_CLASS_UNSPECIFIED


def _step_kind(code: str) -> Any:
    try:
        return common_v1.StepKind.Value(f"STEP_KIND_{StepKind(code).name}")
    except ValueError:
        return common_v1.StepKind.STEP_KIND_UNSPECIFIED


def _duration_ms(ms: int | None) -> Duration | None:
    if ms is None:
        return None
    d = Duration()
    d.FromTimedelta(timedelta(milliseconds=ms))
    return d


def _compat(code: str) -> Any:
    try:
        return int(CompatibilityStatus.from_code(code))
    except ValueError:
        return common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_UNSPECIFIED


def _run_profile(code: str) -> Any:
    # A LegacyInterpreter run was accepted under no §9 profile (no compiled plan).
    try:
        return profile_proto(code)
    except ValueError:
        return common_v1.ExecutionProfile.EXECUTION_PROFILE_UNSPECIFIED


#: Stored run mode -> ``common.v1.PrincipalMode`` (``mixed`` has none: UNSPECIFIED).
_PRINCIPAL_MODES = {"initiating_principal": 2, "system": 3}


def run_proto(view: RunView) -> Any:
    """``runtime_v1.FlowRun`` with its §18.2 compatibility projection."""
    r = view.run
    msg = runtime_v1.FlowRun(
        org_id=r.org_id,
        flow_run_id=r.flow_run_id,
        app_installation_id=r.app_installation_id,
        runtime_capability_id=r.runtime_capability_id,
        runtime_work_binding_digest=r.runtime_work_binding_digest,
        flow_api_name=view.flow_api_name,
        flow_version_id=r.flow_version_id,
        plan_id=r.plan_id,
        plan_digest=view.plan_digest,
        execution_profile=_run_profile(r.execution_profile),
        execution_owner=_ev(r.execution_owner),
        runtime_state=_ev(r.state),
        current_step_execution_id=r.current_step_execution_id or "",
        current_checkpoint_id=r.current_checkpoint_id or "",
        state_version=r.state_version,
        ownership_epoch=r.ownership_epoch,
        run_after=timestamp(r.run_after),
        queue_class=_queue_class(r.queue_class),
        priority=r.priority,
        terminal_cause_code=r.terminal_cause_code or "",
        delete_requested_at=timestamp(r.delete_requested_at),
        is_deleted=r.is_deleted,
        started_at=timestamp(r.started_at),
        completed_at=timestamp(r.completed_at),
        created_at=timestamp(r.created_at),
        updated_at=timestamp(r.updated_at),
        idempotency_key=caller_key(r.idempotency_key),
        trace_id=trace_id_of(r.trace_context) or "",
        compatibility=runtime_v1.CompatibilityProjection(
            status=_compat(r.interview_status),
            current_element=r.current_element or "",
            paused_at=timestamp(r.paused_at),
        ),
        operator_paused_at=timestamp(r.operator_paused_at),
    )
    if view.identity is not None and view.identity.initiating_principal_id:
        mode = view.identity.execution_principal_mode or ""
        msg.principal.CopyFrom(
            runtime_v1.PrincipalContext(
                principal_id=view.identity.initiating_principal_id,
                principal_mode=_PRINCIPAL_MODES.get(mode, 0),  # type: ignore[arg-type]
                authorization_context_digest=view.identity.authorization_context_digest or "",
                execution_principal_mode=mode,
            )
        )
    if view.output_variables is not None:
        msg.output_variables.update(dict(view.output_variables))
    return msg


def step_proto(s: StepRecord) -> Any:
    """``runtime_v1.StepExecution`` (lease token digest only)."""
    return runtime_v1.StepExecution(
        org_id=s.org_id,
        step_execution_id=s.step_execution_id,
        flow_run_id=s.flow_run_id,
        plan_step_key=s.plan_step_key,
        invocation_ordinal=s.invocation_ordinal,
        step_kind=_step_kind(s.step_kind),
        state=_ev(s.state),
        input_checkpoint_id=s.input_checkpoint_id or "",
        output_checkpoint_id=s.output_checkpoint_id or "",
        state_version=s.state_version,
        attempt_count=s.attempt_count,
        lease_owner=s.lease_owner or "",
        lease_token_digest=s.lease_token_digest or "",
        lease_until=timestamp(s.lease_until),
        ownership_epoch=s.ownership_epoch,
        run_after=timestamp(s.run_after),
        queue_class=_queue_class(s.queue_class),
        failure_class=_ev(s.failure_class),
        created_at=timestamp(s.created_at),
        updated_at=timestamp(s.updated_at),
    )


def attempt_proto(a: AttemptRecord) -> Any:
    """``runtime_v1.StepAttempt`` (safe codes and digests only)."""
    return runtime_v1.StepAttempt(
        org_id=a.org_id,
        attempt_id=a.attempt_id,
        step_execution_id=a.step_execution_id,
        attempt_number=a.attempt_number,
        lease_token_digest=a.lease_token_digest,
        ownership_epoch=a.ownership_epoch,
        root_state_version_at_claim=a.root_state_version_at_claim,
        started_at=timestamp(a.started_at),
        finished_at=timestamp(a.finished_at),
        transaction_outcome=_ev(a.outcome),
        failure_class=_ev(a.failure_class),
        safe_error_code=a.safe_error_code or "",
        retry_decision=_ev(a.retry_decision),
        retry_policy_digest=a.retry_policy_digest,
        recovery_backoff_floor=_duration_ms(a.recovery_backoff_floor_ms),
        attempt_state_version=a.attempt_state_version,
        plan_digest=a.plan_digest,
        lock_plan_digest=a.lock_plan_digest,
        trace_id=a.trace_id or "",
    )


def checkpoint_meta_proto(org_id: str, c: CheckpointMeta) -> Any:
    """``runtime_v1.CheckpointMetadata`` — never the payload."""
    return runtime_v1.CheckpointMetadata(
        org_id=org_id,
        checkpoint_id=c.checkpoint_id,
        flow_run_id=c.flow_run_id,
        sequence=c.sequence,
        context_schema_version=c.context_schema_version,
        context_digest=c.context_digest,
        created_by_attempt_id=c.created_by_attempt_id or "",
        created_at=timestamp(c.created_at),
    )


_DELIVERY = {
    DeliveryState.PENDING: common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_PENDING,
    DeliveryState.DELIVERING: common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_DELIVERING,
    DeliveryState.RETRYING: common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_RETRYING,
    DeliveryState.DELIVERED: common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_DELIVERED,
    DeliveryState.RECONCILING: (
        common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_ACCEPTANCE_RECONCILING
    ),
    # The owner's durable rejection is persisted but the Flow finalizer has not run yet:
    # still reconciling from the reader's point of view (not terminal).
    DeliveryState.REJECTED: (
        common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_ACCEPTANCE_RECONCILING
    ),
    DeliveryState.UNKNOWN: (common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_ACCEPTANCE_UNKNOWN),
    DeliveryState.HANDOFF_REJECTED: (
        common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_HANDOFF_REJECTED
    ),
    DeliveryState.DEAD_LETTERED: common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_DEAD_LETTERED,
}


def effect_proto(e: EffectSupport) -> Any:
    """``runtime_v1.EffectCorrelation``: the immutable link and its delivery state."""
    k = e.link
    link = runtime_v1.EffectLink(
        org_id=k.org_id,
        app_installation_id=k.app_installation_id,
        runtime_capability_id=k.runtime_capability_id,
        runtime_work_binding_digest=k.runtime_work_binding_digest,
        effect_link_id=k.effect_link_id,
        flow_run_id=k.flow_run_id,
        step_execution_id=k.step_execution_id,
        effect_owner_kind=k.effect_owner_kind,
        runtime_outbox_message_id=k.runtime_outbox_message_id,
        effect_handoff_key=k.effect_handoff_key,
        submission_attempt_id=k.submission_attempt_id,
        created_at=None if k.created_at is None else timestamp(k.created_at),
    )
    state = (
        common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_UNSPECIFIED
        if e.delivery_state is None
        else _DELIVERY[e.delivery_state]
    )
    return runtime_v1.EffectCorrelation(link=link, delivery_state=state)


def support_proto(s: RunSupport) -> Any:
    """``runtime_v1.RunSupportView`` (§19)."""
    view = s.support
    org = view.run.org_id
    return runtime_v1.RunSupportView(
        run=run_proto(s.view),
        plan=plan_proto(s.plan_row, s.plan, s.subflow_version_ids),
        current_step=None if view.current_step is None else step_proto(view.current_step),
        current_checkpoint=None
        if view.current_checkpoint is None
        else checkpoint_meta_proto(org, view.current_checkpoint),
        steps=[step_proto(x) for x in view.steps],
        attempts=[attempt_proto(a) for a in view.attempts],
        dependencies=[dependency_proto(d) for d in s.dependencies],
        effects=[effect_proto(e) for e in s.effects],
        terminal_cause_code=view.run.terminal_cause_code or "",
    )


# --- requests ----------------------------------------------------------------------------


def target_from_request(request: Any) -> FlowTarget | str:
    """``StartRunRequest.target``: a Flow selector or a plan id.

    Raises:
        InvalidArgumentError: no target, or an empty API name / plan id.
    """
    which = request.WhichOneof("target")
    if which == "flow":
        if not request.flow.flow_api_name:
            raise InvalidArgumentError(
                "flow.flow_api_name is required", field_path="flow.flow_api_name"
            )
        if request.flow.version_number < 0:
            raise InvalidArgumentError(
                "flow.version_number must not be negative", field_path="flow.version_number"
            )
        return FlowTarget(request.flow.flow_api_name, request.flow.version_number)
    if which == "plan_id" and request.plan_id:
        return str(request.plan_id)
    raise InvalidArgumentError("flow or plan_id is required", field_path="target")


def input_variables_from_request(request: Any) -> Mapping[str, Any]:
    """``StartRunRequest.input`` as a JSON object.

    Raises:
        InvalidArgumentError: ``input_json`` is not a JSON object.
    """
    which = request.WhichOneof("input")
    if which == "input_variables":
        s: Struct = request.input_variables
        value: Any = json_format.MessageToDict(s)
        return dict(value)
    if which == "input_json":
        try:
            decoded = loads_bounded(request.input_json)
        except JsonLimitError as exc:
            raise InvalidArgumentError(
                f"input_json nests deeper than {MAX_JSON_DEPTH} levels",
                reason="too_deep",
                field_path="input_json",
            ) from exc
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            raise InvalidArgumentError("input_json must be a JSON object", field_path="input_json")
        return decoded
    return {}


def wait_budget_seconds(request: Any) -> float:
    """``StartRunRequest.wait_budget`` in seconds (0 when unset)."""
    if not request.HasField("wait_budget"):
        return 0.0
    seconds = float(request.wait_budget.ToTimedelta().total_seconds())
    if seconds < 0:
        raise InvalidArgumentError("wait_budget must not be negative", field_path="wait_budget")
    return seconds


def list_filters_from_request(request: Any) -> RunFilters:
    """``ListRunsRequest`` filters.

    Raises:
        InvalidArgumentError: an unspecified state.
    """
    states = []
    for value in request.runtime_states:
        if value == 0:
            raise InvalidArgumentError(
                "runtime_states must not contain UNSPECIFIED", field_path="runtime_states"
            )
        states.append(RunState(value))
    return RunFilters(
        flow_api_name=request.flow_api_name or None,
        flow_version_id=request.flow_version_id or None,
        plan_id=request.plan_id or None,
        states=tuple(sorted(set(states))),
        created_after=request.created_after.ToDatetime(tzinfo=UTC)
        if request.HasField("created_after")
        else None,
        created_before=request.created_before.ToDatetime(tzinfo=UTC)
        if request.HasField("created_before")
        else None,
    )
