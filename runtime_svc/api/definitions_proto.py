"""Domain values of :mod:`runtime_svc.definitions` → ``runtime.v1`` protos.

Only this module (and the servicer next to it) knows both the domain values and the
generated messages; pure code never imports protos (CONTRIBUTING "Code").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from runtime_svc.compiler import (
    ExecutionPlan,
    ExecutionProfile,
    PlanStep,
    StepKind,
    explain,
)
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions.inventory import DiagnosticValue, InventoryRow
from runtime_svc.definitions.source import FlowSourceInfo
from services.digest import versioned_digest
from services.proto import common_v1, runtime_v1

__all__ = [
    "activation_proto",
    "diagnostic_proto",
    "flow_version_proto",
    "inventory_entry_proto",
    "plan_proto",
    "plan_summary_proto",
    "profile_from_proto",
    "profile_proto",
    "timestamp",
]

_ACTIVATION_STATE: Mapping[str, Any] = {
    repo.ACTIVE: runtime_v1.ActivationState.ACTIVATION_STATE_ACTIVE,
    repo.SUPERSEDED: runtime_v1.ActivationState.ACTIVATION_STATE_SUPERSEDED,
    repo.DEACTIVATED: runtime_v1.ActivationState.ACTIVATION_STATE_DEACTIVATED,
}
_SEVERITY: Mapping[str, Any] = {
    "error": runtime_v1.DiagnosticSeverity.DIAGNOSTIC_SEVERITY_ERROR,
    "warning": runtime_v1.DiagnosticSeverity.DIAGNOSTIC_SEVERITY_WARNING,
    "info": runtime_v1.DiagnosticSeverity.DIAGNOSTIC_SEVERITY_INFO,
}
_PROCESS_TYPE: Mapping[str, Any] = {
    "autolaunched": runtime_v1.FlowProcessType.FLOW_PROCESS_TYPE_AUTOLAUNCHED,
    "record_triggered": runtime_v1.FlowProcessType.FLOW_PROCESS_TYPE_RECORD_TRIGGERED,
}
_TIMING: Mapping[str, Any] = {
    "before_save": common_v1.TriggerTiming.TRIGGER_TIMING_BEFORE_SAVE,
    "after_save": common_v1.TriggerTiming.TRIGGER_TIMING_AFTER_SAVE,
}
_EVENT: Mapping[str, Any] = {
    "create": common_v1.TriggerEvent.TRIGGER_EVENT_CREATE,
    "update": common_v1.TriggerEvent.TRIGGER_EVENT_UPDATE,
    "delete": common_v1.TriggerEvent.TRIGGER_EVENT_DELETE,
}


def _enum(wrapper: Any, prefix: str, name: str) -> Any:
    # Generated enum values are typed per enum (``ValueType``); callers pass them on.
    return wrapper.Value(f"{prefix}_{name.upper()}")


def timestamp(value: datetime | None) -> Timestamp | None:
    """``Timestamp`` of an aware datetime (``None`` stays unset)."""
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def profile_proto(profile: ExecutionProfile | str | None) -> Any:
    """``common_v1.ExecutionProfile`` of a compiler profile (``None`` → UNSPECIFIED)."""
    if profile is None:
        return common_v1.ExecutionProfile.EXECUTION_PROFILE_UNSPECIFIED
    return _enum(common_v1.ExecutionProfile, "EXECUTION_PROFILE", ExecutionProfile(profile).name)


def profile_from_proto(value: Any) -> ExecutionProfile | None:
    """Compiler profile of a ``common_v1.ExecutionProfile`` (UNSPECIFIED → ``None``)."""
    if value == common_v1.ExecutionProfile.EXECUTION_PROFILE_UNSPECIFIED:
        return None
    name = common_v1.ExecutionProfile.Name(value).removeprefix("EXECUTION_PROFILE_")
    return ExecutionProfile[name]


def diagnostic_proto(d: DiagnosticValue) -> Any:
    """``runtime_v1.CompileDiagnostic``."""
    return runtime_v1.CompileDiagnostic(
        path=d.path,
        code=d.code,
        message=d.message,
        severity=_SEVERITY.get(d.severity, runtime_v1.DiagnosticSeverity.DIAGNOSTIC_SEVERITY_INFO),
        blocker_chain=list(d.blocker_chain),
    )


def _variable_type(v: Mapping[str, Any]) -> str:
    if v.get("type") == "record" and v.get("object"):
        return f"record<{v['object']}>"
    return str(v.get("type", ""))


def flow_version_proto(row: repo.FlowVersionRow, info: FlowSourceInfo) -> Any:
    """``runtime_v1.FlowVersion``: the stored source and the fields parsed from it."""
    trigger = info.trigger
    trigger_proto = None
    if trigger is not None:
        trigger_proto = runtime_v1.FlowTrigger(
            object_api_name=str(trigger.get("object", "")),
            timing=_TIMING.get(str(trigger.get("timing")), 0),
            events=[_EVENT[e] for e in trigger.get("events") or () if e in _EVENT],
            entry_condition=str(trigger.get("entry_condition") or ""),
        )
    requested = ExecutionProfile.BOUNDED_ATOMIC if info.run_atomically else None
    return runtime_v1.FlowVersion(
        org_id=row.org_id,
        flow_version_id=row.flow_version_id,
        flow_api_name=row.flow_api_name,
        version_number=row.version_number,
        label=row.label or row.flow_api_name,
        source_json=row.source_json,
        metadata_digest=row.metadata_digest,
        process_type=_PROCESS_TYPE.get(info.process_type, 0),
        trigger=trigger_proto,
        run_atomically=info.run_atomically,
        requested_profile=profile_proto(requested),
        variables=[
            runtime_v1.FlowVariable(
                name=str(v["name"]),
                data_type=_variable_type(v),
                is_collection=bool(v.get("collection")),
                is_input=bool(v.get("input")),
                is_output=bool(v.get("output")),
            )
            for v in info.variables
        ],
        referenced_action_types=list(info.action_types),
        referenced_subflow_api_names=sorted({s.api_name for s in info.subflows}),
        element_count=len(info.elements),
        created_at=timestamp(row.created_at),
    )


def activation_proto(row: repo.ActivationRow) -> Any:
    """``runtime_v1.FlowActivation``."""
    return runtime_v1.FlowActivation(
        org_id=row.scope.org_id,
        flow_api_name=row.flow_api_name,
        flow_version_id=row.flow_version_id,
        plan_id=row.plan_id or "",
        plan_digest=row.plan_digest or "",
        runtime_work_binding_digest=row.scope.runtime_work_binding_digest,
        trigger_binding_digest=row.trigger_binding_digest,
        state=_ACTIVATION_STATE.get(row.state, 0),
        activated_at=timestamp(row.activated_at),
        deactivated_at=timestamp(row.ended_at),
    )


def _scope(row: repo.PlanRow) -> Any:
    return common_v1.TrustedRuntimeWorkScope(
        org_id=row.scope.org_id,
        app_installation_id=row.scope.app_installation_id,
        runtime_capability_id=row.scope.runtime_capability_id,
        runtime_work_binding_digest=row.scope.runtime_work_binding_digest,
    )


def _bound_summary(d: Mapping[str, Any]) -> Any:
    return runtime_v1.BoundSummary(
        max_steps=d.get("max_steps") or 0,
        max_reads=d.get("max_reads") or 0,
        max_writes=d.get("max_writes") or 0,
        max_fanout=d.get("max_fanout") or 0,
        fanout_unknown=d.get("max_fanout") is None,
        lock_classes=sorted(d.get("lock_classes") or ()),
    )


def plan_summary_proto(row: repo.PlanRow) -> Any:
    """``runtime_v1.PlanSummary``."""
    payload = json.loads(row.plan_payload)
    return runtime_v1.PlanSummary(
        plan_id=row.plan_id,
        plan_digest=row.plan_digest,
        execution_profile=profile_proto(row.execution_profile),
        flow_version_id=row.flow_version_id,
        catalog_generation=common_v1.CatalogGenerationRef(
            scope=_scope(row),
            catalog_generation_id=row.catalog_generation_id,
            catalog_digest=row.catalog_digest,
        ),
        runtime_metadata_view_digest=row.metadata_view_digest,
        trigger_binding_digest=row.trigger_binding_digest,
        compiler_version=row.compiler_version,
        policy_version=str(row.policy_version),
        step_count=len(payload.get("payload", {}).get("steps", ())),
        bound_summary=_bound_summary(json.loads(row.bound_summary)),
        created_at=timestamp(row.created_at),
    )


def _queue_class(step: PlanStep) -> Any:
    if step.queue_class is None:
        return common_v1.QueueClass.QUEUE_CLASS_UNSPECIFIED
    return _enum(common_v1.QueueClass, "QUEUE_CLASS", step.queue_class.name)


def _step_proto(step: PlanStep) -> Any:
    pin = step.actions[0] if step.actions else None
    paired = ""
    if step.effect is not None:
        paired = (
            step.effect.completion_step
            if step.kind is StepKind.EFFECT_SUBMIT
            else step.effect.submit_step
        )
    resources = [
        common_v1.ResourceKey(
            resource_class=r.resource_class,
            namespace=r.object,
            record_identity=r.key_source,
            partition=r.parent_relationship or "",
            ordering_version=1,
        )
        for r in step.resources
    ]
    checkpoint = None
    if step.checkpoint is not None:
        business = runtime_v1.CheckpointFieldClass.CHECKPOINT_FIELD_CLASS_BUSINESS
        control = runtime_v1.CheckpointFieldClass.CHECKPOINT_FIELD_CLASS_CONTROL
        checkpoint = runtime_v1.CheckpointSchema(
            context_schema_version=step.checkpoint.schema_version,
            fields=[
                runtime_v1.CheckpointField(name=f.name, data_type=f.type, classification=business)
                for f in step.checkpoint.outputs
            ]
            + [
                runtime_v1.CheckpointField(name=c, data_type="cursor", classification=control)
                for c in step.checkpoint.cursor
            ],
        )
    dependencies = []
    if step.dependency is not None:
        d = step.dependency
        dependencies.append(
            runtime_v1.DependencyDeclaration(
                producer_kind=d.producer_kind,
                producer_key_template=d.key,
                condition_digest=d.condition_digest,
                max_wait=None
                if d.deadline_seconds is None
                else Duration(seconds=d.deadline_seconds),
                expiry_policy=_enum(common_v1.ExpiryPolicy, "EXPIRY_POLICY", d.expiry_policy.name),
                fault_successor_step_key=d.fault_successor or "",
            )
        )
    return runtime_v1.PlanStep(
        step_key=step.key,
        kind=_enum(common_v1.StepKind, "STEP_KIND", step.kind.name),
        element_names=list(step.nodes),
        edges=[
            runtime_v1.PlanEdge(
                kind=_enum(runtime_v1.PlanEdgeKind, "PLAN_EDGE_KIND", t.kind.name),
                target_step_key=t.target,
            )
            for t in step.transitions
        ],
        action=None
        if pin is None
        else runtime_v1.ActionBindingRef(
            action_type=pin.action_type,
            entry_digest=pin.entry_digest,
            binding_fingerprint=pin.binding_fingerprint,
            descriptor_digest=pin.capability_digest,
        ),
        paired_step_key=paired,
        resource_plan=runtime_v1.ResourcePlan(
            keys=resources,
            lock_classes=sorted({r.resource_class for r in step.resources}),
            max_keys=sum(r.bound or 0 for r in step.resources),
            late_discovery_allowed=False,
            lock_plan_digest=versioned_digest("lock-plan", [r.to_dict() for r in step.resources]),
        ),
        checkpoint_schema=checkpoint,
        dependencies=dependencies,
        queue_class=_queue_class(step),
    )


def plan_proto(
    row: repo.PlanRow, plan: ExecutionPlan, subflow_ids: Mapping[tuple[str, int], str]
) -> Any:
    """``runtime_v1.FlowExecutionPlan``: the stored row, its payload and its explanation."""
    b = plan.binding
    return runtime_v1.FlowExecutionPlan(
        org_id=row.scope.org_id,
        app_installation_id=row.scope.app_installation_id,
        runtime_capability_id=row.scope.runtime_capability_id,
        runtime_work_binding_digest=row.scope.runtime_work_binding_digest,
        plan_id=row.plan_id,
        flow_version_id=row.flow_version_id,
        metadata_digest=row.metadata_digest,
        compiler_version=row.compiler_version,
        catalog_generation_id=row.catalog_generation_id,
        catalog_digest=row.catalog_digest,
        runtime_work_binding=common_v1.RuntimeWorkBinding(
            org_id=b.org_id,
            app_installation_id=b.app_installation_id,
            runtime_capability_id=b.runtime_capability_id,
            catalog_revision=b.catalog_revision,
            schema_generation=b.schema_generation,
            engine_generation=b.engine_generation,
            catalog_snapshot_digest=b.catalog_snapshot_digest,
            runtime_metadata_view_digest=b.metadata_view_digest,
        ),
        runtime_metadata_view_digest=row.metadata_view_digest,
        trigger_binding_digest=row.trigger_binding_digest,
        policy_version=str(row.policy_version),
        execution_profile=profile_proto(plan.profile),
        plan_digest=row.plan_digest,
        payload=runtime_v1.PlanPayload(
            entry_step_key=plan.start_step,
            steps=[_step_proto(s) for s in plan.steps],
            action_bindings=[
                runtime_v1.ActionBindingRef(
                    action_type=a.action_type,
                    entry_digest=a.entry_digest,
                    binding_fingerprint=a.binding_fingerprint,
                    descriptor_digest=a.capability_digest,
                )
                for a in plan.actions
            ],
            subflow_plans=[
                runtime_v1.SubflowPlanRef(
                    flow_api_name=s.api_name,
                    flow_version_id=subflow_ids.get((s.api_name, s.version), ""),
                    plan_digest=s.plan_digest,
                )
                for s in plan.subflows
            ],
            payload_digest=plan.payload_digest,
        ),
        bound_summary=_bound_summary(plan.bounds.to_dict()),
        diagnostic_summary=explain(plan),
        created_at=timestamp(row.created_at),
    )


def inventory_entry_proto(row: InventoryRow) -> Any:
    """``runtime_v1.InventoryEntry``."""
    return runtime_v1.InventoryEntry(
        flow_api_name=row.flow_api_name,
        flow_version_id=row.flow_version_id,
        compilable=row.compilable,
        selected_profile=profile_proto(row.profile),
        diagnostics=[diagnostic_proto(d) for d in row.diagnostics],
        unknown_capabilities=list(row.unknown_capabilities),
        fanout_proven=row.fanout_proven,
        estimated_step_count=row.estimated_step_count,
        legacy_behaviors=list(row.legacy_behaviors),
        migration_cohort=_enum(runtime_v1.MigrationCohort, "MIGRATION_COHORT", row.cohort.name),
    )
