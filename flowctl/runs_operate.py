"""``flowctl run pause|resume|retry-quarantined``: the operator controls of a Flow run
(``FlowRunService.PauseRun``/``ResumeRun``/``RetryQuarantinedRun``, issue 14 item 5).

::

    flowctl run pause RUN_ID [--reason TEXT] [--expected-version V]
    flowctl run resume RUN_ID [--reason TEXT] [--expected-version V]
    flowctl run retry-quarantined RUN_ID --reason TEXT [--expected-version V]
    flowctl run restart RUN_ID --checkpoint CKPT --reason TEXT [--expected-version V]

Each mints its call credential with the role the runtime requires
(``flow.runs.operate``) and sends a fresh ``request_id`` unless ``--request-id`` repeats
one. ``--expected-version`` is presence-aware (``0`` expects version 0). A paused run is
not claimed until resumed; ``retry-quarantined`` is the explicit, audited decision to
retry a reconciled commit-unknown quarantine and ``restart`` runs a failed run again from
one of its checkpoints (``--reason`` required for both).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from typing import Any

from google.protobuf.wrappers_pb2 import Int64Value

from flowctl.common import call_metadata, channel_for
from flowctl.output import fields, print_json, timestamp_text
from services.config import ServiceName
from services.proto import runtime_v1

__all__ = ["OPERATE_ROLE", "register_operator_commands"]

#: Role the runtime requires for the operator controls (``services.auth.trust``).
OPERATE_ROLE = "flow.runs.operate"
_CALL_TIMEOUT_S = 30.0


def _call(args: argparse.Namespace, rpc: str, request_type: Any, **extra: str) -> int:
    request = request_type(
        request_id=args.request_id or uuid.uuid4().hex,
        org_id=args.org,
        flow_run_id=args.run_id,
        reason=args.reason or "",
        **extra,
    )
    if args.expected_version is not None:
        request.expected_state_version.CopyFrom(Int64Value(value=args.expected_version))
    with channel_for(args.target) as channel:
        stub = runtime_v1.FlowRunServiceStub(channel)
        resp = getattr(stub, rpc)(
            request,
            metadata=call_metadata(args, ServiceName.RUNTIME, roles=(OPERATE_ROLE,)),
            timeout=_CALL_TIMEOUT_S,
        )
    run = resp.run
    if args.json:
        print_json(run)
        return 0
    state = args.state_text(run.runtime_state)
    sys.stdout.write(
        fields(
            (
                ("run", run.flow_run_id),
                ("state", state),
                ("paused since", timestamp_text(run.operator_paused_at)),
                ("state version", run.state_version),
                ("current step", run.current_step_execution_id),
            )
        )
    )
    return 0


def _pause(args: argparse.Namespace) -> int:
    return _call(args, "PauseRun", runtime_v1.PauseRunRequest)


def _resume(args: argparse.Namespace) -> int:
    return _call(args, "ResumeRun", runtime_v1.ResumeRunRequest)


def _retry(args: argparse.Namespace) -> int:
    return _call(args, "RetryQuarantinedRun", runtime_v1.RetryQuarantinedRunRequest)


def _restart(args: argparse.Namespace) -> int:
    return _call(
        args,
        "RestartFromCheckpoint",
        runtime_v1.RestartFromCheckpointRequest,
        checkpoint_id=args.checkpoint,
    )


def register_operator_commands(
    command: Callable[..., Any], state_text: Callable[[int], str]
) -> None:
    """Add the operator commands through ``flowctl.runs``' ``command`` factory."""
    for name, text, func, reason_help in (
        ("pause", "pause a run: no step is claimed until resumed", _pause, "audited reason"),
        ("resume", "resume a paused run", _resume, "audited reason"),
        (
            "retry-quarantined",
            "retry a reconciled commit-unknown quarantine (explicit, audited decision)",
            _retry,
            "why the retry is safe (required; kept in the audit record)",
        ),
        (
            "restart",
            "run a failed run again from one of its checkpoints (explicit, audited decision)",
            _restart,
            "why the restart is safe (required; kept in the audit record)",
        ),
    ):
        p = command(name, text, func)
        required = name in ("retry-quarantined", "restart")
        p.add_argument("--reason", default="", required=required, help=reason_help)
        if name == "restart":
            p.add_argument(
                "--checkpoint", required=True, help="checkpoint id of the run (run support)"
            )
        p.add_argument(
            "--expected-version", type=int, default=None, help="expected state version (CAS)"
        )
        p.add_argument("--request-id", default="", help="idempotency token of this call")
        p.set_defaults(state_text=state_text)
