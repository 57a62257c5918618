"""Parse one element of a Flow document into its :mod:`.language` value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .diagnostics import IssueSink
from .expressions import Ref
from .kinds import ExpiryPolicy
from .language import (
    IDENT_RE,
    ActionCall,
    AssignmentItem,
    AssignOp,
    CreateRecord,
    Decision,
    DecisionRule,
    DeleteRecord,
    Element,
    ElementType,
    End,
    EventWait,
    Fault,
    Filter,
    GetRecords,
    Loop,
    LoopBoundDecl,
    ReadMode,
    RecordWait,
    Subflow,
    TimeWait,
    UpdateRecord,
    Wait,
    parse_duration,
)
from .language import Assignment as AssignmentElement
from .source_reader import FieldReader as _R
from .source_reader import read_expr_map as _expr_map

__all__ = ["ELEMENT_KEYS", "parse_element"]

_FILTER_OPS = {
    "=": "=",
    "==": "=",
    "!=": "!=",
    "<>": "!=",
    "<": "<",
    "<=": "<=",
    ">": ">",
    ">=": ">=",
}
_FAULTABLE = frozenset(
    {
        ElementType.GET_RECORDS,
        ElementType.CREATE_RECORD,
        ElementType.UPDATE_RECORD,
        ElementType.DELETE_RECORD,
        ElementType.ACTION_CALL,
        ElementType.SUBFLOW,
        ElementType.WAIT,
    }
)
#: Type-specific keys each element accepts (besides ``api_name``, ``type`` and the
#: non-semantic ``label``/``description``/``location``).
ELEMENT_KEYS: dict[ElementType, frozenset[str]] = {
    ElementType.ASSIGNMENT: frozenset({"assignments", "next"}),
    ElementType.DECISION: frozenset({"rules", "next"}),
    ElementType.LOOP: frozenset({"collection", "item_variable", "each", "next", "bound"}),
    ElementType.GET_RECORDS: frozenset(
        {
            "object",
            "filters",
            "limit",
            "first_only",
            "output_variable",
            "read_mode",
            "next",
            "fault",
        }
    ),
    ElementType.CREATE_RECORD: frozenset(
        {"object", "fields", "from_variable", "output_variable", "next", "fault"}
    ),
    ElementType.UPDATE_RECORD: frozenset(
        {"object", "record", "filters", "limit", "fields", "next", "fault"}
    ),
    ElementType.DELETE_RECORD: frozenset({"object", "record", "filters", "limit", "next", "fault"}),
    ElementType.ACTION_CALL: frozenset(
        {"action_type", "inputs", "output_variable", "system_identity", "next", "fault"}
    ),
    ElementType.SUBFLOW: frozenset({"flow", "version", "inputs", "outputs", "next", "fault"}),
    ElementType.WAIT: frozenset({"wait", "deadline", "expiry_policy", "next", "fault"}),
    ElementType.FAULT: frozenset({"code", "message"}),
    ElementType.END: frozenset(),
}


def _filters(r: _R) -> tuple[Filter, ...]:
    out = []
    for i, f in enumerate(r.seq("filters")):
        if not isinstance(f, Mapping):
            r.err(f"filters[{i}]", "source.invalid_type", "a filter must be an object")
            continue
        fr = _R(r.sink, f, f"{r.path}.filters[{i}]", frozenset({"field", "op", "value"}))
        name = fr.text("field", ident=True)
        op = fr.text("op")
        if op is not None and op not in _FILTER_OPS:
            fr.err(
                "op",
                "source.invalid_value",
                f"{op!r} is not a filter operator ({', '.join(_FILTER_OPS)})",
            )
            op = None
        value = fr.expr("value")
        if name and op and value is not None:
            out.append(Filter(name, _FILTER_OPS[op], value))
    return tuple(out)


def _wait(r: _R, base: dict[str, Any]) -> Element | None:
    spec = r.mapping("wait", required=True)
    deadline = r.text("deadline")
    seconds = None
    if deadline is not None:
        seconds = parse_duration(deadline)
        if seconds is None or seconds == 0:
            r.err(
                "deadline",
                "source.invalid_value",
                f"{deadline!r} is not a positive ISO-8601 duration (W/D/H/M/S)",
            )
    policy = r.enum("expiry_policy", ExpiryPolicy)
    if spec is None:
        return None
    kind = spec.get("kind")
    w: TimeWait | EventWait | RecordWait | None = None
    if kind == "time":
        sr = _R(r.sink, spec, f"{r.path}.wait", frozenset({"kind", "duration", "until"}))
        duration, until = sr.text("duration", required=False), sr.expr("until", required=False)
        dsec = None
        if duration is not None:
            dsec = parse_duration(duration)
            if dsec is None or dsec == 0:
                sr.err(
                    "duration",
                    "source.invalid_value",
                    f"{duration!r} is not a positive ISO-8601 duration",
                )
        if (duration is None) == (until is None):
            sr.err("", "wait.time_spec", "a time wait needs exactly one of 'duration' and 'until'")
        elif dsec is not None and seconds is not None and dsec > seconds:
            r.err(
                "deadline",
                "wait.deadline_before_resume",
                f"deadline {deadline} is shorter than duration {duration}",
            )
        w = TimeWait(duration, dsec, until)
    elif kind == "event":
        sr = _R(
            r.sink, spec, f"{r.path}.wait", frozenset({"kind", "producer_kind", "key", "condition"})
        )
        producer = sr.text("producer_kind")
        key, cond = sr.expr("key"), sr.expr("condition", required=False)
        if producer is not None and key is not None:
            w = EventWait(producer, key, cond)
    elif kind == "record":
        sr = _R(
            r.sink, spec, f"{r.path}.wait", frozenset({"kind", "object", "record_id", "condition"})
        )
        obj = sr.text("object", ident=True)
        rid, cond = sr.expr("record_id"), sr.expr("condition")
        if obj is not None and rid is not None and cond is not None:
            w = RecordWait(obj, rid, cond)
    else:
        r.err("wait.kind", "source.invalid_value", "wait.kind must be 'time', 'event' or 'record'")
    if w is None or deadline is None or not seconds or policy is None:
        return None
    return Wait(**base, wait=w, deadline=deadline, deadline_seconds=seconds, expiry_policy=policy)


def parse_element(sink: IssueSink, raw: Any, index: int) -> Element | None:
    if not isinstance(raw, Mapping):
        sink.error(f"elements[{index}]", "source.invalid_type", "an element must be an object")
        return None
    name = raw.get("api_name")
    path = (
        f"elements[{name}]"
        if isinstance(name, str) and IDENT_RE.match(name)
        else f"elements[{index}]"
    )
    etype_raw = raw.get("type")
    try:
        etype = ElementType(str(etype_raw))
    except ValueError:
        allowed = ", ".join(t.value for t in ElementType)
        sink.error(
            f"{path}.type",
            "source.invalid_value",
            f"element type {etype_raw!r} is not one of: {allowed}",
        )
        return None
    r = _R(sink, raw, path, frozenset({"api_name", "type"}) | ELEMENT_KEYS[etype])
    api = r.text("api_name", ident=True)
    base: dict[str, Any] = {
        "api_name": api,
        "next": r.text("next", required=False, ident=True),
        "fault": r.text("fault", required=False, ident=True) if etype in _FAULTABLE else None,
    }
    out: Element | None = None
    if etype is ElementType.ASSIGNMENT:
        items = []
        for i, a in enumerate(r.seq("assignments", required=True)):
            if not isinstance(a, Mapping):
                r.err(f"assignments[{i}]", "source.invalid_type", "an assignment must be an object")
                continue
            ar = _R(sink, a, f"{path}.assignments[{i}]", frozenset({"target", "op", "value"}))
            target = ar.expr("target")
            if target is not None and not isinstance(target, Ref):
                ar.err(
                    "target",
                    "assignment.invalid_target",
                    "the target must be a variable or a field reference",
                )
            op = ar.enum("op", AssignOp, required=False) if ar.has("op") else AssignOp.SET
            value = ar.expr("value")
            if isinstance(target, Ref) and op is not None and value is not None:
                items.append(AssignmentItem(target, op, value))
        if not r.seq("assignments"):
            r.err(
                "assignments", "source.missing_field", "an Assignment needs at least one assignment"
            )
        out = AssignmentElement(**base, items=tuple(items))
    elif etype is ElementType.DECISION:
        rules: list[DecisionRule] = []
        for i, rule in enumerate(r.seq("rules", required=True)):
            if not isinstance(rule, Mapping):
                r.err(f"rules[{i}]", "source.invalid_type", "a rule must be an object")
                continue
            rr = _R(sink, rule, f"{path}.rules[{i}]", frozenset({"name", "condition", "next"}))
            rname, cond = rr.text("name", ident=True), rr.expr("condition")
            if rname is not None and any(x.name == rname for x in rules):
                rr.err("name", "source.duplicate_name", f"rule {rname!r} appears twice")
            elif rname is not None and cond is not None:
                rules.append(DecisionRule(rname, cond, rr.text("next", required=False, ident=True)))
        if not r.seq("rules"):
            r.err("rules", "source.missing_field", "a Decision needs at least one rule")
        out = Decision(**base, rules=tuple(rules))
    elif etype is ElementType.LOOP:
        bound = None
        bmap = r.mapping("bound")
        if bmap is not None:
            br = _R(sink, bmap, f"{path}.bound", frozenset({"max", "relationship"}))
            bmax, brel = br.integer("max", minimum=1), br.text("relationship", required=False)
            if (bmax is None) == (brel is None):
                br.err(
                    "",
                    "loop.bound_spec",
                    "a loop bound needs exactly one of 'max' and 'relationship'",
                )
            bound = LoopBoundDecl(bmax, brel)
        coll, item = r.text("collection", ident=True), r.text("item_variable", ident=True)
        if coll is not None and item is not None:
            out = Loop(
                **base,
                collection=coll,
                item_variable=item,
                each=r.text("each", ident=True),
                bound=bound,
            )
    elif etype in (ElementType.GET_RECORDS, ElementType.UPDATE_RECORD, ElementType.DELETE_RECORD):
        obj = r.text("object", ident=True)
        filters, limit = _filters(r), r.integer("limit", minimum=1)
        if etype is ElementType.GET_RECORDS:
            mode = (
                r.enum("read_mode", ReadMode, required=False)
                if r.has("read_mode")
                else ReadMode.SNAPSHOT
            )
            if obj is not None and mode is not None:
                out = GetRecords(
                    **base,
                    object=obj,
                    filters=filters,
                    limit=limit,
                    first_only=bool(r.flag("first_only")),
                    output_variable=r.text("output_variable", required=False, ident=True),
                    read_mode=mode,
                )
        else:
            record = r.text("record", required=False)
            if record is not None and record != "$Record" and not IDENT_RE.match(record):
                r.err(
                    "record", "source.invalid_name", "'record' must be '$Record' or a variable name"
                )
            if (record is None) == (not filters):
                r.err("record", "record.target_spec", "give exactly one of 'record' and 'filters'")
            if record is not None and limit is not None:
                r.err(
                    "limit",
                    "source.invalid_value",
                    "'limit' applies to filter-selected records only",
                )
            if etype is ElementType.UPDATE_RECORD:
                fields = _expr_map(sink, f"{path}.fields", r.mapping("fields", required=True))
                if not fields:
                    r.err(
                        "fields", "source.missing_field", "an UpdateRecord needs at least one field"
                    )
                if obj is not None:
                    out = UpdateRecord(
                        **base,
                        object=obj,
                        record=record,
                        filters=filters,
                        limit=limit,
                        fields=fields,
                    )
            elif obj is not None:
                out = DeleteRecord(**base, object=obj, record=record, filters=filters, limit=limit)
    elif etype is ElementType.CREATE_RECORD:
        obj = r.text("object", ident=True)
        fields = _expr_map(sink, f"{path}.fields", r.mapping("fields"))
        from_var = r.text("from_variable", required=False, ident=True)
        if (not fields) == (from_var is None):
            r.err(
                "fields", "record.create_spec", "give exactly one of 'fields' and 'from_variable'"
            )
        if obj is not None:
            out = CreateRecord(
                **base,
                object=obj,
                fields=fields,
                from_variable=from_var,
                output_variable=r.text("output_variable", required=False, ident=True),
            )
    elif etype is ElementType.ACTION_CALL:
        action = r.text("action_type")
        inputs = _expr_map(sink, f"{path}.inputs", r.mapping("inputs"))
        if action is not None:
            out = ActionCall(
                **base,
                action_type=action,
                inputs=inputs,
                output_variable=r.text("output_variable", required=False, ident=True),
                system_identity=r.text("system_identity", required=False),
            )
    elif etype is ElementType.SUBFLOW:
        flow, version = r.text("flow", ident=True), r.integer("version", required=True, minimum=1)
        inputs = _expr_map(sink, f"{path}.inputs", r.mapping("inputs"))
        outputs: list[tuple[str, str]] = []
        for k, v in sorted((r.mapping("outputs") or {}).items()):
            if not (
                isinstance(k, str)
                and IDENT_RE.match(k)
                and isinstance(v, str)
                and IDENT_RE.match(v)
            ):
                r.err(
                    f"outputs.{k}",
                    "source.invalid_name",
                    "outputs map parent variable names to child variable names",
                )
                continue
            outputs.append((k, v))
        if flow is not None and version is not None:
            out = Subflow(**base, flow=flow, version=version, inputs=inputs, outputs=tuple(outputs))
    elif etype is ElementType.WAIT:
        out = _wait(r, base)
    elif etype is ElementType.FAULT:
        code = r.text("code")
        msg = r.text("message", required=False) or ""
        if code is not None:
            out = Fault(**base, code=code, message=msg)
    else:
        out = End(**base)
    return out if api is not None else None
