"""The one error hierarchy of the services, and its one mapping to gRPC.

Service code raises a subclass of :class:`FlowError`; :class:`ErrorMappingInterceptor`
turns it into a gRPC status. Nothing else builds a status code (CONTRIBUTING.md)::

    FlowError                        INTERNAL            (base; not raised directly)
    ├── InvalidArgumentError         INVALID_ARGUMENT    field_path
    ├── NotFoundError                NOT_FOUND           entity, key
    ├── AlreadyExistsError           ALREADY_EXISTS      entity, key
    ├── ConflictError                ABORTED             entity, key
    │   └── FenceLostError           ABORTED             + expected_version, found_version
    ├── FailedPreconditionError      FAILED_PRECONDITION
    ├── PermissionDeniedError        PERMISSION_DENIED   field_path
    ├── UnauthenticatedError         UNAUTHENTICATED     reason
    ├── ResourceExhaustedError       RESOURCE_EXHAUSTED  retry_after_s      retryable
    ├── UnavailableError             UNAVAILABLE                            retryable
    ├── DeadlineExceededError        DEADLINE_EXCEEDED
    ├── CommitOutcomeUnknownError    UNKNOWN             entity, key
    └── UnimplementedError           UNIMPLEMENTED

Every class carries a class-level ``code`` and ``retryable`` and a default machine
``reason`` (``not_found``, ``fence_lost``, ...). ``retryable`` means "the caller may send
the *same* request again after a backoff"; ``ABORTED`` errors are not retryable in that
sense, the caller re-reads and decides (AIP-194).

``CommitOutcomeUnknownError`` maps to ``UNKNOWN``, the one gRPC code whose meaning is
literally "we cannot say what happened": the connection died during ``COMMIT``, so the
transaction may or may not be durable. ``UNAVAILABLE`` would invite a blind retry
(clients and proxies retry it automatically), ``ABORTED`` would claim nothing was
written, and ``INTERNAL`` would claim a broken invariant. Uncaught exceptions never
surface as ``UNKNOWN`` (they become ``INTERNAL``), so on our servers ``UNKNOWN`` plus
the ``commit_outcome_unknown`` reason identifies this case; it is not retryable
(ARCHITECTURE §2: resolve by reading the marker, never a blind retry).

What reaches the client is only the ``safe_message`` and the structured fields. Put
internal detail in the exception *cause* (``raise NotFoundError(...) from exc``): it is
logged, never sent. Any other exception becomes ``INTERNAL`` with a generic message and
a correlation id that is also written to the log next to the traceback.

Typed detail: ``grpcio-status`` (``grpc-status-details-bin`` with ``google.rpc.Status``)
is not a dependency, so the interceptor attaches the serialized
``nexus.flow.common.v1.ErrorDetail`` as the binary trailing-metadata entry
:data:`ERROR_DETAIL_METADATA_KEY` (``nexus-error-detail-bin``). The generated proto is
imported lazily; when it is not importable the status is sent without the detail.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import cache
from typing import Any, ClassVar, TypeAlias

import grpc
import grpc.aio

__all__ = [
    "ERROR_DETAIL_METADATA_KEY",
    "AlreadyExistsError",
    "CommitOutcomeUnknownError",
    "ConflictError",
    "DeadlineExceededError",
    "ErrorMappingInterceptor",
    "FailedPreconditionError",
    "FenceLostError",
    "FlowError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "call_unary",
    "decode_error_detail",
    "encode_error_detail",
    "iterate_responses",
    "status_for",
    "wrap_method_handler",
]

_log = logging.getLogger(__name__)

#: Binary trailing-metadata key carrying the serialized ``common_v1.ErrorDetail``.
ERROR_DETAIL_METADATA_KEY = "nexus-error-detail-bin"

_INTERNAL_MESSAGE = "internal error"


class FlowError(Exception):
    """Base of every error the services raise on purpose.

    Attributes:
        code: gRPC status code of the class (class-level).
        retryable: whether the same request may be sent again after a backoff.
        reason: stable machine-readable reason in lower snake case, sent as
            ``ErrorDetail.code``; the class default can be narrowed per instance.
        safe_message: the human-readable text sent to the client.
        field_path: request field the error is about (``""`` when none).
        attributes: structured fields sent to the client as ``ErrorDetail.attributes``.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    retryable: ClassVar[bool] = False
    default_message: ClassVar[str] = _INTERNAL_MESSAGE
    reason: str = "internal"

    def __init__(
        self,
        message: str | None = None,
        *,
        reason: str | None = None,
        field_path: str = "",
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        if reason is not None:
            self.reason = reason
        self.safe_message = message or self.default_message
        self.field_path = field_path
        self.attributes: dict[str, str] = dict(attributes or {})
        super().__init__(self.safe_message)


class InvalidArgumentError(FlowError):
    """The request is malformed; ``field_path`` names the offending field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_message = "invalid argument"
    reason = "invalid_argument"


class NotFoundError(FlowError):
    """No such entity *in the caller's trusted scope* (a wrong-scope hit looks the same)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "not_found"

    def __init__(self, entity: str, key: str = "") -> None:
        self.entity, self.key = entity, key
        super().__init__(f"{entity} not found", attributes=_present(entity=entity, key=key))


class AlreadyExistsError(FlowError):
    """An entity with this identity exists and the request must not overwrite it."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "already_exists"

    def __init__(self, entity: str, key: str = "") -> None:
        self.entity, self.key = entity, key
        super().__init__(f"{entity} already exists", attributes=_present(entity=entity, key=key))


class ConflictError(FlowError):
    """A concurrent or earlier write disagrees with this one (e.g. same request id,
    different payload). The caller re-reads; resending the same request will not help."""

    code = grpc.StatusCode.ABORTED
    default_message = "conflict"
    reason = "conflict"

    def __init__(self, message: str | None = None, *, entity: str = "", key: str = "") -> None:
        self.entity, self.key = entity, key
        super().__init__(message, attributes=_present(entity=entity, key=key))


class FenceLostError(ConflictError):
    """A fenced conditional UPDATE matched no row: someone else owns the entity now.

    The attempt is abandoned, never retried (ARCHITECTURE §2, STYLE 7).
    """

    reason = "fence_lost"

    def __init__(
        self, entity: str, key: str, expected_version: int, found_version: int | None
    ) -> None:
        found = "absent" if found_version is None else str(found_version)
        super().__init__(
            f"{entity} fence lost: expected version {expected_version}, found {found}",
            entity=entity,
            key=key,
        )
        self.expected_version, self.found_version = expected_version, found_version
        self.attributes.update(expected_version=str(expected_version), found_version=found)


class FailedPreconditionError(FlowError):
    """The system is not in a state that allows the operation."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_message = "failed precondition"
    reason = "failed_precondition"


class PermissionDeniedError(FlowError):
    """The caller is authenticated but the request is outside its trusted scope."""

    code = grpc.StatusCode.PERMISSION_DENIED
    default_message = "permission denied"
    reason = "permission_denied"


class UnauthenticatedError(FlowError):
    """No valid workload credential; ``reason`` says which check failed."""

    code = grpc.StatusCode.UNAUTHENTICATED
    default_message = "unauthenticated"
    reason = "unauthenticated"


class ResourceExhaustedError(FlowError):
    """Admission or quota refused the request for now; retry after a backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True
    default_message = "resource exhausted"
    reason = "resource_exhausted"

    def __init__(self, message: str | None = None, *, retry_after_s: float | None = None) -> None:
        self.retry_after_s = retry_after_s
        attrs = {} if retry_after_s is None else {"retry_after_s": f"{retry_after_s:g}"}
        super().__init__(message, attributes=attrs)


class UnavailableError(FlowError):
    """A dependency is temporarily unreachable and nothing was committed; retry."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True
    default_message = "service unavailable"
    reason = "unavailable"


class DeadlineExceededError(FlowError):
    """A bounded server-side wait ran out."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_message = "deadline exceeded"
    reason = "deadline_exceeded"


class CommitOutcomeUnknownError(FlowError):
    """The connection was lost during COMMIT: the write may or may not be durable.

    See the module docstring for why this is ``UNKNOWN`` and not retryable.
    """

    code = grpc.StatusCode.UNKNOWN
    default_message = "commit outcome unknown"
    reason = "commit_outcome_unknown"

    def __init__(self, message: str | None = None, *, entity: str = "", key: str = "") -> None:
        self.entity, self.key = entity, key
        super().__init__(message, attributes=_present(entity=entity, key=key))


class UnimplementedError(FlowError):
    """The operation is not supported (yet, or by this profile)."""

    code = grpc.StatusCode.UNIMPLEMENTED
    default_message = "not implemented"
    reason = "unimplemented"


def _present(**fields: str) -> dict[str, str]:
    return {k: v for k, v in fields.items() if v}


def status_for(
    exc: BaseException, *, correlation_id: str | None = None
) -> tuple[grpc.StatusCode, str]:
    """The status code and client-visible message for ``exc``.

    A :class:`FlowError` maps to its class ``code`` and ``safe_message``; anything else to
    ``INTERNAL`` with a generic message (plus the correlation id, when given) so that no
    exception text reaches the client.
    """
    if isinstance(exc, FlowError):
        return exc.code, exc.safe_message
    if correlation_id:
        return grpc.StatusCode.INTERNAL, f"{_INTERNAL_MESSAGE} (correlation id {correlation_id})"
    return grpc.StatusCode.INTERNAL, _INTERNAL_MESSAGE


@cache
def _error_detail_class() -> Any:
    # Lazy: the kernel must import without generated code (and mypy must not need it).
    try:
        return importlib.import_module("services.proto").common_v1.ErrorDetail
    except (ImportError, AttributeError):
        return None


def encode_error_detail(exc: BaseException, *, correlation_id: str | None = None) -> bytes | None:
    """Serialized ``common_v1.ErrorDetail`` for ``exc``, or None without generated protos."""
    detail_cls = _error_detail_class()
    if detail_cls is None:
        return None
    _, message = status_for(exc, correlation_id=correlation_id)
    if isinstance(exc, FlowError):
        detail = detail_cls(
            code=exc.reason,
            message=message,
            retryable=exc.retryable,
            field_path=exc.field_path,
            attributes=exc.attributes,
        )
    else:
        attrs = {"correlation_id": correlation_id} if correlation_id else {}
        detail = detail_cls(code="internal", message=message, retryable=False, attributes=attrs)
    data: bytes = detail.SerializeToString()
    return data


def decode_error_detail(data: bytes) -> tuple[str, str, dict[str, str]] | None:
    """``(code, message, attributes)`` of a serialized ``ErrorDetail`` (a remote's
    :data:`ERROR_DETAIL_METADATA_KEY` trailer), or None when it does not parse."""
    detail_cls = _error_detail_class()
    if detail_cls is None:
        return None
    try:
        detail = detail_cls.FromString(data)
    except Exception:  # a malformed trailer is ignored, never fatal
        return None
    return str(detail.code), str(detail.message), dict(detail.attributes)


# --- handler wrapping (shared with services.auth) ------------------------------------

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Behavior: TypeAlias = Callable[[Any, Context], Any]
#: ``(behavior, request_streaming, response_streaming) -> wrapped behavior``
BehaviorWrapper: TypeAlias = Callable[[Behavior, bool, bool], Behavior]


def wrap_method_handler(
    handler: grpc.RpcMethodHandler, wrap: BehaviorWrapper
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` whose behavior is ``wrap(behavior, req_streaming, resp_streaming)``.

    The wrapper must return an ``async def`` for unary responses and an async generator for
    streaming responses (use :func:`iterate_responses` to call the inner behavior).
    """
    req, resp = handler.request_streaming, handler.response_streaming
    des, ser = handler.request_deserializer, handler.response_serializer
    if not req and not resp:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    elif not req:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    elif not resp:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    else:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    return factory(wrap(behavior, req, resp), des, ser)


async def call_unary(behavior: Behavior, request: Any, context: Context) -> Any:
    """Call a unary-response behavior, awaiting it when it is a coroutine."""
    result = behavior(request, context)
    if inspect.isawaitable(result):
        result = await result
    return result


async def iterate_responses(
    behavior: Behavior, request: Any, context: Context
) -> AsyncIterator[Any]:
    """Yield the responses of a streaming behavior of either aio style.

    An async generator is iterated; a coroutine that writes with ``context.write`` is
    awaited (it yields nothing here). Normalising to an async generator also lets the
    OpenTelemetry interceptor, which only iterates, wrap ``context.write`` servicers such
    as the health ``Watch``.
    """
    result = behavior(request, context)
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    elif inspect.isawaitable(result):
        await result
    else:  # a synchronous iterator
        for item in result:
            yield item


# --- the interceptor ------------------------------------------------------------------


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps exceptions escaping a handler to a gRPC status (see module docstring).

    Install it *outside* every interceptor that may raise :class:`FlowError` from its
    wrapped behavior (``services.auth.AuthInterceptor``), so one function maps all of them.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method

        def wrap(behavior: Behavior, _req: bool, response_streaming: bool) -> Behavior:
            if response_streaming:

                async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                    try:
                        async for item in iterate_responses(behavior, request, context):
                            yield item
                    except Exception as exc:
                        await _abort(context, exc, method)

                return stream

            async def unary(request: Any, context: Context) -> Any:
                try:
                    return await call_unary(behavior, request, context)
                except Exception as exc:
                    await _abort(context, exc, method)

            return unary

        return wrap_method_handler(handler, wrap)


async def _abort(context: Context, exc: Exception, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # the handler already chose its status
    correlation_id: str | None = None
    if isinstance(exc, FlowError):
        if exc.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            _log.warning("%s failed: %s (%s)", method, exc.reason, exc.safe_message, exc_info=exc)
        else:
            _log.debug("%s failed: %s (%s)", method, exc.reason, exc.safe_message)
    else:
        correlation_id = uuid.uuid4().hex
        _log.error(
            "%s raised %s (correlation id %s)",
            method,
            type(exc).__name__,
            correlation_id,
            exc_info=exc,
        )
    code, message = status_for(exc, correlation_id=correlation_id)
    detail = encode_error_detail(exc, correlation_id=correlation_id)
    trailing = ((ERROR_DETAIL_METADATA_KEY, detail),) if detail is not None else ()
    await context.abort(code, message, trailing)
