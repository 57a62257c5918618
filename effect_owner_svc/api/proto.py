"""Anti-corruption layer between ``nexus.flow.effect.v1`` messages and owner values.

Decoding validates everything a request asserts before any row is touched; encoding
never emits a payload, only identities, digests and safe codes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from effect_owner_svc.commands.model import AttemptOutcome, CommandState
from effect_owner_svc.commands.records import (
    AttemptRecord,
    CommandRecord,
    FenceRecord,
    ReceiptRecord,
)
from effect_owner_svc.inbox.fence import FenceState, HandoffAttributes
from effect_owner_svc.inbox.store import HandoffRequest
from services.auth import TrustedRuntimeWorkScope
from services.digest import canonical_json
from services.effect_contract import (
    FLOW_EFFECT_SUBMIT_FAMILY,
    FLOW_EFFECT_SUBMIT_FAMILY_VERSION,
    CompletionEvidence,
    EffectContractError,
    effect_payload_digest,
    parse_effect_handoff_key,
)
from services.errors import InvalidArgumentError, PermissionDeniedError
from services.proto import common_v1, effect_v1

__all__ = [
    "MAX_PAGE_SIZE",
    "attributes_from_reject",
    "command_proto",
    "decode_page_token",
    "encode_page_token",
    "fence_proto",
    "handoff_from_request",
    "receipt_proto",
    "states_from_request",
]

MAX_PAGE_SIZE = 500
DEFAULT_PAGE_SIZE = 50
_MAX_ID = 64

_FENCE_STATE = {
    FenceState.ACCEPTED: effect_v1.InboxFenceState.INBOX_FENCE_STATE_ACCEPTED,
    FenceState.REJECTED: effect_v1.InboxFenceState.INBOX_FENCE_STATE_REJECTED,
}
_COMMAND_STATE = {
    s: getattr(effect_v1.CommandState, f"COMMAND_STATE_{s.value}") for s in CommandState
}
_COMMAND_STATE_BACK = {v: k for k, v in _COMMAND_STATE.items()}
_ATTEMPT = {
    a: getattr(effect_v1.RemoteAttemptOutcome, f"REMOTE_ATTEMPT_OUTCOME_{a.value}")
    for a in AttemptOutcome
}
_POLICY = {
    common_v1.ExpiryPolicy.EXPIRY_POLICY_FAULT_PATH: "fault_path",
    common_v1.ExpiryPolicy.EXPIRY_POLICY_TERMINAL_FAILURE: "terminal_failure",
    common_v1.ExpiryPolicy.EXPIRY_POLICY_QUARANTINE: "quarantine",
}


def _ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value.astimezone(UTC).replace(tzinfo=None))
    return ts


def _required(message: Any, name: str, path: str, *, max_len: int = _MAX_ID) -> str:
    value: str = getattr(message, name)
    if not value:
        raise InvalidArgumentError(f"{path} is required", reason="missing_field", field_path=path)
    if len(value) > max_len:
        raise InvalidArgumentError(f"{path} is too long", reason="out_of_range", field_path=path)
    return value


def scope_proto(scope: Any) -> Any:
    return common_v1.TrustedRuntimeWorkScope(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
    )


def _valid_key(key: str, path: str) -> str:
    try:
        parse_effect_handoff_key(key)
    except EffectContractError:
        raise InvalidArgumentError(
            "effect_handoff_key does not follow the EffectHandoffKey grammar",
            reason="malformed_handoff_key",
            field_path=path,
        ) from None
    return key


def handoff_from_request(request: Any, trusted: TrustedRuntimeWorkScope) -> HandoffRequest:
    """Validate an ``AcceptHandoffRequest`` against the trusted scope.

    Raises:
        InvalidArgumentError: a missing, malformed or inconsistent field.
        PermissionDeniedError: the envelope names another work scope.
    """
    if not request.HasField("envelope"):
        raise InvalidArgumentError("envelope is required", field_path="envelope")
    env = request.envelope
    for name in ("org_id", "app_installation_id", "runtime_capability_id"):
        if getattr(env, name) != getattr(trusted, name):
            raise PermissionDeniedError(
                "the envelope's work scope does not match the caller's credential",
                reason="scope_mismatch",
                field_path=f"envelope.{name}",
            )
    if env.runtime_work_binding_digest != trusted.runtime_work_binding_digest:
        raise PermissionDeniedError(
            "the envelope's work scope does not match the caller's credential",
            reason="scope_mismatch",
            field_path="envelope.runtime_work_binding_digest",
        )
    if env.message_family != FLOW_EFFECT_SUBMIT_FAMILY:
        raise InvalidArgumentError(
            f"message_family must be {FLOW_EFFECT_SUBMIT_FAMILY}",
            field_path="envelope.message_family",
        )
    if env.message_family_version != FLOW_EFFECT_SUBMIT_FAMILY_VERSION:
        raise InvalidArgumentError(
            "unsupported message_family_version", field_path="envelope.message_family_version"
        )
    key = _valid_key(
        _required(env, "effect_handoff_key", "envelope.effect_handoff_key", max_len=200),
        "envelope.effect_handoff_key",
    )
    if env.payload_schema_version < 1:
        raise InvalidArgumentError(
            "payload_schema_version must be >= 1", field_path="envelope.payload_schema_version"
        )
    if env.WhichOneof("payload") != "payload_json":
        raise InvalidArgumentError(
            "this owner needs the payload inline (payload_json); references are not resolvable",
            reason="payload_reference_unsupported",
            field_path="envelope.payload_json",
        )
    try:
        payload = json.loads(env.payload_json)
        digest = effect_payload_digest(payload)
    except (ValueError, EffectContractError):
        raise InvalidArgumentError(
            "payload_json must be a JSON object", field_path="envelope.payload_json"
        ) from None
    if digest != env.payload_digest:
        raise InvalidArgumentError(
            "payload_digest is not the digest of payload_json",
            reason="payload_digest_invalid",
            field_path="envelope.payload_digest",
        )
    deadline = None
    if env.HasField("deadline"):
        deadline = env.deadline.ToDatetime().replace(tzinfo=UTC)
    return HandoffRequest(
        attributes=HandoffAttributes(
            org_id=trusted.org_id,
            app_installation_id=trusted.app_installation_id,
            runtime_capability_id=trusted.runtime_capability_id,
            runtime_work_binding_digest=trusted.runtime_work_binding_digest,
            effect_handoff_key=key,
            runtime_outbox_message_id=_required(
                env, "runtime_outbox_message_id", "envelope.runtime_outbox_message_id"
            ),
            payload_digest=digest,
        ),
        effect_owner_kind=_required(env, "effect_owner_kind", "envelope.effect_owner_kind"),
        payload_schema_version=int(env.payload_schema_version),
        payload_json=canonical_json(payload).decode("utf-8"),
        flow_run_id=_required(env, "flow_run_id", "envelope.flow_run_id"),
        step_execution_id=_required(env, "step_execution_id", "envelope.step_execution_id"),
        submission_attempt_id=_required(
            env, "submission_attempt_id", "envelope.submission_attempt_id"
        ),
        deadline=deadline,
        failure_policy=_POLICY.get(env.failure_policy),
    )


def attributes_from_reject(request: Any, trusted: TrustedRuntimeWorkScope) -> HandoffAttributes:
    """Validate a ``RejectIfUnacceptedRequest``: all four persisted values are required —
    an omitted one fails closed before anything is read or written (§15.4).

    Raises:
        InvalidArgumentError: a missing or malformed value.
    """
    if not request.HasField("scope"):
        raise InvalidArgumentError("scope is required", field_path="scope")
    for name in (
        "org_id",
        "app_installation_id",
        "runtime_capability_id",
        "runtime_work_binding_digest",
    ):
        _required(request.scope, name, f"scope.{name}", max_len=100)
    key = _valid_key(
        _required(request, "effect_handoff_key", "effect_handoff_key", max_len=200),
        "effect_handoff_key",
    )
    return HandoffAttributes(
        org_id=trusted.org_id,
        app_installation_id=trusted.app_installation_id,
        runtime_capability_id=trusted.runtime_capability_id,
        runtime_work_binding_digest=trusted.runtime_work_binding_digest,
        effect_handoff_key=key,
        runtime_outbox_message_id=_required(
            request, "runtime_outbox_message_id", "runtime_outbox_message_id"
        ),
        payload_digest=_required(request, "payload_digest", "payload_digest", max_len=100),
    )


def fence_proto(fence: FenceRecord) -> Any:
    a = fence.attributes
    return effect_v1.HandoffFence(
        scope=scope_proto(a),
        effect_handoff_key=a.effect_handoff_key,
        runtime_outbox_message_id=a.runtime_outbox_message_id,
        payload_digest=a.payload_digest,
        state=_FENCE_STATE[fence.state],
        command_id=fence.command_id or "",
        recorded_at=_ts(fence.decided_at),
    )


def _attempt_proto(a: AttemptRecord) -> Any:
    return effect_v1.RemoteAttempt(
        attempt_number=a.attempt_number,
        outcome=_ATTEMPT[a.outcome],
        provider_idempotency_key=a.provider_idempotency_key,
        safe_error_code=a.safe_error_code or "",
        started_at=_ts(a.started_at),
        finished_at=_ts(a.finished_at),
    )


def command_proto(c: CommandRecord, attempts: Sequence[AttemptRecord] = ()) -> Any:
    policy_back = {v: k for k, v in _POLICY.items()}
    return effect_v1.ExternalCommand(
        scope=scope_proto(c),
        command_id=c.command_id,
        effect_handoff_key=c.effect_handoff_key,
        runtime_outbox_message_id=c.runtime_outbox_message_id or "",
        effect_owner_kind=c.effect_owner_kind,
        payload_schema_version=c.payload_schema_version,
        payload_digest=c.payload_digest,
        flow_run_id=c.flow_run_id or "",
        step_execution_id=c.step_execution_id or "",
        submission_attempt_id=c.submission_attempt_id or "",
        state=_COMMAND_STATE[c.state],
        outcome_version=c.outcome_version,
        remote_attempts=[_attempt_proto(a) for a in attempts],
        deadline=_ts(c.deadline),
        accepted_at=_ts(c.created_at),
        updated_at=_ts(c.updated_at),
        failure_policy=policy_back.get(
            c.failure_policy or "", common_v1.ExpiryPolicy.EXPIRY_POLICY_UNSPECIFIED
        ),
        safe_error_code=c.safe_error_code or "",
        result_digest=c.result_digest or "",
    )


_OUTCOME = {
    "SUCCEEDED": effect_v1.CompletionOutcome.COMPLETION_OUTCOME_SUCCEEDED,
    "FAILED": effect_v1.CompletionOutcome.COMPLETION_OUTCOME_FAILED,
    "OUTCOME_UNKNOWN": effect_v1.CompletionOutcome.COMPLETION_OUTCOME_OUTCOME_UNKNOWN,
}


def receipt_proto(r: ReceiptRecord, command: CommandRecord) -> Any:
    evidence = CompletionEvidence.from_json(r.evidence_json)
    return effect_v1.CompletionReceipt(
        scope=scope_proto(r),
        receipt_id=evidence.wake_token,
        command_id=r.command_id,
        effect_handoff_key=r.effect_handoff_key,
        outcome_version=r.outcome_version,
        outcome=_OUTCOME[r.outcome],
        result_digest=evidence.result_digest,
        safe_error_code=evidence.safe_error_code,
        flow_run_id=command.flow_run_id or "",
        step_execution_id=command.step_execution_id or "",
        completed_at=_ts(r.created_at),
        evidence_json=r.evidence_json,
        evidence_digest=r.evidence_digest,
        effect_owner_kind=command.effect_owner_kind,
    )


def states_from_request(values: Sequence[int]) -> list[CommandState]:
    """Command states of a ``ListCommands`` filter.

    Raises:
        InvalidArgumentError: an unknown or unspecified state.
    """
    out = []
    for v in values:
        if v not in _COMMAND_STATE_BACK:
            raise InvalidArgumentError("unknown command state", field_path="states")
        out.append(_COMMAND_STATE_BACK[v])
    return out


def encode_page_token(command: CommandRecord) -> str:
    """An opaque keyset position (the scope filter is always re-applied server side)."""
    raw = json.dumps([command.created_at.isoformat(), command.command_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[datetime, str] | None:
    """The keyset position of ``token`` (None for an empty token).

    Raises:
        InvalidArgumentError: the token is malformed.
    """
    if not token:
        return None
    try:
        at, cid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not isinstance(cid, str):
            raise ValueError
    except (ValueError, TypeError):
        raise InvalidArgumentError("page_token is malformed", field_path="page_token") from None
    return when, cid
