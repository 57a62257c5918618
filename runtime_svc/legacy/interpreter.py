"""The legacy element-walking interpreter: the reference semantics of the Flow language.

It walks the parsed Flow elements (:class:`~runtime_svc.compiler.language.FlowDef`)
directly — no compiled plan — from the interview's position until the interview pauses
(a Wait, a wait-class action), finishes or fails. That walk is one *segment*. This is the
execution model adopters come from (§20 "element-walking interpreter"); the runtime keeps
it as the ``LegacyInterpreter`` owner of epoch 0 and as the differential oracle of the
compiler (:mod:`runtime_svc.migration.shadow`).

It shares the Flow parser and the expression evaluator with the compiler and nothing
else: element semantics are implemented here, independently of
``runtime_svc.worker.executor``, so a comparison of the two is a real differential
test. Everything the walk touches outside the interview state goes through
:class:`LegacyPorts` — the live ports (``runtime_svc.legacy.service``) read and write
business records through the record engine inside the segment's transaction; the shadow
ports (``runtime_svc.migration.shadow``) serve fixtures and write nothing.

Semantics (``docs/flow-language.md`` §4-§5): declared variables start ``null``
(collections ``[]``); a missing ``next`` ends the frame; a record or action fault follows
the element's ``fault`` connector, else the calling Subflow element's, else fails the
run; an expression error, an explicit ``Fault`` and an unsupported element/action fail
the run; a Subflow pushes a frame whose element paths carry the ``<call>/`` prefix.

Pure apart from the awaited ports.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from runtime_svc.compiler import ExpressionEvalError, FlowDef, evaluate, parse_expression
from runtime_svc.compiler.expressions import Expr, ExpressionError, Ref
from runtime_svc.compiler.kinds import RECORD_CHANGE_PRODUCER
from runtime_svc.compiler.language import (
    ActionCall,
    Assignment,
    AssignOp,
    CreateRecord,
    Decision,
    DeleteRecord,
    Element,
    End,
    Fault,
    GetRecords,
    Loop,
    RecordWait,
    Subflow,
    TimeWait,
    UpdateRecord,
    Wait,
)
from runtime_svc.legacy.state import Frame, LegacyState, WaitKind, WaitSpec
from runtime_svc.legacy.values import (
    ActionDone,
    ActionFailed,
    ActionOutcome,
    ActionPauses,
    Due,
    EffectCall,
    EventArrived,
    Failed,
    Finished,
    LegacyFault,
    LegacyPorts,
    Paused,
    RecordWrite,
    Resume,
    Segment,
    SegmentStatus,
    StillWaiting,
)
from services.invariants import InvariantError

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "TRIGGER",
    "ActionDone",
    "ActionFailed",
    "ActionOutcome",
    "ActionPauses",
    "Due",
    "EffectCall",
    "EventArrived",
    "Failed",
    "Finished",
    "LegacyFault",
    "LegacyPorts",
    "Paused",
    "RecordWrite",
    "Resume",
    "Segment",
    "SegmentStatus",
    "StillWaiting",
    "initial_variables",
    "run_segment",
]

#: Bound on element executions of one segment (a malformed Flow cannot spin forever).
DEFAULT_MAX_ELEMENTS = 100_000
#: The trigger record variable of a record-triggered Flow.
TRIGGER = "$Record"
_MAX_LOOP_ITEMS = 10_000


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Expr:
    return parse_expression(text)


def _eval(expr: Expr | str | None, env: Mapping[str, Any]) -> Any:
    if expr is None:
        return None
    try:
        return evaluate(_parsed(expr) if isinstance(expr, str) else expr, env)
    except (ExpressionError, ExpressionEvalError) as exc:
        raise LegacyFault("expression_error", str(exc)) from exc


def _exact(value: Any) -> Any:
    """JSON numbers as the evaluator's exact numbers: an integral float (a protobuf
    ``Struct`` number) is an ``int``, any other float the decimal it prints as."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else Decimal(repr(value))
    if isinstance(value, Mapping):
        return {k: _exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exact(v) for v in value]
    return value


def initial_variables(flow: FlowDef, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` (numbers made exact) plus every declared variable it lacks (``null``,
    collections ``[]``)."""
    out = {k: _exact(v) for k, v in given.items()}
    for var in flow.variables:
        out.setdefault(var.name, [] if var.collection else None)
    return out


def _record_id(value: Any, what: str) -> str:
    rid = value.get("Id") if isinstance(value, Mapping) else value
    if not isinstance(rid, str) or not rid:
        raise LegacyFault("missing_record_id", f"{what} has no record id")
    return rid


def _assign(env: dict[str, Any], target: Ref, value: Any) -> None:
    if not target.path:
        env[target.root] = value
        return
    holder = env.get(target.root)
    if holder is None:
        holder = env[target.root] = {}
    if not isinstance(holder, dict) or len(target.path) != 1:
        raise LegacyFault("assignment_target_invalid", f"cannot assign {target.dotted()}")
    holder[target.path[0]] = value


def _current(env: Mapping[str, Any], target: Ref) -> Any:
    holder = env.get(target.root)
    if not target.path:
        return holder
    return holder.get(target.path[0]) if isinstance(holder, Mapping) else None


def _as_time(value: Any) -> datetime:
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise LegacyFault("wait_time_invalid", f"{value!r} is not a time") from None
    else:
        raise LegacyFault("wait_time_invalid", "a time wait needs a date-time")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class _Walk:
    """One segment's mutable walk (see :func:`run_segment`)."""

    def __init__(
        self, root: FlowDef, state: LegacyState, ports: LegacyPorts, now: datetime, transform: bool
    ) -> None:
        self.root = root
        self.state = state
        self.ports = ports
        self.now = now
        self.transform = transform
        self.trace: list[str] = []
        self.writes: list[RecordWrite] = []
        self.effects: list[EffectCall] = []

    # --- frames -----------------------------------------------------------------------

    def flow_of(self, frame: Frame) -> FlowDef:
        if len(self.state.frames) and frame is self.state.frames[0]:
            return self.root
        flow = self.ports.subflow(frame.flow, frame.version)
        if flow is None:
            raise LegacyFault("subflow_missing", f"{frame.flow}@{frame.version}")
        return flow

    def element(self, frame: Frame, name: str) -> Element:
        el = self.flow_of(frame).element(name)
        if el is None:
            raise LegacyFault("element_missing", f"{frame.prefix}{name}")
        return el

    def end_frame(self) -> Finished | None:
        """The top frame reached its end: finish the run, or return to the caller."""
        state = self.state
        if len(state.frames) == 1:
            declared = [v.name for v in self.root.variables if v.output]
            outputs = {n: state.top.variables.get(n) for n in declared}
            state.output = outputs
            return Finished(outputs)
        child = state.frames.pop()
        parent = state.top
        call = self.element(parent, str(child.call_element))
        if not isinstance(call, Subflow):
            raise InvariantError("broken invariant: isinstance(call, Subflow)")
        for parent_var, child_var in call.outputs:
            parent.variables[parent_var] = copy.deepcopy(child.variables.get(child_var))
        state.position = call.next
        return None

    def route_fault(self, fault: LegacyFault, element: Element) -> Failed | None:
        """Follow the fault connector of ``element``, else of the calling Subflow elements."""
        if not fault.routable:
            return Failed(fault.code, self.state.path)
        if element.fault is not None:
            self.state.position = element.fault
            return None
        path = self.state.path
        while len(self.state.frames) > 1:
            child = self.state.frames.pop()
            call = self.element(self.state.top, str(child.call_element))
            if call.fault is not None:
                self.state.position = call.fault
                return None
        return Failed(fault.code, path)

    # --- the walk ---------------------------------------------------------------------

    async def run(self, max_elements: int) -> Finished | Paused | Failed:
        state = self.state
        while True:
            if state.position is None:
                finished = self.end_frame()
                if finished is not None:
                    return finished
                continue
            frame = state.top
            try:
                element = self.element(frame, state.position)
            except LegacyFault as exc:
                return Failed(exc.code, state.path)
            if len(self.trace) >= max_elements:
                return Failed("element_limit_exceeded", state.path)
            path = frame.prefix + element.api_name
            self.trace.append(path)
            state.elements_executed += 1
            try:
                paused = await self.execute(frame, element, path)
            except LegacyFault as exc:
                failed = self.route_fault(exc, element)
                if failed is not None:
                    return failed
                continue
            if paused is not None:
                return paused

    async def execute(self, frame: Frame, el: Element, path: str) -> Paused | None:
        """Run one element; move :attr:`LegacyState.position`; a Paused stops the walk."""
        env = frame.variables
        nxt: str | None = el.next
        if isinstance(el, Assignment):
            for item in el.items:
                self.assign(env, item.target, item.op, _eval(item.value, env))
        elif isinstance(el, Decision):
            for rule in el.rules:
                if _eval(rule.condition, env) is True:
                    nxt = rule.next
                    break
        elif isinstance(el, Loop):
            nxt = self.loop(frame, el)
        elif isinstance(el, GetRecords):
            await self.get_records(env, el)
        elif isinstance(el, CreateRecord):
            await self.create(env, el, path)
        elif isinstance(el, UpdateRecord | DeleteRecord):
            await self.update_or_delete(env, el, path)
        elif isinstance(el, ActionCall):
            return await self.action(env, el, path)
        elif isinstance(el, Subflow):
            self.call(frame, el)
            return None
        elif isinstance(el, Wait):
            return Paused(self.pause_wait(env, el, path))
        elif isinstance(el, Fault):
            raise LegacyFault(el.code, el.message)
        elif isinstance(el, End):
            nxt = None
        else:
            raise LegacyFault("unsupported_element", f"element type {el.type.value}")
        self.state.position = nxt
        return None

    def assign(self, env: dict[str, Any], target: Ref, op: AssignOp, value: Any) -> None:
        if op is AssignOp.SET:
            _assign(env, target, value)
            return
        current = _current(env, target)
        if op is AssignOp.ADD_ITEM or (op is AssignOp.ADD and isinstance(current, list)):
            base = [] if current is None else current
            if not isinstance(base, list):
                raise LegacyFault("assignment_target_invalid", f"{target.dotted()} is no list")
            _assign(env, target, [*base, value])
            return
        symbol = "+" if op is AssignOp.ADD else "-"
        _assign(env, target, _eval(f"a {symbol} b", {"a": current or 0, "b": value}))

    def loop(self, frame: Frame, el: Loop) -> str | None:
        loops = frame.loops
        if el.api_name not in loops:
            items = _eval(el.collection, frame.variables)
            items = [] if items is None else items
            if not isinstance(items, list):
                raise LegacyFault("loop_collection_invalid", f"{el.api_name}: not a collection")
            if len(items) > _MAX_LOOP_ITEMS:
                raise LegacyFault("loop_bound_exceeded", el.api_name)
            loops[el.api_name] = copy.deepcopy(items)
        remaining = loops[el.api_name]
        if remaining and el.each is not None:
            frame.variables[el.item_variable] = remaining.pop(0)
            return el.each
        del loops[el.api_name]
        return el.next

    async def get_records(self, env: dict[str, Any], el: GetRecords) -> None:
        if len(el.filters) != 1 or el.filters[0].op not in ("=", "=="):
            raise LegacyFault("unsupported_element", "GetRecords supports one '=' filter")
        flt = el.filters[0]
        found: list[dict[str, Any]]
        if flt.field == "Id":
            one = await self.ports.read_record(
                el.object, _record_id(_eval(flt.value, env), "GetRecords filter")
            )
            found = [] if one is None else [one]
        else:
            value = _eval(flt.value, env)
            if not isinstance(value, str) or not value:
                found = []
            else:
                limit = 1 if el.first_only else (el.limit or _MAX_LOOP_ITEMS)
                found = await self.ports.query_records(el.object, flt.field, value, limit)
        if el.output_variable:
            env[el.output_variable] = (found[0] if found else None) if el.first_only else found

    async def create(self, env: dict[str, Any], el: CreateRecord, path: str) -> None:
        rid = self.ports.new_record_id()
        values = {k: _eval(v, env) for k, v in el.fields}
        write = RecordWrite("create", el.object, rid, values, path)
        await self.ports.write_record(write)
        self.writes.append(write)
        if el.output_variable:
            env[el.output_variable] = {"Id": rid, **values}

    async def update_or_delete(
        self, env: dict[str, Any], el: UpdateRecord | DeleteRecord, path: str
    ) -> None:
        kind = "update" if isinstance(el, UpdateRecord) else "delete"
        if not el.record:
            raise LegacyFault("unsupported_element", f"{el.type.value} without a record variable")
        fields = {k: _eval(v, env) for k, v in el.fields} if isinstance(el, UpdateRecord) else {}
        if self.transform and kind == "update" and el.record.strip() == TRIGGER:
            holder = env.get(TRIGGER)
            if not isinstance(holder, dict):
                raise LegacyFault("trigger_record_missing", "no $Record to transform")
            holder.update(fields)
            return
        target = _eval(el.record, env)
        items = list(target) if isinstance(target, list | tuple) else [target]
        rids = list(dict.fromkeys(_record_id(i, el.record) for i in items))
        for rid in rids:
            write = RecordWrite(kind, el.object, rid, fields, path)
            await self.ports.write_record(write)
            self.writes.append(write)

    async def action(self, env: dict[str, Any], el: ActionCall, path: str) -> Paused | None:
        inputs = {k: _eval(v, env) for k, v in el.inputs}
        outcome = await self.ports.call_action(path, el.action_type, inputs)
        if isinstance(outcome, ActionPauses):
            wait = WaitSpec(
                element=path,
                kind=WaitKind.ACTION,
                deadline_at=None,
                expiry_policy="quarantine",
                producer_kind=outcome.producer_kind,
                key=path,
            )
            self.state.wait = wait
            return Paused(wait)
        if outcome.effect:
            self.effects.append(EffectCall(path, el.action_type, inputs))
        if isinstance(outcome, ActionFailed):
            raise LegacyFault(outcome.code, routable=True)
        if el.output_variable:
            env[el.output_variable] = outcome.value
        self.state.position = el.next
        return None

    def call(self, frame: Frame, el: Subflow) -> None:
        child_def = self.ports.subflow(el.flow, el.version)
        if child_def is None:
            raise LegacyFault("subflow_missing", f"{el.flow}@{el.version}")
        given = {name: _eval(expr, frame.variables) for name, expr in el.inputs}
        child = Frame(
            flow=el.flow,
            version=el.version,
            prefix=f"{frame.prefix}{el.api_name}/",
            variables=initial_variables(child_def, given),
            call_element=el.api_name,
        )
        self.state.frames.append(child)
        self.state.position = child_def.start

    def pause_wait(self, env: Mapping[str, Any], el: Wait, path: str) -> WaitSpec:
        deadline = self.now + timedelta(seconds=el.deadline_seconds)
        spec = el.wait
        if isinstance(spec, TimeWait):
            if spec.duration_seconds is not None:
                resume_at = self.now + timedelta(seconds=spec.duration_seconds)
            else:
                resume_at = _as_time(_eval(spec.until, env))
            wait = WaitSpec(
                path, WaitKind.TIME, deadline, el.expiry_policy.value, resume_at=resume_at
            )
        elif isinstance(spec, RecordWait):
            # A record-condition wait is an event wait on the record's changes: resumed by
            # a change whose fields (``$Event``) satisfy the condition.
            record_id = _eval(spec.record_id, env)
            wait = WaitSpec(
                path,
                WaitKind.EVENT,
                deadline,
                el.expiry_policy.value,
                producer_kind=RECORD_CHANGE_PRODUCER,
                key=f"{spec.object}/{record_id}",
            )
        else:
            key = _eval(spec.key, env)
            wait = WaitSpec(
                path,
                WaitKind.EVENT,
                deadline,
                el.expiry_policy.value,
                producer_kind=spec.producer_kind,
                key=None if key is None else str(key),
            )
        self.state.wait = wait
        return wait

    # --- resume -----------------------------------------------------------------------

    def resume(self, signal: Resume) -> Failed | StillWaiting | None:
        """Release the current wait (``None``: continue walking). Once the wait's terminal
        deadline has passed its expiry policy applies, whatever the signal."""
        state = self.state
        wait = state.wait
        if wait is None:
            raise InvariantError("broken invariant: wait is not None")
        frame = state.top
        element = self.element(frame, str(state.position))
        expired = wait.deadline_at is not None and self.now >= wait.deadline_at
        if not expired:
            return self.release_for(signal, wait, frame, element)
        state.wait = None
        if wait.expiry_policy == "fault_path" and element.fault is not None:
            state.position = element.fault
            return None
        return Failed("wait_expired", wait.element, quarantined=wait.expiry_policy == "quarantine")

    def release_for(
        self, signal: Resume, wait: WaitSpec, frame: Frame, element: Element
    ) -> StillWaiting | None:
        """Release a wait whose terminal bound has not passed (``None``: released).

        An event/action wait needs its evidence (and the event condition); a time wait
        is released by the due claim at or after its resume time. Anything else leaves
        the interview waiting unchanged.
        """
        if isinstance(signal, EventArrived):
            if wait.kind is WaitKind.ACTION and isinstance(element, ActionCall):
                if element.output_variable:
                    frame.variables[element.output_variable] = signal.evidence.get("result")
                self.release(element.next)
                return None
            if wait.kind is WaitKind.EVENT and isinstance(element, Wait):
                spec = element.wait
                if isinstance(spec, TimeWait):
                    return StillWaiting(wait)
                env = {**frame.variables, "$Event": dict(signal.evidence)}
                if spec.condition is None or _eval(spec.condition, env) is True:
                    self.release(element.next)
                    return None
            return StillWaiting(wait)
        due = wait.resume_at is not None and self.now >= wait.resume_at
        if wait.kind is WaitKind.TIME and due:
            self.release(element.next)
            return None
        return StillWaiting(wait)

    def release(self, nxt: str | None) -> None:
        self.state.wait = None
        self.state.position = nxt


async def run_segment(
    root: FlowDef,
    state: LegacyState,
    ports: LegacyPorts,
    *,
    now: datetime,
    resume: Resume | None = None,
    transform: bool = False,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> Segment:
    """Walk ``state`` (a deep copy; the argument is not changed) until it pauses, finishes
    or fails. A paused interview needs a ``resume`` signal first.

    ``transform`` (the before-save profile) turns an UpdateRecord of ``$Record`` into an
    in-place change of the trigger record variable instead of a write.
    """
    walk = _Walk(root, copy.deepcopy(state), ports, now, transform)
    status: SegmentStatus
    if walk.state.wait is not None:
        if resume is None:
            status = StillWaiting(walk.state.wait)
            return Segment(status, walk.state, (), (), ())
        try:
            released = walk.resume(resume)
        except LegacyFault as exc:
            released = Failed(exc.code, walk.state.path)
        if released is not None:
            if isinstance(released, Failed):
                walk.state.fault = {"code": released.code, "element": released.element}
            return Segment(released, walk.state, (), (), ())
    status = await walk.run(max_elements)
    if isinstance(status, Failed):
        walk.state.fault = {"code": status.code, "element": status.element}
    walk.state.trace = [*walk.state.trace, *walk.trace][-1000:]
    return Segment(status, walk.state, tuple(walk.trace), tuple(walk.writes), tuple(walk.effects))
