"""flowctl's pure output helpers: tables, field parsing, the timeline page."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from flowctl.common import UsageError
from flowctl.output import duration_text, enum_text, table
from flowctl.records import parse_fields
from flowctl.timeline import mermaid_source, render_html
from services.proto import common_v1


def test_table_aligns_columns_and_says_none_when_empty() -> None:
    assert table(("a", "bee"), []) == "(none)\n"
    text = table(("run id", "state"), [("r-1", "succeeded"), ("r-22", None)])
    assert text.splitlines() == ["RUN ID  STATE", "r-1     succeeded", "r-22    -"]


def test_enum_text_drops_the_enum_prefix() -> None:
    assert enum_text(common_v1.RunState, common_v1.RunState.RUN_STATE_TERMINAL_FAILED) == (
        "terminal_failed"
    )
    assert enum_text(common_v1.StepKind, common_v1.StepKind.STEP_KIND_EFFECT_SUBMIT) == (
        "effect_submit"
    )
    assert enum_text(common_v1.RunState, 0) == "-"


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.0421, "0.042s"), (12.34, "12.3s"), (245, "4m05s"), (7260, "2h01m")]
)
def test_durations_are_short(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


def test_fields_parse_json_values_and_plain_strings() -> None:
    struct = parse_fields(["A=3", "B=true", "C=null", 'D="007"', "E=Ada Lovelace", "F="], "")
    assert dict(struct) == {"A": 3, "B": True, "C": None, "D": "007", "E": "Ada Lovelace", "F": ""}
    merged = parse_fields(["A=2"], '{"A": 1, "B": [1, 2]}')
    assert merged["A"] == 2 and list(merged["B"]) == [1, 2]


@pytest.mark.parametrize(
    ("pairs", "doc", "message"),
    [
        ([], "", "--field NAME=VALUE or --fields JSON"),
        (["novalue"], "", "--field needs NAME=VALUE"),
        ([], "[1]", "--fields must be a JSON object"),
        ([], "{", "--fields is not JSON"),
    ],
)
def test_bad_fields_are_usage_errors(pairs: list[str], doc: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_fields(pairs, doc)


def _support() -> dict[str, Any]:
    step = {
        "step_key": "a",
        "kind": "STEP_KIND_PURE_COMPUTE",
        "edges": [{"kind": "PLAN_EDGE_KIND_SUCCESS", "target_step_key": "b</script>"}],
    }
    loop_back = {
        "step_key": "b</script>",
        "kind": "STEP_KIND_BOUNDED_MUTATION",
        "edges": [
            {"kind": "PLAN_EDGE_KIND_SUCCESS", "target_step_key": "a"},
            {"kind": "PLAN_EDGE_KIND_FAULT", "target_step_key": "$end"},
        ],
    }
    end = {"step_key": "$end", "kind": "STEP_KIND_TERMINAL"}
    return {
        "run": {
            "flow_run_id": "run-1",
            "flow_api_name": "Demo<Flow>",
            "runtime_state": "RUN_STATE_SUCCEEDED",
            "created_at": "2026-01-01T00:00:00Z",
            "completed_at": "2026-01-01T00:00:02.500Z",
        },
        "plan": {"payload": {"entry_step_key": "a", "steps": [step, loop_back, end]}},
        "steps": [
            {"step_execution_id": "s1", "plan_step_key": "a", "state": "STEP_STATE_SUCCEEDED"},
            {
                "step_execution_id": "s2",
                "plan_step_key": "b</script>",
                "state": "STEP_STATE_FAILED",
            },
        ],
        "attempts": [
            {
                "step_execution_id": "s1",
                "attempt_number": 1,
                "transaction_outcome": "ATTEMPT_OUTCOME_COMMITTED",
                "started_at": "2026-01-01T00:00:01Z",
                "finished_at": "2026-01-01T00:00:01.250Z",
            }
        ],
    }


def test_the_page_escapes_everything_and_embeds_parseable_run_data() -> None:
    page = render_html(_support())
    assert "Demo&lt;Flow&gt;" in page and "Demo<Flow>" not in page.split("<script")[0]
    # The embedded JSON cannot close its script element early.
    data = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S)
    assert data is not None
    parsed = json.loads(data.group(1).replace("<\\/", "</"))
    assert [s["plan_step_key"] for s in parsed["steps"]] == ["a", "b</script>"]
    assert page.count("<script") == 2
    assert "Total</dt><dd>2.500s" in page
    assert "0.250s" in page  # the attempt's duration in the attempts table


def test_the_graph_colours_steps_by_state_and_loops_do_not_push_the_entry_down() -> None:
    page = render_html(_support())
    nodes = re.findall(r'<g class="node" data-step-key="([^"]+)">.*?<rect x="\d+" y="(\d+)"', page)
    y = {key: int(top) for key, top in nodes}
    assert y["a"] < y["b&lt;/script&gt;"] < y["$end"]
    assert 'fill="#d4f4dd"' in page and 'fill="#ffd9d6"' in page
    mermaid = mermaid_source(_support()["plan"])
    assert "s1 -.->|fault| s2" in mermaid and "start((start)) --> s0" in mermaid


def test_run_get_and_the_page_show_the_initiating_principal_and_mode() -> None:
    from flowctl.runs import _run_fields
    from services.proto import runtime_v1

    run = runtime_v1.FlowRun(
        flow_run_id="run_1",
        principal=runtime_v1.PrincipalContext(
            principal_id="user-ann",
            execution_principal_mode="mixed",
            authorization_context_digest="authorization-context/v1:sha256:" + "0" * 64,
        ),
    )
    text = _run_fields(run)
    assert re.search(r"^initiated by: +user-ann$", text, re.M)
    assert re.search(r"^principal mode: +mixed$", text, re.M)
    assert "authorization-context/v1:sha256:" in text
    support = _support()
    support["run"]["principal"] = {"principal_id": "user-<ann>"}
    page = render_html(support)
    assert "Initiated by</dt><dd>user-&lt;ann&gt;" in page
