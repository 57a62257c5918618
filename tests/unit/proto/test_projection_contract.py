"""The §18.2 compatibility projection is stated once in code (the kernel) and twice in
prose (the proto enum comments, ``docs/api-contract.md``); all three agree (issue 10
item 8: ``CancelRequested`` was ``Running`` in the proto comment, ``Error`` in the kernel)."""

from __future__ import annotations

import re
from pathlib import Path

from runtime_svc.kernel.states import CompatibilityStatus, RunState
from runtime_svc.kernel.tables import compatibility_status

ROOT = Path(__file__).resolve().parents[3]


def _kernel() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {s.name: set() for s in CompatibilityStatus}
    for state in RunState:
        out[compatibility_status(state).name].add(state.name)
    return out


def _proto() -> dict[str, set[str]]:
    text = (ROOT / "protos/nexus/flow/common/v1/state.proto").read_text(encoding="utf-8")
    enum = text[text.index("enum CompatibilityStatus {") :]
    enum = enum[: enum.index("\n}")]
    out: dict[str, set[str]] = {}
    comment: list[str] = []
    for line in enum.splitlines()[1:]:
        line = line.strip()
        if line.startswith("//"):
            comment.append(line[2:].strip())
            continue
        match = re.match(r"COMPATIBILITY_STATUS_(\w+) = \d+;", line)
        if match and match.group(1) != "UNSPECIFIED":
            prose = " ".join(comment).split("(")[0]
            found = set(re.findall(r"\b[A-Z][A-Z_]+[A-Z]\b", prose.split("Projected from", 1)[1]))
            out[match.group(1)] = found
        comment = []
    return out


def _docs() -> dict[str, set[str]]:
    text = (ROOT / "docs/api-contract.md").read_text(encoding="utf-8")
    section = text[text.index("## Legacy compatibility projection") :]
    section = section[: section.find("\n## ", 3) if "\n## " in section[3:] else None]
    out: dict[str, set[str]] = {}
    for canonical, legacy in re.findall(r"^\| ([A-Za-z, ]+) \| (\w+) \|$", section, re.M):
        if canonical.strip() == "Canonical V2 state":
            continue
        states = {RunState.from_code(s.strip()).name for s in canonical.split(",")}
        out.setdefault(legacy.upper(), set()).update(states)
    return out


def test_proto_comments_state_the_kernel_projection() -> None:
    assert _proto() == _kernel()


def test_docs_table_states_the_kernel_projection() -> None:
    assert _docs() == _kernel()


def test_cancel_requested_reads_as_error() -> None:
    assert compatibility_status(RunState.CANCEL_REQUESTED) is CompatibilityStatus.ERROR
