"""The one client-side map from a remote gRPC status to this service's errors.

When a service calls another one (runtime → catalog today; runtime → effect owner and
owner → runtime later), a failed call must surface to *our* caller as one of our own
:class:`~services.errors.FlowError` classes, mapped again by our one error interceptor —
never as the remote's raw status, and never as ``INTERNAL`` for something that is the
dependency's state or availability::

    remote status                           raised here (reason)
    NOT_FOUND                               NotFoundError(what, key), or the caller's own
    INVALID_ARGUMENT, OUT_OF_RANGE          InvalidArgumentError     <service>_rejected
    FAILED_PRECONDITION, ALREADY_EXISTS     FailedPreconditionError  <service>_state
    PERMISSION_DENIED                       PermissionDeniedError
    UNAUTHENTICATED                         UnavailableError         <service>_refused_credential
    UNAVAILABLE, DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, ABORTED             UnavailableError         <service>_unavailable
    anything else (INTERNAL, UNKNOWN,
    UNIMPLEMENTED, CANCELLED, DATA_LOSS)    UnavailableError         <service>_failed

``UNAUTHENTICATED`` is our *service* credential being refused — our caller can do
nothing about it and it is not their input, so it reads as the dependency being
unavailable (and is logged by the remote). The remote's safe message is appended only
for the statuses that describe the caller's request, bounded in length; the remote's
``ErrorDetail`` reason, when present, travels as the ``remote_reason`` attribute.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import grpc.aio

from services.errors import (
    ERROR_DETAIL_METADATA_KEY,
    FailedPreconditionError,
    FlowError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    decode_error_detail,
)

__all__ = ["remote_error"]

#: Longest piece of the remote's message carried into ours (characters).
_MAX_REMOTE_DETAIL = 200

_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)


def _remote_reason(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_DETAIL_METADATA_KEY and isinstance(value, bytes):
            detail = decode_error_detail(value)
            return detail[0] if detail is not None else ""
    return ""


def _detail(exc: grpc.aio.AioRpcError) -> str:
    text = (exc.details() or "").strip()
    if len(text) > _MAX_REMOTE_DETAIL:
        text = text[:_MAX_REMOTE_DETAIL] + "…"
    return f": {text}" if text else ""


def remote_error(
    exc: grpc.aio.AioRpcError,
    *,
    service: str,
    what: str,
    key: str = "",
    not_found: Callable[[], FlowError] | None = None,
) -> FlowError:
    """Our error for a failed call to ``service`` about ``what`` (``key``).

    Args:
        exc: the failed call.
        service: the remote service's short name (``catalog``), used in reasons/messages.
        what: the entity the call was about (``CatalogGeneration``, ``metadata view``).
        key: its identity, when it is safe to name.
        not_found: builds the error of a ``NOT_FOUND`` answer when "missing" means
            something else to the caller (default :class:`NotFoundError` of ``what``).
    """
    code = exc.code()
    error: FlowError
    if code == grpc.StatusCode.NOT_FOUND:
        error = not_found() if not_found is not None else NotFoundError(what, key)
    elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        error = InvalidArgumentError(
            f"{service} rejected the {what} request{_detail(exc)}", reason=f"{service}_rejected"
        )
    elif code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
        error = FailedPreconditionError(
            f"{service}: {what} {key}{_detail(exc)}".replace("  ", " "), reason=f"{service}_state"
        )
    elif code == grpc.StatusCode.PERMISSION_DENIED:
        error = PermissionDeniedError(f"{service} refused access to {what} {key}".rstrip())
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        error = UnavailableError(
            f"{service} refused this service's credential", reason=f"{service}_refused_credential"
        )
    elif code in _TRANSIENT:
        error = UnavailableError(
            f"{service} service unavailable ({code.name})", reason=f"{service}_unavailable"
        )
    else:
        error = UnavailableError(
            f"{service} call for {what} failed ({code.name})", reason=f"{service}_failed"
        )
    remote = _remote_reason(exc)
    if remote:
        error.attributes.setdefault("remote_reason", remote[:64])
    return error
