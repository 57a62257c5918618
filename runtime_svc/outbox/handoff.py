"""Delivery of ``flow.effect.submit`` to the designated effect owner (spec §10.7, §15.1,
§15.4): the family's ``deliver`` (``AcceptHandoff``) and ``reconcile``
(``RejectIfUnaccepted``).

* Owners are addressed by configuration — ``FLOW_EFFECT_OWNER_TARGETS`` maps the
  message's trusted ``effect_owner_kind`` to a gRPC target — never by anything in Flow
  metadata or the payload. A kind without a target cannot be delivered (and cannot be
  reconciled: acceptance unknown).
* Every call carries the runtime's own workload credential, minted for the message's
  complete work scope (audience ``effect-owner``, role ``effects.handoff.submit``).
* The envelope is rebuilt from the persisted, immutable row; the request ids are
  deterministic per message, so a retry is recognised by the owner's transport dedupe as
  well as by the handoff key.
* ``DELIVERED`` only after an ACCEPTED receipt that matches the row's complete scope,
  handoff key, outbox identity and payload digest; anything else is not an
  acknowledgement. A lost acknowledgement retries the same key.
* Reconciliation passes exactly the four persisted values; ``Accepted`` repairs delivery,
  ``Rejected`` is proven non-acceptance, and a refused or mismatching fence is
  ``AcceptanceUnknown`` — never proof of rejection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import grpc.aio
from google.protobuf.timestamp_pb2 import Timestamp

from services.auth import TrustedRuntimeWorkScope, bearer_metadata
from services.effect_contract import FLOW_EFFECT_SUBMIT_FAMILY_VERSION
from services.metrics import metrics
from services.outbox import (
    AcceptedReceipt,
    Delivered,
    DeliveryResult,
    OutboxMessage,
    ReconcileResult,
    Refused,
    RejectedReceipt,
    RetryLater,
    UnknownReceipt,
)
from services.peer_client import TRANSIENT_STATUS_CODES, rpc_error_reason
from services.proto import common_v1, effect_v1
from services.telemetry import decode_carrier

__all__ = ["EffectHandoff", "envelope_of", "owner_channels", "receipt_matches"]

log = logging.getLogger(__name__)

_TRANSIENT = TRANSIENT_STATUS_CODES
_ACCEPTED = effect_v1.InboxFenceState.INBOX_FENCE_STATE_ACCEPTED
_REJECTED = effect_v1.InboxFenceState.INBOX_FENCE_STATE_REJECTED
_POLICY = {
    "fault_path": common_v1.ExpiryPolicy.EXPIRY_POLICY_FAULT_PATH,
    "terminal_failure": common_v1.ExpiryPolicy.EXPIRY_POLICY_TERMINAL_FAILURE,
    "quarantine": common_v1.ExpiryPolicy.EXPIRY_POLICY_QUARANTINE,
}


def _scope(m: OutboxMessage) -> TrustedRuntimeWorkScope:
    return TrustedRuntimeWorkScope(
        m.org_id, m.app_installation_id, m.runtime_capability_id, m.runtime_work_binding_digest
    )


def _scope_proto(m: OutboxMessage) -> Any:
    return common_v1.TrustedRuntimeWorkScope(
        org_id=m.org_id,
        app_installation_id=m.app_installation_id,
        runtime_capability_id=m.runtime_capability_id,
        runtime_work_binding_digest=m.runtime_work_binding_digest,
    )


def _ts(value: Any) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value.replace(tzinfo=None))
    return ts


def envelope_of(m: OutboxMessage) -> Any:
    """The immutable ``RuntimeOutboxEnvelope`` of a persisted ``flow.effect.submit`` row."""
    extra = m.extra
    envelope = common_v1.RuntimeOutboxEnvelope(
        org_id=m.org_id,
        app_installation_id=m.app_installation_id,
        runtime_capability_id=m.runtime_capability_id,
        runtime_work_binding_digest=m.runtime_work_binding_digest,
        runtime_outbox_message_id=m.message_id,
        message_family=m.family,
        message_family_version=FLOW_EFFECT_SUBMIT_FAMILY_VERSION,
        effect_handoff_key=m.key,
        effect_owner_kind=str(extra["effect_owner_kind"]),
        payload_schema_version=int(extra["payload_schema_version"]),
        payload_digest=m.payload_digest,
        payload_json=m.payload,
        flow_run_id=str(extra.get("flow_run_id") or ""),
        step_execution_id=str(extra.get("step_execution_id") or ""),
        submission_attempt_id=str(extra.get("submission_attempt_id") or ""),
        deadline=_ts(m.deadline),
        failure_policy=_POLICY.get(
            str(extra.get("failure_policy") or ""),
            common_v1.ExpiryPolicy.EXPIRY_POLICY_UNSPECIFIED,
        ),
        enqueued_at=_ts(m.created_at),
    )
    # The step attempt's trace context (diagnostics; outside the digest and the fence).
    envelope.trace_context.update(decode_carrier(m.trace_context))
    return envelope


def receipt_matches(fence: Any, m: OutboxMessage) -> bool:
    """The owner's fence receipt names exactly this message (§10.7)."""
    s = fence.scope
    return bool(
        s.org_id == m.org_id
        and s.app_installation_id == m.app_installation_id
        and s.runtime_capability_id == m.runtime_capability_id
        and s.runtime_work_binding_digest == m.runtime_work_binding_digest
        and fence.effect_handoff_key == m.key
        and fence.runtime_outbox_message_id == m.message_id
        and fence.payload_digest == m.payload_digest
    )


class EffectHandoff:
    """``deliver`` and ``reconcile`` of the ``flow.effect.submit`` family.

    Args:
        channels: gRPC channel of the owner serving an effect owner kind (None: no
            configured owner for that kind).
        credentials: the runtime's credential for a work scope (audience effect-owner,
            role ``effects.handoff.submit``).
        timeout_s: deadline of one call.
    """

    def __init__(
        self,
        channels: Callable[[str], grpc.aio.Channel | None],
        credentials: Callable[[TrustedRuntimeWorkScope], str],
        *,
        timeout_s: float = 10.0,
    ) -> None:
        self._channels = channels
        self._credentials = credentials
        self._timeout = timeout_s

    def _stub(self, m: OutboxMessage) -> Any:
        channel = self._channels(str(m.extra["effect_owner_kind"]))
        return None if channel is None else effect_v1.EffectOwnerServiceStub(channel)

    def _md(self, m: OutboxMessage) -> Any:
        return bearer_metadata(self._credentials(_scope(m)))

    async def deliver(self, m: OutboxMessage) -> DeliveryResult:
        stub = self._stub(m)
        if stub is None:
            return Refused("owner_kind_unroutable")
        request = effect_v1.AcceptHandoffRequest(
            request_id=f"rt-accept-{m.message_id}", scope=_scope_proto(m), envelope=envelope_of(m)
        )
        try:
            resp = await stub.AcceptHandoff(request, metadata=self._md(m), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT:
                return RetryLater(f"owner_{exc.code().name.lower()}"[:32])
            reason = rpc_error_reason(exc) or exc.code().name.lower()
            log.info("owner refused handoff %s: %s", m.message_id, reason)
            return Refused(reason[:32])
        if resp.fence.state != _ACCEPTED or not receipt_matches(resp.fence, m):
            log.warning("owner receipt for %s does not match the message", m.message_id)
            return Refused("receipt_mismatch")
        metrics().effect_accepted(str(m.extra["effect_owner_kind"]), m.created_at)
        return Delivered("owner_accepted")

    async def reconcile(self, m: OutboxMessage) -> ReconcileResult:
        stub = self._stub(m)
        if stub is None:
            return UnknownReceipt("owner_kind_unroutable")
        request = effect_v1.RejectIfUnacceptedRequest(
            request_id=f"rt-reject-{m.message_id}",
            scope=_scope_proto(m),
            effect_handoff_key=m.key,
            payload_digest=m.payload_digest,
            runtime_outbox_message_id=m.message_id,
        )
        try:
            resp = await stub.RejectIfUnaccepted(
                request, metadata=self._md(m), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT:
                return RetryLater(f"fence_{exc.code().name.lower()}"[:32])
            reason = rpc_error_reason(exc) or exc.code().name.lower()
            return UnknownReceipt(f"fence_{reason}"[:32])
        if not receipt_matches(resp.fence, m):
            return UnknownReceipt("receipt_mismatch")
        if resp.fence.state == _ACCEPTED:
            metrics().effect_accepted(str(m.extra["effect_owner_kind"]), m.created_at)
            return AcceptedReceipt("accepted_on_reconcile")
        if resp.fence.state == _REJECTED:
            return RejectedReceipt("owner_rejected")
        return UnknownReceipt("fence_state_unknown")


def owner_channels(
    targets: Mapping[str, str], open_channel: Callable[[str], grpc.aio.Channel]
) -> tuple[Callable[[str], grpc.aio.Channel | None], Callable[[], list[grpc.aio.Channel]]]:
    """Channel lookup by owner kind over ``targets`` (``*`` = any kind), one channel per
    target, plus a function listing the opened channels (to close them)."""
    opened: dict[str, grpc.aio.Channel] = {}

    def channel(kind: str) -> grpc.aio.Channel | None:
        target = targets.get(kind) or targets.get("*")
        if target is None:
            return None
        if target not in opened:
            opened[target] = open_channel(target)
        return opened[target]

    return channel, lambda: list(opened.values())
