"""Flow source validation for registration: the adapter onto the compiler's parser.

Registration stores a Flow version only when the compiler's step 1 (parse and
normalize, §7.2) accepts it, so a stored version always has a metadata digest and the
parsed fields :class:`FlowSourceInfo` exposes. The parser itself belongs to the compiler
(``runtime_svc.compiler``); this module is the one place that reaches past the
compiler's package exports (``parse_flow`` and ``IssueSink``), so a rename there is a
one-line change here.

Pure: no I/O, no generated protos, no SQL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime_svc.compiler import CompileIssue
from runtime_svc.compiler.diagnostics import IssueSink
from runtime_svc.compiler.parse import parse_flow
from services.errors import InvalidArgumentError
from services.json_limits import MAX_JSON_DEPTH, JsonLimitError, loads_bounded

__all__ = [
    "FlowSourceInfo",
    "FlowSourceInvalidError",
    "SubflowRef",
    "parse_source_json",
    "subflow_refs",
]

#: Upper bound on issues quoted in one error message (all are in the attributes count).
_MAX_QUOTED_ISSUES = 20


@dataclass(frozen=True, order=True)
class SubflowRef:
    """A Flow version a Subflow element calls."""

    api_name: str
    version: int


@dataclass(frozen=True)
class FlowSourceInfo:
    """What registration derives from a valid Flow source.

    Attributes:
        document: the decoded JSON document (the compiler's input).
        normalized: the compiler's canonical normalized metadata (``FlowDef.to_dict``).
        metadata_digest: ``MetadataDigest`` of the normalized metadata (§7.4); the
            registration dedupe key together with API name and version.
        label: the source's ``label``, if any.
    """

    document: Mapping[str, Any]
    normalized: Mapping[str, Any]
    metadata_digest: str
    label: str | None

    @property
    def api_name(self) -> str:
        """Flow API name."""
        return str(self.normalized["api_name"])

    @property
    def version(self) -> int:
        """Version number declared by the source."""
        return int(self.normalized["version"])

    @property
    def process_type(self) -> str:
        """``record_triggered`` or ``autolaunched``."""
        return str(self.normalized["process_type"])

    @property
    def run_atomically(self) -> bool:
        """The legacy ``RunAtomically`` request (§9.2)."""
        return bool(self.normalized.get("run_atomically"))

    @property
    def trigger(self) -> Mapping[str, Any] | None:
        """Normalized trigger (``object``, ``timing``, ``events``, ``entry_condition``)."""
        trig = self.normalized.get("trigger")
        return trig if isinstance(trig, Mapping) else None

    @property
    def variables(self) -> tuple[Mapping[str, Any], ...]:
        """Normalized variables, sorted by name."""
        return tuple(self.normalized.get("variables") or ())

    @property
    def elements(self) -> tuple[Mapping[str, Any], ...]:
        """Normalized elements, sorted by API name."""
        return tuple(self.normalized.get("elements") or ())

    @property
    def action_types(self) -> tuple[str, ...]:
        """Action types referenced by ActionCall elements, sorted, unique."""
        return tuple(
            sorted({str(e["action_type"]) for e in self.elements if e.get("type") == "ActionCall"})
        )

    @property
    def subflows(self) -> tuple[SubflowRef, ...]:
        """Flow versions referenced directly by Subflow elements, sorted, unique."""
        return subflow_refs(self.normalized)


def subflow_refs(document: Mapping[str, Any]) -> tuple[SubflowRef, ...]:
    """Subflow targets of a Flow document (raw or normalized), sorted and unique.

    Works on unvalidated documents too (malformed entries are skipped): the compiler,
    not this scan, reports them.
    """
    refs: set[SubflowRef] = set()
    elements = document.get("elements")
    if not isinstance(elements, list | tuple):
        return ()
    for el in elements:
        if not isinstance(el, Mapping) or el.get("type") != "Subflow":
            continue
        flow, version = el.get("flow"), el.get("version")
        if isinstance(flow, str) and isinstance(version, int) and not isinstance(version, bool):
            refs.add(SubflowRef(flow, version))
    return tuple(sorted(refs))


class FlowSourceInvalidError(InvalidArgumentError):
    """The Flow source is not valid JSON or fails the compiler's parse step.

    ``field_path`` is ``source_json`` followed by the first issue's path in the source
    (``source_json:elements[notify].next``); ``issues`` holds every issue.
    """

    reason = "flow_source_invalid"

    def __init__(self, issues: tuple[CompileIssue, ...], *, field: str = "source_json") -> None:
        self.issues = issues
        quoted = [f"{i.path}: [{i.code}] {i.message}" for i in issues[:_MAX_QUOTED_ISSUES]]
        more = len(issues) - len(quoted)
        if more > 0:
            quoted.append(f"… and {more} more")
        first = issues[0].path if issues else ""
        super().__init__(
            f"invalid Flow source ({len(issues)} issue(s)):\n" + "\n".join(quoted),
            field_path=f"{field}:{first}" if first else field,
            attributes={
                "issue_count": str(len(issues)),
                "codes": ",".join(sorted({i.code for i in issues})),
                "first_path": first,
            },
        )


def _decode(text: str) -> Mapping[str, Any]:
    try:
        doc = loads_bounded(text)
    except JsonLimitError:
        raise FlowSourceInvalidError(
            (
                CompileIssue(
                    "flow",
                    "source.too_deep",
                    f"the document nests deeper than {MAX_JSON_DEPTH} levels",
                ),
            )
        ) from None
    except json.JSONDecodeError as exc:
        raise FlowSourceInvalidError(
            (
                CompileIssue(
                    f"line {exc.lineno} column {exc.colno}",
                    "source.not_json",
                    f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                ),
            )
        ) from None
    if not isinstance(doc, dict):
        raise FlowSourceInvalidError(
            (CompileIssue("flow", "source.not_object", "a Flow document must be a JSON object"),)
        )
    return doc


def parse_source_json(text: str) -> FlowSourceInfo:
    """Decode and validate one Flow source given as JSON text.

    Raises:
        FlowSourceInvalidError: undecodable JSON, or every issue the compiler's parse
            step found (paths name the exact location in the source).
    """
    document = _decode(text)
    sink = IssueSink()
    flow = parse_flow(document, sink)
    if sink.has_errors or flow is None:
        issues = sink.issues or (
            CompileIssue("flow", "source.invalid", "the Flow document is unusable"),
        )
        raise FlowSourceInvalidError(tuple(issues))
    label = document.get("label")
    return FlowSourceInfo(
        document=document,
        normalized=flow.to_dict(),
        metadata_digest=flow.metadata_digest(),
        label=label if isinstance(label, str) and label else None,
    )
