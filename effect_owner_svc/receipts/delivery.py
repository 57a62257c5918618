"""Delivery of completion receipts to the runtime's ``WakeSignalService`` (§15.2, §14.1).

The ``effect.completion.receipt`` family of the owner outbox: one ``SubmitWakeSignal``
call per message with the owner's own workload credential (audience ``runtime``, role
``flow.signals.submit``, minted for the receipt's complete work scope). The message is
delivered only when the runtime's response names the signal it durably committed for
exactly this producer kind, key and wake token; a lost response retries the same
request (same ``request_id``, same wake token) and the runtime deduplicates on the
token. Unavailable / not-yet-implemented runtimes are retried within the family's
budget; a refusal (invalid, permission, conflicting token) dead-letters the message for
an operator — the runtime's dependency expiry covers a Flow that never hears back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from services.auth import TrustedRuntimeWorkScope, bearer_metadata
from services.outbox import Delivered, DeliveryResult, OutboxMessage, Refused, RetryLater
from services.peer_client import TRANSIENT_STATUS_CODES, rpc_error_reason
from services.proto import common_v1, runtime_v1

__all__ = ["WakeSignalDelivery", "wake_request"]

log = logging.getLogger(__name__)

_RETRY_CODES = TRANSIENT_STATUS_CODES


def _scope(message: OutboxMessage) -> TrustedRuntimeWorkScope:
    return TrustedRuntimeWorkScope(
        message.org_id,
        message.app_installation_id,
        message.runtime_capability_id,
        message.runtime_work_binding_digest,
    )


def wake_request(message: OutboxMessage) -> Any:
    """The ``SubmitWakeSignalRequest`` of a receipt message (deterministic request id)."""
    doc = json.loads(message.payload)
    return runtime_v1.SubmitWakeSignalRequest(
        request_id=f"eo-{message.message_id}",
        scope=common_v1.TrustedRuntimeWorkScope(
            org_id=message.org_id,
            app_installation_id=message.app_installation_id,
            runtime_capability_id=message.runtime_capability_id,
            runtime_work_binding_digest=message.runtime_work_binding_digest,
        ),
        producer_kind=doc["producer_kind"],
        producer_key=doc["producer_key"],
        wake_token=doc["wake_token"],
        wake_version=int(doc["wake_version"]),
        evidence_digest=doc["evidence_digest"],
        evidence_json=doc["evidence_json"],
    )


class WakeSignalDelivery:
    """The ``deliver`` of the receipt family (see the module docstring).

    Args:
        channel: channel to the runtime.
        credentials: per-scope credentials (audience runtime, role flow.signals.submit).
        timeout_s: deadline of one call.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        credentials: Callable[[TrustedRuntimeWorkScope], str],
        *,
        timeout_s: float = 10.0,
    ) -> None:
        self._stub = runtime_v1.WakeSignalServiceStub(channel)
        self._credentials = credentials
        self._timeout = timeout_s

    async def __call__(self, message: OutboxMessage) -> DeliveryResult:
        request = wake_request(message)
        try:
            response = await self._stub.SubmitWakeSignal(
                request,
                metadata=bearer_metadata(self._credentials(_scope(message))),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _RETRY_CODES:
                return RetryLater(f"runtime_{code.name.lower()}"[:32])
            log.warning(
                "runtime refused receipt %s: %s %s",
                message.key,
                code.name,
                rpc_error_reason(exc),
            )
            return Refused(f"runtime_{code.name.lower()}"[:32])
        signal = response.signal
        matches = (
            signal.producer_kind == request.producer_kind
            and signal.producer_key == request.producer_key
            and signal.wake_token == request.wake_token
            and signal.org_id == message.org_id
            and signal.app_installation_id == message.app_installation_id
            and signal.runtime_capability_id == message.runtime_capability_id
            and signal.runtime_work_binding_digest == message.runtime_work_binding_digest
        )
        if not matches:
            # An acknowledgement for something else is not an acknowledgement.
            return RetryLater("runtime_ack_mismatch")
        return Delivered("wake_signal_committed")
