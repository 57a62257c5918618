"""``flowctl signal …``: submit and read durable wake signals (``WakeSignalService``).

::

    flowctl signal send --producer-kind external.signal --producer-key approval:42 \\
        --token approval-42-1 [--evidence '{"status": "approved"}'] [--wake-version N] \\
        --org O --app-installation I --capability C --binding-digest D [--json]
    flowctl signal get (--id SIG | --producer-kind K --producer-key KEY --token T) \\
        --org O --app-installation I --capability C --binding-digest D [--json]

``send`` mints a short-lived credential for the given work scope with the role
``flow.signals.submit`` (from the configured signing key, like every flowctl command),
computes the evidence digest (``wake-evidence/v1`` of the canonical JSON object) and
prints what happened: consumed by a waiting dependency, accepted and waiting for one, a
duplicate of an accepted token, or stale. ``--json`` prints the response message.

Exit codes: 0 accepted (also a duplicate or stale no-op), 1 refused by the server or
unreachable (one line, no traceback), 2 a missing or malformed flag.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import grpc
from google.protobuf import json_format

from flowctl.common import CliError, add_connection_args, channel_for
from runtime_svc.waits.evidence import evidence_digest, parse_evidence
from runtime_svc.waits.registry import SIGNAL_SUBMIT_ROLE
from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName, load_config
from services.errors import ERROR_DETAIL_METADATA_KEY, FlowError
from services.proto import common_v1, runtime_v1

__all__ = ["describe", "register"]

_SCOPE_FLAGS = ("app_installation", "capability", "binding_digest")
_STATES = {
    common_v1.WakeSignalResolutionState.Value("WAKE_SIGNAL_RESOLUTION_STATE_UNMATCHED"): (
        "unmatched"
    ),
    common_v1.WakeSignalResolutionState.Value("WAKE_SIGNAL_RESOLUTION_STATE_CONSUMED"): "consumed",
    common_v1.WakeSignalResolutionState.Value("WAKE_SIGNAL_RESOLUTION_STATE_EXPIRED"): "expired",
}


def _require_scope(args: argparse.Namespace) -> None:
    missing = [f"--{f.replace('_', '-')}" for f in _SCOPE_FLAGS if not getattr(args, f)]
    if missing:
        args.parser.error(f"the work scope is required: missing {', '.join(missing)}")


def _metadata(args: argparse.Namespace, roles: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    cfg = load_config(ServiceName.RUNTIME)
    try:
        key = load_signing_key(cfg.auth_signing_key)
    except Exception as exc:
        raise CliError(f"cannot load signing key {cfg.auth_signing_key}: {exc}") from None
    try:
        claims = WorkloadClaims(
            subject="flowctl",
            audiences=(ServiceName.RUNTIME,),
            org_id=args.org,
            app_installation_id=args.app_installation,
            runtime_capability_id=args.capability,
            runtime_work_binding_digest=args.binding_digest,
            roles=roles,
        )
    except ValueError as exc:
        args.parser.error(str(exc))
    token = mint_credential(key, cfg.auth_signing_key_id, claims, ttl_s=120)
    return (("authorization", f"Bearer {token}"),)


def _rpc_failure(exc: grpc.RpcError, target: str) -> CliError:
    """One line for a failed call: unreachable, or the server's reason and field."""
    code = exc.code() if hasattr(exc, "code") else None
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CliError(f"cannot reach the runtime at {target} ({code.name.lower()})")
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    message = details.splitlines()[0] if details else "no details"
    field = ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_DETAIL_METADATA_KEY:
            detail = common_v1.ErrorDetail.FromString(value)
            field = f" (field {detail.field_path})" if detail.field_path else ""
    return CliError(f"{code.name if code else 'ERROR'}: {message}{field}")


def describe(resp: Any) -> str:
    """The readable report of a ``SubmitWakeSignalResponse`` (or of a read ``WakeSignal``)."""
    submitted = isinstance(resp, runtime_v1.SubmitWakeSignalResponse)
    signal = resp.signal if submitted else resp
    state = _STATES.get(signal.resolution_state, "unknown")
    if not submitted:
        by = f" by dependency {signal.dependency_id}" if signal.dependency_id else ""
        head = f"signal {signal.wake_signal_id}: {state}{by}"
    elif resp.stale:
        head = (
            f"stale: version {signal.wake_version} (token {signal.wake_token}) is already "
            "accepted for this producer key; nothing written"
        )
    elif resp.duplicate:
        head = f"duplicate: token already accepted as {signal.wake_signal_id} ({state})"
    elif state == "consumed":
        head = f"accepted {signal.wake_signal_id}: woke dependency {signal.dependency_id}"
    elif state == "unmatched":
        head = (
            f"accepted {signal.wake_signal_id}: no waiting dependency matched yet "
            "(kept until a wait on this key consumes it, or it expires)"
        )
    else:
        head = f"accepted {signal.wake_signal_id}: {state}"
    lines = [
        head,
        f"  producer  {signal.producer_kind}  key {signal.producer_key}",
        f"  token     {signal.wake_token}  version {signal.wake_version}",
        f"  scope     {signal.org_id} / {signal.app_installation_id} / "
        f"{signal.runtime_capability_id}",
        f"  received  {signal.received_at.ToJsonString()}  "
        f"expires {signal.expires_at.ToJsonString()}",
    ]
    if signal.evidence_json:
        lines.append(f"  evidence  {signal.evidence_json}")
    return "\n".join(lines) + "\n"


def _print(message: Any, as_json: bool, text: str) -> None:
    if as_json:
        print(json_format.MessageToJson(message, preserving_proto_field_name=True, indent=2))
    else:
        sys.stdout.write(text)


def _send(args: argparse.Namespace) -> int:
    _require_scope(args)
    evidence_json, digest = "", args.evidence_digest or ""
    if args.evidence is not None:
        try:
            evidence = parse_evidence(args.evidence)
        except FlowError as exc:
            args.parser.error(f"--evidence: {exc}")
        evidence_json, digest = args.evidence, evidence_digest(evidence)
    elif not digest:
        # No evidence: the digest still names what the producer asserts (the token).
        digest = evidence_digest({"wake_token": args.token})
    request = runtime_v1.SubmitWakeSignalRequest(
        request_id=args.request_id or uuid.uuid4().hex,
        producer_kind=args.producer_kind,
        producer_key=args.producer_key,
        wake_token=args.token,
        wake_version=args.wake_version,
        evidence_digest=digest,
        evidence_reference=args.evidence_reference or "",
        evidence_json=evidence_json,
    )
    md = _metadata(args, (SIGNAL_SUBMIT_ROLE,))
    try:
        with channel_for(args.target) as channel:
            resp = runtime_v1.WakeSignalServiceStub(channel).SubmitWakeSignal(
                request, metadata=md, timeout=args.timeout
            )
    except grpc.RpcError as exc:
        raise _rpc_failure(exc, args.target) from None
    _print(resp, args.json, describe(resp))
    return 0


def _get(args: argparse.Namespace) -> int:
    _require_scope(args)
    request = runtime_v1.GetWakeSignalRequest()
    if args.id:
        request.wake_signal_id = args.id
    elif args.producer_kind and args.producer_key and args.token:
        request.key.CopyFrom(
            runtime_v1.WakeSignalKey(
                producer_kind=args.producer_kind,
                producer_key=args.producer_key,
                wake_token=args.token,
            )
        )
    else:
        args.parser.error("give --id, or --producer-kind, --producer-key and --token")
    md = _metadata(args, ())
    try:
        with channel_for(args.target) as channel:
            resp = runtime_v1.WakeSignalServiceStub(channel).GetWakeSignal(
                request, metadata=md, timeout=args.timeout
            )
    except grpc.RpcError as exc:
        raise _rpc_failure(exc, args.target) from None
    _print(resp, args.json, describe(resp.signal))
    return 0


def register(groups: Any) -> None:
    """Add the ``signal`` command group."""
    group = groups.add_parser("signal", help="submit and read durable wake signals (gRPC)")
    commands = group.add_subparsers(dest="command", required=True)

    send = commands.add_parser("send", help="submit a wake signal (wakes a matching wait)")
    send.add_argument("--producer-kind", required=True, help="e.g. external.signal")
    send.add_argument("--producer-key", required=True, help="the key the wait names")
    send.add_argument("--token", required=True, help="idempotent delivery identity")
    send.add_argument("--wake-version", type=int, default=0, help="monotonic version (0: none)")
    send.add_argument("--evidence", default=None, help="safe evidence: one JSON object")
    send.add_argument("--evidence-digest", default=None, help="digest when sending no evidence")
    send.add_argument("--evidence-reference", default=None, help="pointer to producer evidence")
    send.add_argument("--request-id", default=None, help="transport retry id (default: new)")
    send.add_argument("--timeout", type=float, default=10.0, help="call deadline, seconds")
    send.add_argument("--json", action="store_true", help="print the response message")
    add_connection_args(send, ServiceName.RUNTIME)
    send.set_defaults(func=_send, parser=send)

    get = commands.add_parser("get", help="read a wake signal by id or natural key")
    get.add_argument("--id", default=None, help="wake signal id")
    get.add_argument("--producer-kind", default=None)
    get.add_argument("--producer-key", default=None)
    get.add_argument("--token", default=None)
    get.add_argument("--timeout", type=float, default=10.0, help="call deadline, seconds")
    get.add_argument("--json", action="store_true", help="print the response message")
    add_connection_args(get, ServiceName.RUNTIME)
    get.set_defaults(func=_get, parser=get)
