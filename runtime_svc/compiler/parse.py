"""Parse a Flow document (JSON/YAML mapping) into :class:`~.language.FlowDef`.

Parsing is step 1 of §7.2: it checks the shape of the document, parses every
expression, and reports every problem into an :class:`~.diagnostics.IssueSink`
instead of stopping at the first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml

from services.json_limits import JsonLimitError, loads_bounded

from .diagnostics import IssueSink
from .expressions import KEYWORDS
from .language import (
    Element,
    FlowDef,
    ProcessType,
    Trigger,
    TriggerEvent,
    TriggerTiming,
    Variable,
    VarType,
)
from .parse_elements import parse_element
from .source_reader import FieldReader as _R

__all__ = ["TOP_LEVEL_KEYS", "FlowSourceError", "load_flow_text", "parse_flow"]

#: Keys a Flow document accepts at the top level (besides non-semantic ones).
TOP_LEVEL_KEYS = frozenset(
    {
        "api_name",
        "version",
        "process_type",
        "run_atomically",
        "trigger",
        "variables",
        "start",
        "elements",
    }
)


class FlowSourceError(ValueError):
    """The text is neither JSON nor YAML describing one mapping."""


def load_flow_text(text: str) -> dict[str, Any]:
    """Decode a Flow document written as JSON or YAML.

    Raises:
        FlowSourceError: undecodable text, or a top level that is not a mapping.
    """
    try:
        doc = loads_bounded(text)
    except JsonLimitError as exc:
        raise FlowSourceError(str(exc)) from None
    except json.JSONDecodeError:
        try:
            doc = yaml.safe_load(text)
        except RecursionError:
            raise FlowSourceError("the YAML document nests too deeply") from None
        except yaml.YAMLError as exc:
            raise FlowSourceError(f"not JSON or YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise FlowSourceError("a Flow document must be a mapping at the top level")
    return doc


def _variable(sink: IssueSink, v: Any, path: str) -> Variable | None:
    if not isinstance(v, Mapping):
        sink.error(path, "source.invalid_type", "a variable must be an object")
        return None
    keys = frozenset({"name", "type", "collection", "object", "input", "output", "max_items"})
    r = _R(sink, v, path, keys)
    name, vtype = r.text("name", ident=True), r.enum("type", VarType)
    collection = bool(r.flag("collection"))
    obj = r.text("object", required=False, ident=True)
    max_items = r.integer("max_items", minimum=1)
    if name is not None and name.lower() in KEYWORDS:
        r.err("name", "source.invalid_name", f"{name!r} is a reserved word")
        return None
    if vtype is VarType.RECORD and obj is None:
        r.err("object", "source.missing_field", "a record variable needs 'object'")
    if vtype is not None and vtype is not VarType.RECORD and obj is not None:
        r.err("object", "source.invalid_value", "only record variables have an 'object'")
    if max_items is not None and not collection:
        r.err(
            "max_items", "source.invalid_value", "'max_items' applies to collection variables only"
        )
    if name is None or vtype is None:
        return None
    return Variable(
        name, vtype, collection, obj, bool(r.flag("input")), bool(r.flag("output")), max_items
    )


def parse_flow(doc: Mapping[str, Any], sink: IssueSink) -> FlowDef | None:
    """Parse ``doc``; report problems into ``sink``; ``None`` when unusable."""
    r = _R(sink, doc, "flow", TOP_LEVEL_KEYS)
    api, version = r.text("api_name", ident=True), r.integer("version", required=True, minimum=1)
    ptype = r.enum("process_type", ProcessType)
    run_atomically = r.flag("run_atomically")
    start = r.text("start", ident=True)
    trigger = None
    tmap = r.mapping("trigger")
    if ptype is ProcessType.RECORD_TRIGGERED and tmap is None:
        r.err("trigger", "trigger.missing", "a record_triggered Flow needs a trigger")
    if ptype is ProcessType.AUTOLAUNCHED and tmap is not None:
        r.err("trigger", "trigger.unexpected", "an autolaunched Flow has no trigger")
    if tmap is not None and ptype is ProcessType.RECORD_TRIGGERED:
        tr = _R(
            sink, tmap, "flow.trigger", frozenset({"object", "timing", "events", "entry_condition"})
        )
        tobj, timing = tr.text("object", ident=True), tr.enum("timing", TriggerTiming)
        events: set[TriggerEvent] = set()
        for i, ev in enumerate(tr.seq("events", required=True)):
            try:
                events.add(TriggerEvent(ev))
            except ValueError:
                tr.err(
                    f"events[{i}]",
                    "source.invalid_value",
                    f"{ev!r} is not create, update or delete",
                )
        if not events:
            tr.err("events", "source.missing_field", "a trigger needs at least one event")
        if timing is TriggerTiming.BEFORE_SAVE and TriggerEvent.DELETE in events:
            tr.err(
                "events", "trigger.before_save_delete", "a before-save trigger cannot run on delete"
            )
        cond = tr.expr("entry_condition", required=False)
        if tobj is not None and timing is not None and events:
            trigger = Trigger(tobj, timing, tuple(sorted(events)), cond)
    variables: list[Variable] = []
    for i, v in enumerate(r.seq("variables")):
        var = _variable(sink, v, f"flow.variables[{i}]")
        if var is None:
            continue
        if any(x.name == var.name for x in variables):
            sink.error(
                f"flow.variables[{var.name}]",
                "source.duplicate_name",
                f"variable {var.name!r} is declared twice",
            )
            continue
        variables.append(var)
    elements: list[Element] = []
    for i, raw in enumerate(r.seq("elements", required=True)):
        el = parse_element(sink, raw, i)
        if el is None:
            continue
        if any(x.api_name == el.api_name for x in elements):
            sink.error(
                f"elements[{el.api_name}]",
                "source.duplicate_name",
                f"element {el.api_name!r} appears twice",
            )
            continue
        if variables and any(v.name == el.api_name for v in variables):
            sink.error(
                f"elements[{el.api_name}]",
                "source.duplicate_name",
                f"{el.api_name!r} names both a variable and an element",
            )
        elements.append(el)
    if api is None or version is None or ptype is None or start is None:
        return None
    return FlowDef(
        api_name=api,
        version=version,
        process_type=ptype,
        start=start,
        elements=tuple(sorted(elements, key=lambda e: e.api_name)),
        variables=tuple(sorted(variables, key=lambda v: v.name)),
        trigger=trigger,
        run_atomically=run_atomically,
    )
