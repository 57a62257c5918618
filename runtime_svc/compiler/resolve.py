"""Step 2 of §7.2: resolve every element, field, variable, action and trigger reference.

Everything is resolved against the one bound metadata view and the one sealed
catalog generation in :class:`~.inputs.CompilerInputs`; nothing else is read.
Subflow references are resolved by the compile driver, which compiles each
child first (that is also where recursion is detected).
"""

from __future__ import annotations

from dataclasses import dataclass

from .diagnostics import IssueSink
from .expressions import Expr, Ref, references
from .inputs import (
    CapabilityEntryView,
    CompilerInputs,
    ExecutionClass,
    MetadataViewInput,
    TriggerSubscription,
)
from .kinds import ExpiryPolicy
from .language import (
    ActionCall,
    Assignment,
    AssignOp,
    CreateRecord,
    Decision,
    DeleteRecord,
    Element,
    EventWait,
    Filter,
    FlowDef,
    GetRecords,
    Loop,
    ProcessType,
    RecordWait,
    Subflow,
    TimeWait,
    TriggerEvent,
    TriggerTiming,
    UpdateRecord,
    Variable,
    VarType,
    Wait,
)

__all__ = [
    "SUPPORTED_CAPABILITY_VERSION",
    "check_inputs",
    "check_subflow_interface",
    "resolve_flow",
    "select_trigger_subscriptions",
]

#: Highest ``MinimumCapabilityVersion`` this compiler understands.
SUPPORTED_CAPABILITY_VERSION = 1


def check_inputs(inputs: CompilerInputs, sink: IssueSink) -> None:
    """Reject inputs that are not one consistent, sealed binding (§7.1, §8.2)."""
    b, c, v = inputs.binding, inputs.catalog, inputs.metadata_view
    if not c.sealed:
        sink.error(
            "inputs.catalog",
            "catalog.not_sealed",
            f"catalog generation {c.generation_id} is not sealed",
        )
    scope_b = (b.org_id, b.app_installation_id, b.runtime_capability_id, b.binding_digest)
    scope_c = (c.org_id, c.app_installation_id, c.runtime_capability_id, c.binding_digest)
    if scope_b != scope_c:
        sink.error(
            "inputs.catalog",
            "inputs.binding_mismatch",
            "the catalog generation belongs to another RuntimeWorkBinding scope",
        )
    if b.metadata_view_digest != v.digest:
        sink.error(
            "inputs.metadata_view",
            "inputs.binding_mismatch",
            "the metadata view is not the view named by the RuntimeWorkBinding",
        )


@dataclass
class _Ctx:
    flow: FlowDef
    view: MetadataViewInput
    sink: IssueSink


def _fields_on(ctx: _Ctx, obj_name: str, segs: tuple[str, ...], path: str, what: str) -> None:
    obj = ctx.view.object(obj_name)
    for i, seg in enumerate(segs):
        if obj is None:
            ctx.sink.error(
                path,
                "metadata.unknown_object",
                f"{what}: object {obj_name!r} is not in the metadata view",
            )
            return
        f = obj.field(seg)
        if f is None:
            ctx.sink.error(
                path, "metadata.unknown_field", f"{what}: {obj.api_name} has no field {seg!r}"
            )
            return
        if i < len(segs) - 1:
            if f.reference_to is None:
                ctx.sink.error(
                    path,
                    "expression.not_a_reference",
                    f"{what}: {obj.api_name}.{seg} is not a lookup",
                )
                return
            obj_name = f.reference_to
            obj = ctx.view.object(obj_name)


def _check_ref(
    ctx: _Ctx, ref: Ref, path: str, *, allow_event: bool = False, event_object: str | None = None
) -> None:
    what = f"{ref.dotted()!r} (offset {ref.pos})"
    trig = ctx.flow.trigger
    if ref.root in ("$Record", "$Record__Prior"):
        if trig is None:
            ctx.sink.error(
                path,
                "expression.no_trigger_record",
                f"{what}: only record-triggered Flows have {ref.root}",
            )
            return
        if ref.root == "$Record__Prior" and TriggerEvent.UPDATE not in trig.events:
            ctx.sink.error(
                path,
                "expression.prior_requires_update",
                f"{what}: $Record__Prior needs an update trigger",
            )
            return
        if not ref.path:
            return
        _fields_on(ctx, trig.object, ref.path, path, what)
        return
    if ref.root == "$Event":
        if not allow_event:
            ctx.sink.error(
                path,
                "expression.event_outside_wait",
                f"{what}: $Event exists only in an event wait condition",
            )
        elif event_object is not None and ref.path:
            # A record wait's $Event is the watched record: its fields are checked.
            _fields_on(ctx, event_object, ref.path, path, what)
        return
    var = ctx.flow.variable(ref.root)
    if var is None:
        ctx.sink.error(path, "expression.unknown_variable", f"{what}: no variable {ref.root!r}")
        return
    if ref.path:
        if var.type is not VarType.RECORD or var.collection or var.object is None:
            ctx.sink.error(
                path, "expression.not_a_record", f"{what}: {var.name} is not a single record"
            )
            return
        _fields_on(ctx, var.object, ref.path, path, what)


def _check_expr(
    ctx: _Ctx,
    e: Expr | None,
    path: str,
    *,
    allow_event: bool = False,
    event_object: str | None = None,
) -> None:
    if e is None:
        return
    for ref in references(e):
        _check_ref(ctx, ref, path, allow_event=allow_event, event_object=event_object)


def _var(
    ctx: _Ctx,
    name: str | None,
    path: str,
    *,
    collection: bool | None = None,
    obj: str | None = None,
) -> Variable | None:
    if name is None:
        return None
    var = ctx.flow.variable(name)
    if var is None:
        ctx.sink.error(path, "expression.unknown_variable", f"no variable {name!r}")
        return None
    if collection is not None and var.collection != collection:
        want = "a collection" if collection else "a single value"
        ctx.sink.error(path, "variable.type_mismatch", f"variable {name!r} must be {want}")
    if obj is not None and (var.type is not VarType.RECORD or var.object != obj):
        ctx.sink.error(path, "variable.type_mismatch", f"variable {name!r} must hold {obj} records")
    return var


def _object(ctx: _Ctx, name: str, path: str) -> bool:
    if ctx.view.object(name) is None:
        ctx.sink.error(
            path, "metadata.unknown_object", f"object {name!r} is not in the metadata view"
        )
        return False
    return True


def _filters(ctx: _Ctx, obj: str, filters: tuple[Filter, ...], path: str) -> None:
    for f in filters:
        _fields_on(ctx, obj, (f.field,), f"{path}.filters", f"filter on {f.field!r}")
        _check_expr(ctx, f.value, f"{path}.filters")


def _record_target(ctx: _Ctx, el: UpdateRecord | DeleteRecord, path: str) -> None:
    if el.record == "$Record":
        trig = ctx.flow.trigger
        if trig is None:
            ctx.sink.error(
                f"{path}.record",
                "expression.no_trigger_record",
                "only record-triggered Flows have $Record",
            )
        elif trig.object != el.object:
            ctx.sink.error(
                f"{path}.record",
                "record.object_mismatch",
                f"$Record is a {trig.object}, not a {el.object}",
            )
        elif isinstance(el, DeleteRecord) and trig.timing is TriggerTiming.BEFORE_SAVE:
            ctx.sink.error(
                f"{path}.record",
                "record.delete_trigger_record",
                "a before-save Flow cannot delete $Record",
            )
    elif el.record is not None:
        _var(ctx, el.record, f"{path}.record", obj=el.object)


def _action(
    ctx: _Ctx, inputs: CompilerInputs, el: ActionCall, path: str
) -> CapabilityEntryView | None:
    entries = inputs.entries_for(el.action_type)
    if not entries:
        ctx.sink.error(
            f"{path}.action_type",
            "action.unknown",
            f"action type {el.action_type!r} is not in catalog generation "
            f"{inputs.catalog.generation_id}",
        )
        return None
    if len(entries) > 1:
        ctx.sink.error(
            f"{path}.action_type",
            "catalog.conflict",
            f"catalog generation {inputs.catalog.generation_id} has {len(entries)} "
            f"entries for {el.action_type!r}",
        )
        return None
    entry = entries[0]
    if entry.contract_only:
        ctx.sink.error(
            f"{path}.action_type",
            "action.contract_only",
            f"{el.action_type!r} is a reserved contract-only action without a handler binding",
        )
    elif not entry.binding_fingerprint:
        ctx.sink.error(
            f"{path}.action_type",
            "action.no_handler_binding",
            f"{el.action_type!r} has no handler binding",
        )
    mcv = entry.capabilities.minimum_capability_version
    if mcv is not None and mcv > SUPPORTED_CAPABILITY_VERSION:
        ctx.sink.error(
            f"{path}.action_type",
            "action.capability_version_unsupported",
            f"{el.action_type!r} needs capability version {mcv}; "
            f"this compiler supports {SUPPORTED_CAPABILITY_VERSION}",
        )
    if entry.capabilities.execution_class is ExecutionClass.UNKNOWN:
        ctx.sink.error(
            f"{path}.action_type",
            "capability.execution_class_unknown",
            f"{el.action_type!r} declares no execution class; no profile can place it",
        )
    meta = ctx.view.action(el.action_type)
    if meta is None:
        ctx.sink.error(
            f"{path}.action_type",
            "metadata.unknown_action",
            f"{el.action_type!r} has no action metadata in the view",
        )
        return entry
    declared = {p.name: p for p in meta.inputs}
    given = {k for k, _ in el.inputs}
    for k in sorted(given - declared.keys()):
        ctx.sink.error(
            f"{path}.inputs.{k}",
            "action.unknown_parameter",
            f"{el.action_type!r} has no input {k!r}",
        )
    for p in meta.inputs:
        if p.required and p.name not in given:
            ctx.sink.error(
                f"{path}.inputs",
                "action.missing_parameter",
                f"{el.action_type!r} requires input {p.name!r}",
            )
    if el.output_variable is not None and any(p.sensitive for p in meta.outputs):
        # §5.4.6/§17.3: a credential must never reach a checkpoint.
        ctx.sink.error(
            f"{path}.output_variable",
            "checkpoint.sensitive_output",
            f"{el.action_type!r} returns a sensitive value; it cannot be stored in Flow context",
        )
    return entry


def _wait(ctx: _Ctx, inputs: CompilerInputs, el: Wait, path: str) -> None:
    w = el.wait
    if isinstance(w, TimeWait):
        _check_expr(ctx, w.until, f"{path}.wait.until")
    elif isinstance(w, EventWait):
        _check_expr(ctx, w.key, f"{path}.wait.key")
        _check_expr(ctx, w.condition, f"{path}.wait.condition", allow_event=True)
        if ctx.view.producer(w.producer_kind) is None:
            ctx.sink.error(
                f"{path}.wait.producer_kind",
                "wait.unregistered_producer",
                f"no registered producer {w.producer_kind!r}: "
                "the wait could never be resolved or reconciled",
            )
    elif isinstance(w, RecordWait):
        if ctx.view.object(w.object) is None:
            ctx.sink.error(
                f"{path}.wait.object",
                "metadata.unknown_object",
                f"no object {w.object!r} in the metadata view",
            )
        else:
            _check_expr(ctx, w.record_id, f"{path}.wait.record_id")
            _check_expr(
                ctx,
                w.condition,
                f"{path}.wait.condition",
                allow_event=True,
                event_object=w.object,
            )
    if el.deadline_seconds > inputs.policy.max_wait_seconds:
        ctx.sink.error(
            f"{path}.deadline",
            "wait.deadline_exceeds_policy",
            f"deadline {el.deadline} exceeds the policy's maximum wait of "
            f"{inputs.policy.max_wait_seconds}s (policy v{inputs.policy.version})",
        )
    if el.expiry_policy is ExpiryPolicy.FAULT_PATH and el.fault is None:
        ctx.sink.error(
            f"{path}.fault",
            "wait.fault_path_without_connector",
            "expiry_policy fault_path needs a 'fault' connector",
        )
    if el.expiry_policy is not ExpiryPolicy.FAULT_PATH and el.fault is not None:
        ctx.sink.error(
            f"{path}.fault",
            "wait.fault_connector_unused",
            "a 'fault' connector is only taken with expiry_policy fault_path, "
            f"not {el.expiry_policy.value}",
        )


def _element(
    ctx: _Ctx, inputs: CompilerInputs, el: Element, pins: dict[str, CapabilityEntryView]
) -> None:
    path = f"elements[{el.api_name}]"
    for _label, cpath, target in el.connectors():
        if ctx.flow.element(target) is None:
            ctx.sink.error(
                f"{path}.{cpath}",
                "graph.unknown_target",
                f"connector targets unknown element {target!r}",
            )
    if isinstance(el, Assignment):
        for i, item in enumerate(el.items):
            ipath = f"{path}.assignments[{i}]"
            t = item.target
            if t.root == "$Record":
                trig = ctx.flow.trigger
                if trig is not None and trig.timing is TriggerTiming.AFTER_SAVE:
                    ctx.sink.error(
                        ipath,
                        "assignment.record_after_save",
                        "after-save Flows change $Record only with UpdateRecord",
                    )
                if not t.path:
                    ctx.sink.error(
                        ipath,
                        "assignment.invalid_target",
                        "assign a field of $Record, not $Record itself",
                    )
            elif t.root.startswith("$"):
                ctx.sink.error(ipath, "assignment.invalid_target", f"{t.root} is read-only")
            _check_ref(ctx, t, ipath)
            var = ctx.flow.variable(t.root)
            if item.op is AssignOp.ADD_ITEM and (var is None or not var.collection or t.path):
                ctx.sink.error(
                    ipath,
                    "assignment.invalid_target",
                    "add_item needs a collection variable target",
                )
            _check_expr(ctx, item.value, ipath)
    elif isinstance(el, Decision):
        for r in el.rules:
            _check_expr(ctx, r.condition, f"{path}.rules[{r.name}].condition")
    elif isinstance(el, Loop):
        coll = _var(ctx, el.collection, f"{path}.collection", collection=True)
        item_var = _var(ctx, el.item_variable, f"{path}.item_variable", collection=False)
        if (
            coll is not None
            and item_var is not None
            and (coll.type, coll.object)
            != (
                item_var.type,
                item_var.object,
            )
        ):
            ctx.sink.error(
                f"{path}.item_variable",
                "variable.type_mismatch",
                "the item variable must match the collection type",
            )
        if el.each is None:
            ctx.sink.error(f"{path}.each", "loop.missing_body", "a Loop needs an 'each' connector")
        if (
            el.bound is not None
            and el.bound.relationship is not None
            and ctx.view.relationship(el.bound.relationship) is None
        ):
            ctx.sink.error(
                f"{path}.bound.relationship",
                "metadata.unknown_relationship",
                f"no relationship {el.bound.relationship!r}",
            )
    elif isinstance(el, GetRecords):
        if _object(ctx, el.object, f"{path}.object"):
            _filters(ctx, el.object, el.filters, path)
        _var(
            ctx,
            el.output_variable,
            f"{path}.output_variable",
            collection=not el.first_only,
            obj=el.object,
        )
    elif isinstance(el, CreateRecord):
        if _object(ctx, el.object, f"{path}.object"):
            for name, value in el.fields:
                _fields_on(ctx, el.object, (name,), f"{path}.fields.{name}", f"field {name!r}")
                _check_expr(ctx, value, f"{path}.fields.{name}")
        _var(ctx, el.from_variable, f"{path}.from_variable", collection=True, obj=el.object)
        _var(ctx, el.output_variable, f"{path}.output_variable")
    elif isinstance(el, UpdateRecord | DeleteRecord):
        if _object(ctx, el.object, f"{path}.object"):
            _filters(ctx, el.object, el.filters, path)
            if isinstance(el, UpdateRecord):
                for name, value in el.fields:
                    _fields_on(ctx, el.object, (name,), f"{path}.fields.{name}", f"field {name!r}")
                    _check_expr(ctx, value, f"{path}.fields.{name}")
        _record_target(ctx, el, path)
    elif isinstance(el, ActionCall):
        for k, v in el.inputs:
            _check_expr(ctx, v, f"{path}.inputs.{k}")
        _var(ctx, el.output_variable, f"{path}.output_variable")
        entry = _action(ctx, inputs, el, path)
        if entry is not None:
            pins[el.action_type] = entry
    elif isinstance(el, Subflow):
        for k, v in el.inputs:
            _check_expr(ctx, v, f"{path}.inputs.{k}")
        for parent_var, _child in el.outputs:
            _var(ctx, parent_var, f"{path}.outputs.{parent_var}")
    elif isinstance(el, Wait):
        _wait(ctx, inputs, el, path)


def check_subflow_interface(parent: FlowDef, el: Subflow, child: FlowDef, sink: IssueSink) -> None:
    """Check that a Subflow element's input/output mapping fits the child's variables."""
    path = f"elements[{el.api_name}]"
    if child.process_type is not ProcessType.AUTOLAUNCHED:
        sink.error(
            f"{path}.flow",
            "subflow.not_autolaunched",
            f"{child.api_name}@{child.version} is not autolaunched",
        )
    for name, _ in el.inputs:
        v = child.variable(name)
        if v is None or not v.input:
            sink.error(
                f"{path}.inputs.{name}",
                "subflow.unknown_input",
                f"{child.api_name} has no input variable {name!r}",
            )
    for parent_var, child_var in el.outputs:
        v = child.variable(child_var)
        if v is None or not v.output:
            sink.error(
                f"{path}.outputs.{parent_var}",
                "subflow.unknown_output",
                f"{child.api_name} has no output variable {child_var!r}",
            )
            continue
        pv = parent.variable(parent_var)
        if pv is not None and (pv.type, pv.collection, pv.object) != (
            v.type,
            v.collection,
            v.object,
        ):
            sink.error(
                f"{path}.outputs.{parent_var}",
                "variable.type_mismatch",
                f"{parent_var!r} and {child_var!r} differ in type",
            )


def resolve_flow(
    flow: FlowDef, inputs: CompilerInputs, sink: IssueSink
) -> dict[str, CapabilityEntryView]:
    """Resolve every reference of ``flow``; return the catalog entries it pins by action type."""
    ctx = _Ctx(flow, inputs.metadata_view, sink)
    if flow.element(flow.start) is None:
        sink.error(
            "flow.start", "graph.unknown_target", f"start element {flow.start!r} does not exist"
        )
    for v in flow.variables:
        if v.object is not None and inputs.metadata_view.object(v.object) is None:
            sink.error(
                f"flow.variables[{v.name}].object",
                "metadata.unknown_object",
                f"object {v.object!r} is not in the view",
            )
    trig = flow.trigger
    if trig is not None and _object(ctx, trig.object, "flow.trigger.object"):
        _check_expr(ctx, trig.entry_condition, "flow.trigger.entry_condition")
    pins: dict[str, CapabilityEntryView] = {}
    for el in flow.elements:
        _element(ctx, inputs, el, pins)
    return pins


def select_trigger_subscriptions(
    flow: FlowDef, view: MetadataViewInput, sink: IssueSink
) -> tuple[TriggerSubscription, ...]:
    """The trigger subscriptions of ``flow`` in the bound view (the V2 dispatch selection).

    A record-triggered Flow compiles only when the view publishes exactly the
    trigger the source declares; the selection is what ``TriggerBindingDigest``
    commits to.
    """
    subs = tuple(
        sorted(
            (
                s
                for s in view.trigger_subscriptions
                if s.flow_api_name == flow.api_name and s.flow_version == flow.version
            ),
            key=lambda s: (s.object, s.timing, s.dispatch_order, tuple(sorted(s.events))),
        )
    )
    trig = flow.trigger
    if flow.process_type is ProcessType.AUTOLAUNCHED:
        if subs:
            sink.error(
                "flow.trigger",
                "trigger.unexpected_subscription",
                "the view subscribes an autolaunched Flow to record events",
            )
        return subs
    if trig is None:
        return subs
    want = f"{trig.object} {trig.timing.value} {'/'.join(sorted(e.value for e in trig.events))}"
    got = [f"{s.object} {s.timing} {'/'.join(sorted(s.events))}" for s in subs]
    if not subs:
        sink.error(
            "flow.trigger",
            "trigger.not_subscribed",
            "the metadata view publishes no trigger subscription for "
            f"{flow.api_name}@{flow.version}",
        )
    elif got != [want]:
        sink.error(
            "flow.trigger",
            "trigger.subscription_mismatch",
            f"the view subscribes {flow.api_name}@{flow.version} to {'; '.join(got)}, "
            f"the source declares {want}",
        )
    return subs
