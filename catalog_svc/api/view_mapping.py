"""Proto <-> domain mapping of the ``RuntimeMetadataView`` (§7.1).

The content model and the content digest are the domain's
(:class:`~catalog_svc.domain.RuntimeMetadataView`): objects and fields, *lock-relevant*
parent/child relationships, trigger subscriptions and action metadata. The proto message
carries a few things that are not part of that content, handled deliberately:

* display labels of objects and fields are not content (relabelling must not recompile
  plans) and are not stored; reads return them empty. Action labels are content;
* a relationship's ``name`` and ``kind`` are not content: reads return the child field
  API name as the name and ``RELATIONSHIP_KIND_UNSPECIFIED``;
* ``lock_relevant = false`` relationships carry meaning the runtime view cannot hold
  (it holds lock-relevant relationships only), so they are refused with
  ``INVALID_ARGUMENT`` rather than silently dropped;
* ``read_only`` fields, ``history_tracked`` objects and a relationship's
  ``max_children`` (0 = undeclared) are content; their defaults are left out of the
  canonical form, so views that do not use them keep their digest;
* ``org_id``, ``app_installation_id`` and ``schema_generation`` describe the publication,
  not the content: identical content has one digest in every installation (visibility
  stays per installation, see ``catalog_svc.schema.metadata_view_installations``).

An enum number outside the domain's closed set is refused as ``unknown_enum_value``.
"""

from __future__ import annotations

from datetime import datetime

from google.protobuf.timestamp_pb2 import Timestamp

from catalog_svc.domain import (
    ActionMetadata,
    ActionParameter,
    Diagnostic,
    DiagnosticCode,
    FieldSchema,
    FieldType,
    LockRelationship,
    ObjectSchema,
    RuntimeMetadataView,
    TriggerEvent,
    TriggerSubscription,
    TriggerTiming,
)
from services.proto import catalog_v1, common_v1

from .issues import enum_value, invalid

__all__ = ["timestamp", "view_from_proto", "view_to_proto"]


def timestamp(value: datetime) -> Timestamp:
    """A protobuf timestamp of an aware datetime."""
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def _field(msg: catalog_v1.FieldSchema, path: str, issues: list[Diagnostic]) -> FieldSchema:
    ftype = enum_value(FieldType, msg.type, f"{path}.type", issues)
    decimal = ftype in (FieldType.DECIMAL, FieldType.CURRENCY) and msg.precision > 0
    return FieldSchema(
        api_name=msg.api_name,
        type=ftype,
        required=msg.required,
        max_length=msg.max_length or None,
        precision=msg.precision or None,
        # scale 0 is meaningful for a decimal with a precision; elsewhere 0 means unset.
        scale=msg.scale if decimal else (msg.scale or None),
        reference_object_api_name=msg.reference_object_api_name or None,
        picklist_values=tuple(msg.picklist_values),
        read_only=msg.read_only,
    )


def _parameter(
    msg: catalog_v1.ActionParameter, path: str, issues: list[Diagnostic]
) -> ActionParameter:
    return ActionParameter(
        name=msg.name,
        type=enum_value(FieldType, msg.type, f"{path}.type", issues),
        required=msg.required,
        is_collection=msg.is_collection,
    )


def view_from_proto(msg: catalog_v1.MetadataView, prefix: str = "view") -> RuntimeMetadataView:
    """The validated, normalized domain view of ``msg``.

    Raises:
        InvalidArgumentError: every issue, paths relative to ``prefix`` in request order.
    """
    issues: list[Diagnostic] = []
    objects = tuple(
        ObjectSchema(
            o.api_name,
            tuple(_field(f, f"objects[{i}].fields[{j}]", issues) for j, f in enumerate(o.fields)),
            history_tracked=o.history_tracked,
        )
        for i, o in enumerate(msg.objects)
    )
    relationships: list[LockRelationship] = []
    for i, r in enumerate(msg.relationships):
        if not r.lock_relevant:
            issues.append(
                Diagnostic(
                    f"relationships[{i}].lock_relevant",
                    DiagnosticCode.UNKNOWN_FIELD,
                    "the runtime metadata view holds lock-relevant relationships only",
                )
            )
        relationships.append(
            LockRelationship(
                r.child_object_api_name,
                r.child_field_api_name,
                r.parent_object_api_name,
                # 0 = undeclared; a negative number is kept so validation reports it.
                max_children=r.max_children or None,
            )
        )
    triggers = tuple(
        TriggerSubscription(
            flow_api_name=s.flow_api_name,
            object_api_name=s.object_api_name,
            timing=enum_value(
                TriggerTiming, s.timing, f"trigger_subscriptions[{i}].timing", issues
            ),
            events=tuple(
                enum_value(TriggerEvent, ev, f"trigger_subscriptions[{i}].events[{j}]", issues)
                for j, ev in enumerate(s.events)
            ),
            entry_condition=s.entry_condition or None,
            dispatch_order=s.dispatch_order,
        )
        for i, s in enumerate(msg.trigger_subscriptions)
    )
    actions = tuple(
        ActionMetadata(
            action_type=a.action_type,
            label=a.label,
            inputs=tuple(
                _parameter(x, f"actions[{i}].inputs[{j}]", issues) for j, x in enumerate(a.inputs)
            ),
            outputs=tuple(
                _parameter(x, f"actions[{i}].outputs[{j}]", issues) for j, x in enumerate(a.outputs)
            ),
        )
        for i, a in enumerate(msg.actions)
    )
    view = RuntimeMetadataView(objects, tuple(relationships), triggers, actions)
    reported = {d.path for d in issues}
    issues += [d for d in view.validate() if d.path not in reported]
    if issues:
        raise invalid(issues, prefix)
    return view.normalized()


def view_to_proto(
    view: RuntimeMetadataView,
    *,
    org_id: str,
    app_installation_id: str,
    digest: str,
    schema_generation: int,
    created_at: datetime,
) -> catalog_v1.MetadataView:
    """The proto of a stored view as published by one installation."""
    v = view.normalized()
    return catalog_v1.MetadataView(
        org_id=org_id,
        app_installation_id=app_installation_id,
        runtime_metadata_view_digest=digest,
        schema_generation=schema_generation,
        objects=[
            catalog_v1.ObjectSchema(
                api_name=o.api_name,
                history_tracked=o.history_tracked,
                fields=[
                    catalog_v1.FieldSchema(
                        api_name=f.api_name,
                        type=catalog_v1.FieldType.ValueType(f.type),
                        required=f.required,
                        max_length=f.max_length or 0,
                        precision=f.precision or 0,
                        scale=f.scale or 0,
                        picklist_values=list(f.picklist_values),
                        reference_object_api_name=f.reference_object_api_name or "",
                        read_only=f.read_only,
                    )
                    for f in o.fields
                ],
            )
            for o in v.objects
        ],
        relationships=[
            catalog_v1.Relationship(
                name=r.child_field_api_name,
                parent_object_api_name=r.parent_object_api_name,
                child_object_api_name=r.child_object_api_name,
                child_field_api_name=r.child_field_api_name,
                lock_relevant=True,
                max_children=r.max_children or 0,
            )
            for r in v.relationships
        ],
        trigger_subscriptions=[
            catalog_v1.TriggerSubscription(
                flow_api_name=s.flow_api_name,
                object_api_name=s.object_api_name,
                timing=common_v1.TriggerTiming.ValueType(s.timing),
                events=[common_v1.TriggerEvent.ValueType(e) for e in s.events],
                entry_condition=s.entry_condition or "",
                dispatch_order=s.dispatch_order,
            )
            for s in v.trigger_subscriptions
        ],
        actions=[
            catalog_v1.ActionMetadata(
                action_type=a.action_type,
                label=a.label,
                inputs=[_parameter_to_proto(x) for x in a.inputs],
                outputs=[_parameter_to_proto(x) for x in a.outputs],
            )
            for a in v.actions
        ],
        created_at=timestamp(created_at),
    )


def _parameter_to_proto(x: ActionParameter) -> catalog_v1.ActionParameter:
    return catalog_v1.ActionParameter(
        name=x.name,
        type=catalog_v1.FieldType.ValueType(x.type),
        required=x.required,
        is_collection=x.is_collection,
    )
