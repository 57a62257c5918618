"""A run timeline a person can look at: one self-contained HTML page from the support read.

``flowctl run view RUN_ID --html FILE`` writes what :func:`render_html` returns for the
§19 support read (``GetRunSupport``) of the run: no network access, no external script,
so the file can be mailed, attached to a ticket or opened from disk. It shows

* the run: Flow, version, profile, state, safe terminal cause, plan identity, times;
* the plan graph, drawn as an inline SVG (steps coloured by what the run did with them)
  and given as Mermaid source to paste into any Mermaid renderer;
* every step attempt on a timeline relative to the run's creation: one row per step
  execution, one bar per attempt, coloured by its transaction outcome, with its duration,
  retry decision and safe error code;
* steps, attempts, dependencies and effects as tables.

The timeline is drawn by the page's own script from the embedded support JSON (the
tables and the graph are plain HTML/SVG), so the headless-browser test that looks for
the run's steps in the rendered page also proves the script runs.

Pure: the input is the support read as JSON (``MessageToDict`` with proto field names).
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["mermaid_source", "render_html"]

_NODE_W, _NODE_H, _GAP_X, _GAP_Y, _PAD = 200, 46, 36, 70, 24

#: Fill colour per step state (the latest execution of that plan step).
_STATE_COLOURS = {
    "STEP_STATE_SUCCEEDED": "#d4f4dd",
    "STEP_STATE_FAILED": "#ffd9d6",
    "STEP_STATE_QUARANTINED": "#ffe7b3",
    "STEP_STATE_WAITING": "#dbe8ff",
    "STEP_STATE_RUNNING": "#fff3b0",
    "STEP_STATE_CLAIMED": "#fff3b0",
    "STEP_STATE_RETRY_SCHEDULED": "#ffe7b3",
    "STEP_STATE_CANCELLED": "#e4e4e4",
    "STEP_STATE_CANCEL_REQUESTED": "#e4e4e4",
}


def _short(value: str, prefix: str) -> str:
    return value.removeprefix(prefix).lower().replace("_", " ") if value else "-"


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _steps(plan: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(plan.get("payload", {}).get("steps", []))


def mermaid_source(plan: Mapping[str, Any]) -> str:
    """The plan's control flow as a Mermaid ``flowchart``."""
    steps = _steps(plan)
    ids = {s["step_key"]: f"s{i}" for i, s in enumerate(steps)}
    lines = ["flowchart TD"]
    for s in steps:
        label = f"{s['step_key']}<br/>{_short(s.get('kind', ''), 'STEP_KIND_')}"
        lines.append(f'    {ids[s["step_key"]]}["{label.replace(chr(34), "#quot;")}"]')
    for s in steps:
        for edge in s.get("edges", []):
            target = edge.get("target_step_key", "")
            kind = _short(edge.get("kind", ""), "PLAN_EDGE_KIND_")
            if target in ids:
                arrow = "-.->" if kind == "fault" else "-->"
                lines.append(f"    {ids[s['step_key']]} {arrow}|{kind}| {ids[target]}")
    entry = plan.get("payload", {}).get("entry_step_key", "")
    if entry in ids:
        lines.append(f"    start((start)) --> {ids[entry]}")
    return "\n".join(lines) + "\n"


def _levels(plan: Mapping[str, Any]) -> dict[str, int]:
    """Layer of each step: the longest forward path from the entry (loops ignored).

    Back edges (to a step on the current depth-first path) are left out, so a loop does not
    push its head below its body, and terminals end up below everything that reaches them.
    Steps the entry does not reach go below the rest.
    """
    steps = _steps(plan)
    edges = {
        s["step_key"]: [
            e.get("target_step_key", "") for e in s.get("edges", []) if e.get("target_step_key")
        ]
        for s in steps
    }
    entry = plan.get("payload", {}).get("entry_step_key", "")
    order: list[str] = []  # reverse post-order of the forward graph
    forward: dict[str, list[str]] = {k: [] for k in edges}
    colour: dict[str, int] = {}  # 1 on the path, 2 done
    if entry in edges:
        stack: list[tuple[str, int]] = [(entry, 0)]
        colour[entry] = 1
        while stack:  # iterative DFS: plans can be long
            key, i = stack.pop()
            targets = [t for t in edges[key] if t in edges]
            if i < len(targets):
                stack.append((key, i + 1))
                target = targets[i]
                if colour.get(target) == 1:
                    continue  # back edge: a loop
                forward[key].append(target)
                if target not in colour:
                    colour[target] = 1
                    stack.append((target, 0))
            else:
                colour[key] = 2
                order.append(key)
    level: dict[str, int] = {}
    for key in reversed(order):
        level.setdefault(key, 0)
        for target in forward[key]:
            level[target] = max(level.get(target, 0), level[key] + 1)
    deepest = max(level.values(), default=-1)
    for s in steps:
        level.setdefault(s["step_key"], deepest + 1)
    return level


def _graph_svg(plan: Mapping[str, Any], states: Mapping[str, str]) -> str:
    steps = _steps(plan)
    if not steps:
        return "<p>(the plan has no steps)</p>"
    level = _levels(plan)
    rows: dict[int, list[str]] = {}
    for s in steps:
        rows.setdefault(level[s["step_key"]], []).append(s["step_key"])
    width = max(len(r) for r in rows.values()) * (_NODE_W + _GAP_X) - _GAP_X + 2 * _PAD
    height = (max(rows) + 1) * (_NODE_H + _GAP_Y) - _GAP_Y + 2 * _PAD
    pos: dict[str, tuple[float, float]] = {}
    for depth, keys in rows.items():
        row_w = len(keys) * (_NODE_W + _GAP_X) - _GAP_X
        x0 = (width - row_w) / 2
        for i, key in enumerate(keys):
            pos[key] = (x0 + i * (_NODE_W + _GAP_X), _PAD + depth * (_NODE_H + _GAP_Y))
    parts = [
        f'<svg class="graph" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
        f'height="{height:.0f}" role="img" aria-label="plan graph">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#555"/></marker></defs>',
    ]
    for s in steps:
        x, y = pos[s["step_key"]]
        for edge in s.get("edges", []):
            target = edge.get("target_step_key", "")
            if target not in pos:
                continue
            kind = _short(edge.get("kind", ""), "PLAN_EDGE_KIND_")
            tx, ty = pos[target]
            sx, sy = x + _NODE_W / 2, y + _NODE_H
            ex, ey = tx + _NODE_W / 2, ty
            dash = ' stroke-dasharray="5,4"' if kind == "fault" else ""
            if ty > y:
                path = f"M{sx:.0f},{sy:.0f} C{sx:.0f},{sy + 30:.0f} {ex:.0f},{ey - 30:.0f} "
                path += f"{ex:.0f},{ey:.0f}"
            else:  # a loop back: around the right-hand side
                rx = max(x, tx) + _NODE_W + 28
                path = (
                    f"M{x + _NODE_W:.0f},{y + _NODE_H / 2:.0f} C{rx:.0f},{y + _NODE_H / 2:.0f} "
                    f"{rx:.0f},{ty + _NODE_H / 2:.0f} {tx + _NODE_W:.0f},{ty + _NODE_H / 2:.0f}"
                )
            parts.append(
                f'<path d="{path}" fill="none" stroke="#555" stroke-width="1.4"{dash} '
                'marker-end="url(#arrow)"/>'
            )
            parts.append(
                f'<text class="edge" x="{(sx + ex) / 2 + 6:.0f}" y="{(sy + ey) / 2:.0f}">'
                f"{_e(kind)}</text>"
            )
    for s in steps:
        key = s["step_key"]
        x, y = pos[key]
        state = states.get(key, "")
        fill = _STATE_COLOURS.get(state, "#ffffff")
        title = f"{key}: {_short(s.get('kind', ''), 'STEP_KIND_')}"
        if state:
            title += f" — {_short(state, 'STEP_STATE_')}"
        parts.append(
            f'<g class="node" data-step-key="{_e(key)}"><title>{_e(title)}</title>'
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{_NODE_W}" height="{_NODE_H}" rx="8" '
            f'fill="{fill}" stroke="#333"/>'
            f'<text x="{x + _NODE_W / 2:.0f}" y="{y + 19:.0f}" class="key">{_e(key)}</text>'
            f'<text x="{x + _NODE_W / 2:.0f}" y="{y + 36:.0f}" class="kind">'
            f"{_e(_short(s.get('kind', ''), 'STEP_KIND_'))}</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _time(value: str | None) -> str:
    return value.replace("T", " ").replace("Z", " UTC") if value else "-"


def _seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    a = datetime.fromisoformat(start.replace("Z", "+00:00"))
    b = datetime.fromisoformat(end.replace("Z", "+00:00"))
    return (b - a).total_seconds()


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], css: str) -> str:
    if not rows:
        return '<p class="none">(none)</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{_e(c if c not in (None, '') else '-')}</td>" for c in r) + "</tr>"
        for r in rows
    )
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _step_label(step: Mapping[str, Any]) -> str:
    return f"{step.get('plan_step_key', '?')}#{step.get('invocation_ordinal', 0)}"


_SCRIPT = r"""
(function () {
  const data = JSON.parse(document.getElementById("run-data").textContent);
  const run = data.run || {};
  const steps = data.steps || [];
  const attempts = data.attempts || [];
  const t = (s) => (s ? Date.parse(s) : NaN);
  const origin = t(run.created_at);
  const ends = attempts.map((a) => t(a.finished_at || a.started_at)).concat([t(run.completed_at),
    t(run.updated_at)]).filter((v) => !isNaN(v));
  const span = Math.max(1, (ends.length ? Math.max(...ends) : origin) - origin);
  const fmt = (ms) => ms < 10000 ? (ms / 1000).toFixed(3) + "s" : (ms / 1000).toFixed(1) + "s";
  const root = document.getElementById("timeline");
  const axis = document.createElement("div");
  axis.className = "axis";
  for (let i = 0; i <= 4; i++) {
    const tick = document.createElement("span");
    tick.style.left = (i * 25) + "%";
    tick.textContent = "+" + fmt(span * i / 4);
    axis.appendChild(tick);
  }
  root.appendChild(axis);
  const byStep = new Map();
  attempts.forEach((a) => {
    if (!byStep.has(a.step_execution_id)) byStep.set(a.step_execution_id, []);
    byStep.get(a.step_execution_id).push(a);
  });
  steps.forEach((s) => {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.stepKey = s.plan_step_key;
    const label = document.createElement("div");
    label.className = "label";
    label.textContent = s.plan_step_key + " #" + (s.invocation_ordinal || 0);
    const state = document.createElement("small");
    state.textContent = (s.state || "").replace("STEP_STATE_", "").toLowerCase().replace(/_/g, " ");
    label.appendChild(state);
    const lane = document.createElement("div");
    lane.className = "lane";
    (byStep.get(s.step_execution_id) || []).forEach((a) => {
      const start = t(a.started_at);
      const end = isNaN(t(a.finished_at)) ? start : t(a.finished_at);
      const bar = document.createElement("div");
      const outcome = (a.transaction_outcome || "").replace("ATTEMPT_OUTCOME_", "").toLowerCase();
      bar.className = "bar " + outcome;
      bar.style.left = (100 * (start - origin) / span) + "%";
      bar.style.width = Math.max(0.6, 100 * (end - start) / span) + "%";
      bar.title = "attempt " + a.attempt_number + ": " + outcome.replace(/_/g, " ") +
        " in " + fmt(end - start) + (a.safe_error_code ? " — " + a.safe_error_code : "") +
        (a.retry_decision ? " — retry " + a.retry_decision.replace("RETRY_DECISION_", "")
          .toLowerCase() : "");
      const text = document.createElement("span");
      // Labels sit beside the bar; late bars get theirs on the left so it stays visible.
      text.className = (start - origin) / span > 0.6 ? "before" : "after";
      text.textContent = "#" + a.attempt_number + " " + fmt(end - start) +
        (a.safe_error_code ? " " + a.safe_error_code : "");
      bar.appendChild(text);
      lane.appendChild(bar);
    });
    row.appendChild(label);
    row.appendChild(lane);
    root.appendChild(row);
  });
  if (!steps.length) root.appendChild(document.createTextNode("(no step has executed yet)"));
  document.body.dataset.rendered = "true";
})();
"""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d1d1f}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px}
.sub{color:#555;margin-bottom:14px} code{font-size:12px}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;font-weight:600}
.succeeded{background:#d4f4dd}.terminal_failed,.quarantined{background:#ffd9d6}
.cancelled,.cancel_requested{background:#e4e4e4}.running,.runnable,.accepted{background:#fff3b0}
.waiting{background:#dbe8ff}
dl.meta{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:0}
dl.meta dt{color:#555} dl.meta dd{margin:0}
svg.graph text{font-size:12px;text-anchor:middle} svg.graph text.key{font-weight:600}
svg.graph text.kind{fill:#555} svg.graph text.edge{font-size:11px;fill:#777;text-anchor:start}
#timeline{border:1px solid #ddd;border-radius:6px;padding:8px 12px}
.axis{position:relative;height:18px;margin-left:230px;border-bottom:1px solid #ccc;
  font-size:11px;color:#666}
.axis span{position:absolute;transform:translateX(-50%)} .axis span:first-child{transform:none}
.row{display:flex;align-items:center;min-height:30px;border-bottom:1px dashed #eee}
.label{width:230px;flex:none;font-weight:600;overflow:hidden;text-overflow:ellipsis}
.label small{display:block;font-weight:400;color:#666}
.lane{position:relative;flex:1;height:22px}
.bar{position:absolute;top:2px;height:18px;border-radius:4px;background:#9ec5fe;
  overflow:visible;white-space:nowrap}
.bar span{font-size:11px;position:absolute;top:2px;white-space:nowrap}
.bar span.after{left:100%;padding-left:4px} .bar span.before{right:100%;padding-right:4px}
.bar.committed{background:#7fd49b}.bar.rolled_back,.bar.pre_transaction_failed{background:#f4a29b}
.bar.commit_unknown,.bar.rollback_unknown{background:#f7c46c}
.bar.fenced,.bar.cancelled{background:#c8c8c8}
.bar.started{background:#fff3b0}
table{border-collapse:collapse;margin:4px 0 8px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;font-size:13px}
th{background:#f5f5f7} p.none{color:#777}
details pre{background:#f5f5f7;padding:10px;overflow:auto}
"""


def render_html(support: Mapping[str, Any]) -> str:
    """The page (module docstring) for one support read given as proto-JSON."""
    run: Mapping[str, Any] = support.get("run", {})
    plan: Mapping[str, Any] = support.get("plan", {})
    steps: list[Mapping[str, Any]] = list(support.get("steps", []))
    attempts: list[Mapping[str, Any]] = list(support.get("attempts", []))
    labels = {s.get("step_execution_id"): _step_label(s) for s in steps}
    latest: dict[str, str] = {}
    for s in steps:  # creation order: the last execution of a key wins
        latest[str(s.get("plan_step_key"))] = str(s.get("state", ""))
    state = _short(run.get("runtime_state", ""), "RUN_STATE_")
    total = _seconds_between(run.get("created_at"), run.get("completed_at"))
    meta = [
        ("Flow", f"{run.get('flow_api_name', '?')} ({run.get('flow_version_id', '-')})"),
        ("Profile", _short(run.get("execution_profile", ""), "EXECUTION_PROFILE_")),
        ("Terminal cause", run.get("terminal_cause_code") or support.get("terminal_cause_code")),
        ("Initiated by", run.get("principal", {}).get("principal_id")),
        ("Principal mode", run.get("principal", {}).get("execution_principal_mode")),
        ("Plan", f"{run.get('plan_id', '-')}  {run.get('plan_digest', '')}"),
        (
            "Scope",
            f"{run.get('org_id', '')} / {run.get('app_installation_id', '')} / "
            f"{run.get('runtime_capability_id', '')}",
        ),
        ("Created", _time(run.get("created_at"))),
        ("Started", _time(run.get("started_at"))),
        ("Completed", _time(run.get("completed_at"))),
        ("Total", f"{total:.3f}s" if total is not None else "-"),
        ("State version", run.get("state_version", "0")),
    ]
    meta_html = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v or '-')}</dd>" for k, v in meta)
    step_rows = [
        (
            _step_label(s),
            _short(s.get("step_kind", ""), "STEP_KIND_"),
            _short(s.get("state", ""), "STEP_STATE_"),
            s.get("attempt_count", 0),
            _short(s.get("failure_class", ""), "FAILURE_CLASS_"),
            _time(s.get("updated_at")),
        )
        for s in steps
    ]
    attempt_rows = [
        (
            labels.get(a.get("step_execution_id"), a.get("step_execution_id")),
            a.get("attempt_number"),
            _short(a.get("transaction_outcome", ""), "ATTEMPT_OUTCOME_"),
            _time(a.get("started_at")),
            (lambda d: f"{d:.3f}s" if d is not None else "-")(
                _seconds_between(a.get("started_at"), a.get("finished_at"))
            ),
            _short(a.get("retry_decision", ""), "RETRY_DECISION_"),
            a.get("retry_delay", ""),
            a.get("safe_error_code", ""),
        )
        for a in attempts
    ]
    dep_rows = [
        (
            d.get("dependency_id"),
            labels.get(d.get("step_execution_id"), d.get("step_execution_id")),
            f"{d.get('producer_kind', '')}:{d.get('producer_key', '')}",
            _short(d.get("state", ""), "DEPENDENCY_STATE_"),
            _time(d.get("deadline")),
            _time(d.get("resolved_at")),
        )
        for d in support.get("dependencies", [])
    ]
    effect_rows = [
        (
            e.get("link", {}).get("effect_link_id"),
            labels.get(e.get("link", {}).get("step_execution_id"), "-"),
            e.get("link", {}).get("effect_owner_kind"),
            e.get("link", {}).get("effect_handoff_key"),
            _short(e.get("delivery_state", ""), "OUTBOX_DELIVERY_STATE_"),
        )
        for e in support.get("effects", [])
    ]
    data = json.dumps(
        {"run": run, "steps": steps, "attempts": attempts}, ensure_ascii=False
    ).replace("</", "<\\/")
    title = f"{run.get('flow_api_name', 'Flow run')} — {run.get('flow_run_id', '')}"
    steps_html = _table(
        ("step", "kind", "state", "attempts", "failure", "updated"), step_rows, "steps"
    )
    attempts_html = _table(
        ("step", "#", "outcome", "started", "took", "retry", "delay", "error"),
        attempt_rows,
        "attempts",
    )
    deps_html = _table(
        ("dependency", "step", "producer", "state", "deadline", "resolved"), dep_rows, "deps"
    )
    effects_html = _table(
        ("link", "step", "owner", "handoff key", "delivery"), effect_rows, "effects"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{_e(title)}</title>
<meta name="generator" content="flowctl run view">
<style>{_CSS}</style></head>
<body data-rendered="false">
<h1>{_e(run.get("flow_api_name", "Flow run"))}
 <span class="badge {_e(state.replace(" ", "_"))}" id="run-state">{_e(state)}</span></h1>
<div class="sub">run <code>{_e(run.get("flow_run_id", ""))}</code></div>
<dl class="meta">{meta_html}</dl>
<h2>Plan graph</h2>
{_graph_svg(plan, latest)}
<details><summary>Mermaid source</summary><pre>{_e(mermaid_source(plan))}</pre></details>
<h2>Timeline</h2>
<div id="timeline"></div>
<h2>Steps</h2>
{steps_html}
<h2>Attempts</h2>
{attempts_html}
<h2>Dependencies</h2>
{deps_html}
<h2>Effects</h2>
{effects_html}
<script type="application/json" id="run-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
