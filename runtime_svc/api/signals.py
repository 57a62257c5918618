"""``nexus.flow.runtime.v1.WakeSignalService``: the gRPC face of
:class:`runtime_svc.waits.SignalService` (§10.6, §14.2).

The producer's trusted work scope is the credential's complete scope, checked against
its persisted binding (the catalog's ``GetWorkBinding``, through the same view source the
record service uses) — never a body field: the auth interceptor already refused a body
``scope`` that disagrees. ``SubmitWakeSignal`` also needs the role
``flow.signals.submit``; a retry with the same ``request_id`` replays the original answer
(``services.request_dedupe``, keyed by the complete scope). A signal of another scope
answers ``NOT_FOUND`` exactly like a missing one. Servicer methods are thin: decode →
service → encode.
"""

from __future__ import annotations

from typing import Any, Protocol

from runtime_svc.api.definitions_proto import timestamp
from runtime_svc.kernel.wait_model import (
    DependencyRecord,
    ExpiryPolicyCode,
    SignalRecord,
    WorkScopeKey,
)
from runtime_svc.waits.evidence import SignalSubmission
from runtime_svc.waits.registry import SIGNAL_SUBMIT_ROLE
from runtime_svc.waits.signals import SignalService, SubmitOutcome
from runtime_svc.waits.support import DependencySupport
from services.auth import TrustedRuntimeWorkScope, current_identity
from services.errors import InvalidArgumentError, PermissionDeniedError
from services.grpc_server import ServiceRegistration
from services.proto import common_v1, runtime_v1
from services.request_dedupe import DedupeScope, RequestKey

__all__ = [
    "SERVICE_NAME",
    "BindingCheck",
    "WakeSignalServicer",
    "dependency_proto",
    "encode_submit_response",
    "signal_proto",
    "wake_signal_registration",
]

SERVICE_NAME = "nexus.flow.runtime.v1.WakeSignalService"

Context = Any  # grpc.aio.ServicerContext

_EXPIRY = {
    ExpiryPolicyCode.FAULT_PATH: common_v1.ExpiryPolicy.EXPIRY_POLICY_FAULT_PATH,
    ExpiryPolicyCode.TERMINAL_FAILURE: common_v1.ExpiryPolicy.EXPIRY_POLICY_TERMINAL_FAILURE,
    ExpiryPolicyCode.QUARANTINE: common_v1.ExpiryPolicy.EXPIRY_POLICY_QUARANTINE,
}


class BindingCheck(Protocol):
    """Confirms a credential's work scope names a persisted binding (the record
    service's view source satisfies it: ``view_for`` reads the binding first)."""

    async def view_for(self, scope: TrustedRuntimeWorkScope) -> Any:
        """Raises ``FailedPreconditionError`` when no binding exists for ``scope``."""
        ...


def _ev(value: int) -> Any:
    # The wait enums carry the proto numbers; generated fields want ``ValueType``.
    return int(value)


def signal_proto(s: SignalRecord) -> Any:
    """``runtime_v1.WakeSignal``."""
    return runtime_v1.WakeSignal(
        org_id=s.scope.org_id,
        app_installation_id=s.scope.app_installation_id,
        runtime_capability_id=s.scope.runtime_capability_id,
        runtime_work_binding_digest=s.scope.runtime_work_binding_digest,
        wake_signal_id=s.wake_signal_id,
        producer_kind=s.producer_kind,
        producer_key=s.producer_key,
        wake_token=s.wake_token,
        wake_version=s.wake_version or 0,
        evidence_digest=s.evidence_digest,
        evidence_reference=s.evidence_reference or "",
        received_at=timestamp(s.received_at),
        expires_at=timestamp(s.expires_at),
        resolution_state=_ev(s.state),
        dependency_id=s.dependency_id or "",
        state_version=s.state_version,
        evidence_json=s.evidence_json or "",
        consumed_at=timestamp(s.consumed_at),
    )


def dependency_proto(support: DependencySupport) -> Any:
    """``runtime_v1.Dependency`` with the support read's age, probes and consumed signal."""
    d: DependencyRecord = support.dependency
    age = runtime_v1.Dependency().age
    age.FromTimedelta(support.age)
    return runtime_v1.Dependency(
        org_id=d.scope.org_id,
        app_installation_id=d.scope.app_installation_id,
        runtime_capability_id=d.scope.runtime_capability_id,
        runtime_work_binding_digest=d.scope.runtime_work_binding_digest,
        dependency_id=d.dependency_id,
        flow_run_id=d.flow_run_id,
        step_execution_id=d.step_execution_id,
        producer_kind=d.producer_kind,
        producer_key=d.producer_key,
        condition_digest=d.condition_digest,
        state=_ev(d.state),
        wake_version=d.wake_version or 0,
        wake_token=d.wake_token or "",
        deadline=timestamp(d.deadline),
        next_probe_at=timestamp(d.next_probe_at),
        expiry_policy=_EXPIRY[d.expiry_policy],
        resolved_at=timestamp(d.resolved_at),
        resolution_receipt=d.resolution_receipt or "",
        state_version=d.state_version,
        created_at=timestamp(d.created_at),
        reconciliation_attempts=d.reconciliation_attempts,
        age=age,
        consumed_signal=None
        if support.consumed_signal is None
        else signal_proto(support.consumed_signal),
        plan_step_key=support.plan_step_key,
    )


def encode_submit_response(outcome: SubmitOutcome) -> bytes:
    """The recorded ``SubmitWakeSignalResponse`` of an outcome (the request ledger's)."""
    msg = runtime_v1.SubmitWakeSignalResponse(
        signal=signal_proto(outcome.signal), duplicate=outcome.duplicate, stale=outcome.stale
    )
    return bytes(msg.SerializeToString(deterministic=True))


def _scope(scope: TrustedRuntimeWorkScope) -> WorkScopeKey:
    return WorkScopeKey(
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )


class WakeSignalServicer(runtime_v1.WakeSignalServiceServicer):
    """``SubmitWakeSignal`` and ``GetWakeSignal``.

    Args:
        service: the signal service.
        bindings: the persisted-binding check of the caller's work scope (``None``: the
            credential's scope is trusted as is — tests of the service layer only).
    """

    def __init__(self, service: SignalService, bindings: BindingCheck | None) -> None:
        self._svc = service
        self._bindings = bindings

    async def _trusted_scope(self) -> WorkScopeKey:
        scope = current_identity().require_work_scope()
        if self._bindings is not None:
            await self._bindings.view_for(scope)  # no persisted binding: refused
        return _scope(scope)

    async def SubmitWakeSignal(self, request: Any, context: Context) -> Any:
        identity = current_identity()
        # Validates request_id; the dedupe scope is the credential's complete scope.
        key = RequestKey.of(DedupeScope.of_identity(identity), "SubmitWakeSignal", request)
        if SIGNAL_SUBMIT_ROLE not in identity.roles:
            raise PermissionDeniedError(
                f"the workload credential may not submit wake signals "
                f"(role {SIGNAL_SUBMIT_ROLE} missing)",
                reason="role_missing",
            )
        scope = await self._trusted_scope()
        data = await self._svc.submit_once(
            scope,
            SignalSubmission(
                producer_kind=request.producer_kind,
                producer_key=request.producer_key,
                wake_token=request.wake_token,
                wake_version=request.wake_version,
                evidence_digest=request.evidence_digest,
                evidence_reference=request.evidence_reference,
                evidence_json=request.evidence_json,
            ),
            key,
            encode_submit_response,
        )
        return runtime_v1.SubmitWakeSignalResponse.FromString(data)

    async def GetWakeSignal(self, request: Any, context: Context) -> Any:
        scope = await self._trusted_scope()
        which = request.WhichOneof("lookup")
        if which == "wake_signal_id" and request.wake_signal_id:
            signal = await self._svc.get(scope, wake_signal_id=request.wake_signal_id)
        elif which == "key" and request.key.producer_kind:
            k = request.key
            if not (k.producer_key and k.wake_token):
                raise InvalidArgumentError(
                    "key needs producer_kind, producer_key and wake_token", field_path="key"
                )
            signal = await self._svc.get(
                scope, natural_key=(k.producer_kind, k.producer_key, k.wake_token)
            )
        else:
            raise InvalidArgumentError("wake_signal_id or key is required", field_path="lookup")
        return runtime_v1.GetWakeSignalResponse(signal=signal_proto(signal))


def wake_signal_registration(
    service: SignalService, bindings: BindingCheck | None
) -> ServiceRegistration:
    """The WakeSignalService registration for ``runtime_svc.app.build_services``."""
    return ServiceRegistration(
        SERVICE_NAME,
        runtime_v1.add_WakeSignalServiceServicer_to_server,
        WakeSignalServicer(service, bindings),
    )
