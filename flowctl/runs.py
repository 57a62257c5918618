"""``flowctl run …``: start, read, follow, cancel and delete Flow runs (FlowRunService).

::

    flowctl run start FLOW [--version N | --plan-id P] [--input JSON | --input-file F]
                      [--idempotency-key K] [--wait SECONDS]
    flowctl run get RUN_ID
    flowctl run list [--flow NAME] [--plan-id P] [--state STATE …] [--limit N]
    flowctl run support RUN_ID            # §19 support read: steps, attempts, dependencies, effects
    flowctl run watch RUN_ID [--timeout S] [--interval S]
    flowctl run cancel RUN_ID [--reason CODE] [--expected-version V]
    flowctl run delete RUN_ID [--expected-version V]
    flowctl run pause|resume RUN_ID [--reason TEXT] [--expected-version V]   # flowctl.runs_operate
    flowctl run retry-quarantined RUN_ID --reason TEXT [--expected-version V]
    flowctl run restart RUN_ID --checkpoint CKPT --reason TEXT [--expected-version V]
    flowctl run view RUN_ID --html FILE   # a self-contained timeline page (flowctl.timeline)

Every command prints a table by default and the response as JSON with ``--json``.
``start`` needs the complete work scope: ``--app-installation --capability
--binding-digest``, taken from ``make run``'s ``demo.json`` when left out
(:func:`flowctl.common.work_scope`). ``cancel`` and ``delete`` mint their call credential
with the role the runtime requires (``flow.runs.cancel`` / ``flow.runs.delete``).

``watch`` polls ``GetRun`` and prints one line per change of state or current step until
the run settles in a terminal state. Exit codes: 0 succeeded, 1 failed / quarantined /
cancelled, 3 not settled within ``--timeout``, 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct

from flowctl.common import (
    UsageError,
    add_connection_args,
    call_metadata,
    channel_for,
    load_document,
    work_scope,
)
from flowctl.output import (
    add_output_args,
    duration_text,
    enum_text,
    fields,
    message_json,
    print_json,
    proto_duration_text,
    table,
    timestamp_text,
)
from flowctl.runs_operate import register_operator_commands
from flowctl.timeline import render_html
from services.config import ServiceName
from services.proto import common_v1, runtime_v1

__all__ = ["CANCEL_ROLE", "DELETE_ROLE", "TERMINAL_STATES", "register", "run_rows"]

_CALL_TIMEOUT_S = 30.0
#: Roles the runtime requires for cancel and delete (``runtime_svc.runs.service``).
CANCEL_ROLE = "flow.runs.cancel"
DELETE_ROLE = "flow.runs.delete"
_RS = common_v1.RunState
#: States a run never leaves.
TERMINAL_STATES = frozenset(
    {
        _RS.RUN_STATE_SUCCEEDED,
        _RS.RUN_STATE_TERMINAL_FAILED,
        _RS.RUN_STATE_QUARANTINED,
        _RS.RUN_STATE_CANCELLED,
    }
)
_EXIT_NOT_SETTLED = 3
_MAX_PAGES = 10_000


def _stub(channel: grpc.Channel) -> Any:
    return runtime_v1.FlowRunServiceStub(channel)


def _state(value: int) -> str:
    return enum_text(common_v1.RunState, value)


def run_rows(runs: Sequence[runtime_v1.FlowRun]) -> str:
    """The run list table."""
    return table(
        ("run id", "flow", "version", "profile", "state", "cause", "created", "updated"),
        (
            (
                r.flow_run_id,
                r.flow_api_name,
                r.flow_version_id,
                enum_text(common_v1.ExecutionProfile, r.execution_profile),
                _state(r.runtime_state) + (" (deleted)" if r.is_deleted else ""),
                r.terminal_cause_code,
                timestamp_text(r.created_at),
                timestamp_text(r.updated_at),
            )
            for r in runs
        ),
    )


def _run_fields(r: runtime_v1.FlowRun) -> str:
    return fields(
        (
            ("run", r.flow_run_id),
            ("flow", f"{r.flow_api_name} ({r.flow_version_id})"),
            ("profile", enum_text(common_v1.ExecutionProfile, r.execution_profile)),
            ("state", _state(r.runtime_state) + (" (deleted)" if r.is_deleted else "")),
            ("terminal cause", r.terminal_cause_code),
            ("state version", r.state_version),
            ("current step", r.current_step_execution_id),
            ("plan", f"{r.plan_id} {r.plan_digest}"),
            ("scope", f"{r.org_id} / {r.app_installation_id} / {r.runtime_capability_id}"),
            ("binding", r.runtime_work_binding_digest),
            ("idempotency key", r.idempotency_key),
            ("initiated by", r.principal.principal_id),
            ("principal mode", r.principal.execution_principal_mode),
            ("auth context", r.principal.authorization_context_digest),
            ("created", timestamp_text(r.created_at)),
            ("started", timestamp_text(r.started_at)),
            ("completed", timestamp_text(r.completed_at)),
            ("trace", r.trace_id),
        )
    )


def _outputs(r: runtime_v1.FlowRun) -> str:
    if not r.HasField("output_variables"):
        return ""
    doc = message_json(r.output_variables)
    return "outputs:\n" + "".join(f"  {k} = {json.dumps(v)}\n" for k, v in sorted(doc.items()))


# --- start ---------------------------------------------------------------------------------


def _inputs(args: argparse.Namespace) -> Struct | None:
    if args.input and args.input_file:
        raise UsageError("give --input or --input-file, not both")
    if args.input:
        try:
            doc = json.loads(args.input)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--input is not JSON: {exc}") from exc
    elif args.input_file:
        doc = load_document(args.input_file)
    else:
        return None
    if not isinstance(doc, dict):
        raise UsageError("the input variables must be a JSON object")
    struct = Struct()
    struct.update(doc)
    return struct


def _start(args: argparse.Namespace) -> int:
    if bool(args.flow) == bool(args.plan_id):
        raise UsageError("run start needs a FLOW api name or --plan-id (one of them)")
    scope = work_scope(args, "run start")
    request = runtime_v1.StartRunRequest(
        request_id=args.request_id or uuid.uuid4().hex,
        scope=scope,
        idempotency_key=args.idempotency_key or "",
    )
    if args.plan_id:
        request.plan_id = args.plan_id
    else:
        request.flow.CopyFrom(
            runtime_v1.FlowVersionSelector(flow_api_name=args.flow, version_number=args.version)
        )
    inputs = _inputs(args)
    if inputs is not None:
        request.input_variables.CopyFrom(inputs)
    if args.wait:
        request.wait_budget.FromNanoseconds(int(args.wait * 1e9))
    with channel_for(args.target) as channel:
        resp = _stub(channel).StartRun(
            request,
            metadata=call_metadata(args, ServiceName.RUNTIME),
            timeout=_CALL_TIMEOUT_S + args.wait,
        )
    if args.json:
        print_json(resp)
        return 0
    note = "existing run (same idempotency key)" if resp.existing_run else "accepted"
    if resp.completed:
        note += ", finished within the wait budget"
    sys.stdout.write(_run_fields(resp.run) + _outputs(resp.run) + f"({note})\n")
    return 0


# --- reads ---------------------------------------------------------------------------------


def _get_run(args: argparse.Namespace, run_id: str) -> runtime_v1.FlowRun:
    with channel_for(args.target) as channel:
        resp = _stub(channel).GetRun(
            runtime_v1.GetRunRequest(org_id=args.org, flow_run_id=run_id),
            metadata=call_metadata(args, ServiceName.RUNTIME),
            timeout=_CALL_TIMEOUT_S,
        )
    run: runtime_v1.FlowRun = resp.run
    return run


def _get(args: argparse.Namespace) -> int:
    run = _get_run(args, args.run_id)
    if args.json:
        print_json(run)
    else:
        sys.stdout.write(_run_fields(run) + _outputs(run))
    return 0


def _list(args: argparse.Namespace) -> int:
    states = [getattr(_RS, "RUN_STATE_" + s.upper()) for s in args.state or []]
    runs: list[runtime_v1.FlowRun] = []
    token = ""
    with channel_for(args.target) as channel:
        stub = _stub(channel)
        for _ in range(_MAX_PAGES):
            resp = stub.ListRuns(
                runtime_v1.ListRunsRequest(
                    org_id=args.org,
                    page_size=min(args.limit - len(runs), 500),
                    page_token=token,
                    flow_api_name=args.flow or "",
                    plan_id=args.plan_id or "",
                    runtime_states=states,
                ),
                metadata=call_metadata(args, ServiceName.RUNTIME),
                timeout=_CALL_TIMEOUT_S,
            )
            runs.extend(resp.runs)
            token = resp.next_page_token
            if not token or len(runs) >= args.limit:
                break
    runs = runs[: args.limit]
    if args.json:
        print_json(runs)
    else:
        sys.stdout.write(run_rows(runs))
        if token:
            print(f"(more runs exist; raise --limit above {args.limit})")
    return 0


def _support_view(args: argparse.Namespace) -> runtime_v1.RunSupportView:
    with channel_for(args.target) as channel:
        resp = _stub(channel).GetRunSupport(
            runtime_v1.GetRunSupportRequest(org_id=args.org, flow_run_id=args.run_id),
            metadata=call_metadata(args, ServiceName.RUNTIME),
            timeout=_CALL_TIMEOUT_S,
        )
    view: runtime_v1.RunSupportView = resp.support
    return view


def support_text(view: runtime_v1.RunSupportView) -> str:
    """The support read as a header and four tables."""
    keys = {s.step_execution_id: f"{s.plan_step_key}#{s.invocation_ordinal}" for s in view.steps}
    parts = [_run_fields(view.run)]
    if view.HasField("current_checkpoint"):
        cp = view.current_checkpoint
        parts.append(
            fields(
                (
                    ("checkpoint", f"{cp.checkpoint_id} (sequence {cp.sequence})"),
                    ("next step", cp.plan_cursor.step_key),
                    ("context bytes", cp.context_payload_bytes),
                )
            )
        )
    parts.append("\nSTEPS\n")
    parts.append(
        table(
            ("step", "kind", "state", "attempts", "failure", "updated"),
            (
                (
                    keys[s.step_execution_id],
                    enum_text(common_v1.StepKind, s.step_kind),
                    enum_text(common_v1.StepState, s.state),
                    s.attempt_count,
                    enum_text(common_v1.FailureClass, s.failure_class),
                    timestamp_text(s.updated_at),
                )
                for s in view.steps
            ),
        )
    )
    parts.append("\nATTEMPTS\n")
    parts.append(
        table(
            ("step", "#", "outcome", "started", "took", "retry", "delay", "error"),
            (
                (
                    keys.get(a.step_execution_id, a.step_execution_id),
                    a.attempt_number,
                    enum_text(common_v1.AttemptOutcome, a.transaction_outcome),
                    timestamp_text(a.started_at),
                    _took(a),
                    enum_text(common_v1.RetryDecision, a.retry_decision),
                    proto_duration_text(a.retry_delay),
                    a.safe_error_code,
                )
                for a in view.attempts
            ),
        )
    )
    parts.append("\nDEPENDENCIES\n")
    parts.append(
        table(
            ("dependency", "step", "producer", "state", "deadline"),
            (
                (
                    d.dependency_id,
                    keys.get(d.step_execution_id, d.step_execution_id),
                    f"{d.producer_kind}:{d.producer_key}",
                    enum_text(common_v1.DependencyState, d.state),
                    timestamp_text(d.deadline),
                )
                for d in view.dependencies
            ),
        )
    )
    parts.append("\nEFFECTS\n")
    parts.append(
        table(
            ("link", "step", "owner", "handoff key", "delivery"),
            (
                (
                    e.link.effect_link_id,
                    keys.get(e.link.step_execution_id, e.link.step_execution_id),
                    e.link.effect_owner_kind,
                    e.link.effect_handoff_key,
                    enum_text(common_v1.OutboxDeliveryState, e.delivery_state),
                )
                for e in view.effects
            ),
        )
    )
    return "".join(parts)


def _took(a: runtime_v1.StepAttempt) -> str:
    if not a.HasField("started_at") or not a.HasField("finished_at"):
        return "-"
    start = a.started_at.ToNanoseconds()
    end = a.finished_at.ToNanoseconds()
    return duration_text((end - start) / 1e9)


def _support(args: argparse.Namespace) -> int:
    view = _support_view(args)
    if args.json:
        print_json(view)
    else:
        sys.stdout.write(support_text(view))
    return 0


def _view(args: argparse.Namespace) -> int:
    view = _support_view(args)
    out = Path(args.html)
    out.write_text(render_html(message_json(view)), encoding="utf-8")
    print(f"wrote {out} ({len(view.steps)} steps, {len(view.attempts)} attempts)")
    return 0


# --- watch ---------------------------------------------------------------------------------


def _watch(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    last: tuple[int, str, int] | None = None
    run: runtime_v1.FlowRun | None = None
    md = call_metadata(args, ServiceName.RUNTIME)
    with channel_for(args.target) as channel:
        stub = _stub(channel)
        while True:
            run = stub.GetRun(
                runtime_v1.GetRunRequest(org_id=args.org, flow_run_id=args.run_id),
                metadata=md,
                timeout=_CALL_TIMEOUT_S,
            ).run
            seen = (run.runtime_state, run.current_step_execution_id, run.state_version)
            if seen != last:
                last = seen
                if args.json:
                    print(json.dumps(message_json(run)), flush=True)
                else:
                    step = run.current_step_execution_id or "-"
                    cause = f"  cause {run.terminal_cause_code}" if run.terminal_cause_code else ""
                    print(
                        f"{timestamp_text(run.updated_at)}  {_state(run.runtime_state):<16} "
                        f"step {step}  v{run.state_version}{cause}",
                        flush=True,
                    )
            if run.runtime_state in TERMINAL_STATES:
                break
            if time.monotonic() >= deadline:
                print(
                    f"flowctl: run {args.run_id} is still {_state(run.runtime_state)} "
                    f"after {args.timeout:g}s",
                    file=sys.stderr,
                )
                return _EXIT_NOT_SETTLED
            time.sleep(args.interval)
    return 0 if run.runtime_state == _RS.RUN_STATE_SUCCEEDED else 1


# --- cancel / delete -------------------------------------------------------------------------


def _cancel(args: argparse.Namespace) -> int:
    with channel_for(args.target) as channel:
        resp = _stub(channel).CancelRun(
            runtime_v1.CancelRunRequest(
                request_id=args.request_id or uuid.uuid4().hex,
                org_id=args.org,
                flow_run_id=args.run_id,
                expected_state_version=args.expected_version,
                reason_code=args.reason or "",
            ),
            metadata=call_metadata(args, ServiceName.RUNTIME, roles=(CANCEL_ROLE,)),
            timeout=_CALL_TIMEOUT_S,
        )
    if args.json:
        print_json(resp.run)
    else:
        sys.stdout.write(_run_fields(resp.run))
    return 0


def _delete(args: argparse.Namespace) -> int:
    with channel_for(args.target) as channel:
        resp = _stub(channel).DeleteRun(
            runtime_v1.DeleteRunRequest(
                request_id=args.request_id or uuid.uuid4().hex,
                org_id=args.org,
                flow_run_id=args.run_id,
                expected_state_version=args.expected_version,
            ),
            metadata=call_metadata(args, ServiceName.RUNTIME, roles=(DELETE_ROLE,)),
            timeout=_CALL_TIMEOUT_S,
        )
    if args.json:
        print_json(resp.run)
    else:
        sys.stdout.write(_run_fields(resp.run))
    return 0


# --- parser ----------------------------------------------------------------------------------


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _limit(text: str) -> int:
    value = int(_positive(text))
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


_STATE_NAMES = [
    n.removeprefix("RUN_STATE_").lower()
    for n in (v.name for v in common_v1.RunState.DESCRIPTOR.values)
    if n != "RUN_STATE_UNSPECIFIED"
]


def register(groups: Any) -> None:
    """Add the ``run`` command group."""
    run = groups.add_parser(
        "run", help="start, read, follow, cancel, delete, pause and resume Flow runs"
    )
    commands = run.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, func: Any, *, run_id: bool = True) -> Any:
        p = commands.add_parser(name, help=help_text)
        if run_id:
            p.add_argument("run_id", metavar="RUN_ID", help="Flow run id")
        add_connection_args(p, ServiceName.RUNTIME)
        add_output_args(p)
        p.set_defaults(func=func)
        return p

    start = command("start", "start a run of an active autolaunched Flow", _start, run_id=False)
    start.add_argument("flow", nargs="?", default="", metavar="FLOW", help="Flow API name")
    start.add_argument("--version", type=int, default=0, help="Flow version number (0 = active)")
    start.add_argument("--plan-id", default="", help="start on this exact activated plan")
    start.add_argument("--input", default="", help="input variables as a JSON object")
    start.add_argument("--input-file", default="", help="input variables from a JSON/YAML file")
    start.add_argument("--idempotency-key", default="", help="at most one run per key")
    start.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for a terminal result"
    )
    start.add_argument("--request-id", default="", help="idempotency token of this call")

    command("get", "read a run", _get)
    lst = command("list", "list runs of the org (newest last)", _list, run_id=False)
    lst.add_argument("--flow", default="", help="only runs of this Flow API name")
    lst.add_argument("--plan-id", default="", help="only runs of this plan")
    lst.add_argument(
        "--state",
        action="append",
        choices=_STATE_NAMES,
        help="only runs in this state (repeatable)",
    )
    lst.add_argument("--limit", type=_limit, default=50, help="at most this many runs (50)")
    command("support", "support read: plan, steps, attempts, dependencies, effects", _support)

    watch = command("watch", "follow a run until it settles", _watch)
    watch.add_argument(
        "--timeout", type=_positive, default=300.0, help="give up after this many seconds (300)"
    )
    watch.add_argument("--interval", type=_positive, default=1.0, help="poll interval (1 s)")

    cancel = command("cancel", "cancel a non-terminal run", _cancel)
    cancel.add_argument("--reason", default="", help="safe reason code recorded as the cause")
    cancel.add_argument("--expected-version", type=int, default=0, help="expected state version")
    cancel.add_argument("--request-id", default="", help="idempotency token of this call")

    delete = command("delete", "soft-delete a run (cancels it when not terminal)", _delete)
    delete.add_argument("--expected-version", type=int, default=0, help="expected state version")
    delete.add_argument("--request-id", default="", help="idempotency token of this call")

    register_operator_commands(command, _state)

    view = command("view", "write a self-contained HTML timeline of a run", _view)
    view.add_argument("--html", required=True, metavar="FILE", help="page to write")
