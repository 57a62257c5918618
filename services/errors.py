"""The one error hierarchy of the services, and its one mapping to gRPC.

Service code raises a subclass of :class:`FlowError`; :class:`ErrorMappingInterceptor`
turns it into a gRPC status. Nothing else builds a status code (CONTRIBUTING.md)::

    FlowError                        INTERNAL            (base; not raised directly)
    ├── InvalidArgumentError         INVALID_ARGUMENT    field_path
    ├── OutOfRangeError              OUT_OF_RANGE        field_path
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
    "MAX_DETAIL_BYTES",
    "MAX_STATUS_MESSAGE_BYTES",
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
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "bounded_text",
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

#: Longest status message sent (UTF-8 bytes; gRPC percent-encodes it into a trailer, up to
#: 3x). With :data:`MAX_DETAIL_BYTES` (base64, 4/3x) every refusal fits the 8 KiB of
#: metadata a default client accepts, whatever the request held.
MAX_STATUS_MESSAGE_BYTES = 512
#: Longest serialized ``ErrorDetail`` trailer.
MAX_DETAIL_BYTES = 3072
_MAX_FIELD_PATH = 256
_MAX_ATTRIBUTE_KEY = 128
_MAX_ATTRIBUTE_VALUE = 512


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


class OutOfRangeError(FlowError):
    """A value, or the answer a request asks for, is beyond a documented limit (the
    response would exceed the message size limit, a page would exceed it)."""

    code = grpc.StatusCode.OUT_OF_RANGE
    default_message = "out of range"
    reason = "out_of_range"


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
        return exc.code, bounded_text(exc.safe_message, MAX_STATUS_MESSAGE_BYTES)
    if correlation_id:
        return grpc.StatusCode.INTERNAL, f"{_INTERNAL_MESSAGE} (correlation id {correlation_id})"
    return grpc.StatusCode.INTERNAL, _INTERNAL_MESSAGE


def bounded_text(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes (on a character boundary), with an
    ellipsis when cut: what the services send back never grows with the request."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    cut = data[: max(0, max_bytes - 3)].decode("utf-8", errors="ignore")
    return cut + "…"


@cache
def _error_detail_class() -> Any:
    # Lazy: the kernel must import without generated code (and mypy must not need it).
    try:
        return importlib.import_module("services.proto").common_v1.ErrorDetail
    except (ImportError, AttributeError):
        return None


def encode_error_detail(exc: BaseException, *, correlation_id: str | None = None) -> bytes | None:
    """Serialized ``common_v1.ErrorDetail`` for ``exc``, or None without generated protos.

    Bounded: the field path, every attribute and their number are cut so the serialized
    detail stays within :data:`MAX_DETAIL_BYTES` (a ``truncated`` attribute says how many
    attributes were left out).
    """
    detail_cls = _error_detail_class()
    if detail_cls is None:
        return None
    _, message = status_for(exc, correlation_id=correlation_id)
    if isinstance(exc, FlowError):
        detail = detail_cls(
            code=bounded_text(exc.reason, _MAX_ATTRIBUTE_KEY),
            message=message,
            retryable=exc.retryable,
            field_path=bounded_text(exc.field_path, _MAX_FIELD_PATH),
        )
        attributes = exc.attributes
    else:
        detail = detail_cls(code="internal", message=message, retryable=False)
        attributes = {"correlation_id": correlation_id} if correlation_id else {}
    left_out = 0
    for key in sorted(attributes):
        k = bounded_text(str(key), _MAX_ATTRIBUTE_KEY)
        v = bounded_text(str(attributes[key]), _MAX_ATTRIBUTE_VALUE)
        too_big = detail.ByteSize() + len(k.encode()) + len(v.encode()) + 16 > MAX_DETAIL_BYTES - 64
        if too_big or k in detail.attributes:  # a cut key may collide with a kept one
            left_out += 1
            continue
        detail.attributes[k] = v
    if left_out:
        detail.attributes["truncated"] = f"{left_out} more attributes left out"
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
    handler: grpc.RpcMethodHandler,
    wrap: BehaviorWrapper,
    deserializer: Callable[[Callable[[bytes], Any]], Callable[[bytes], Any]] | None = None,
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` whose behavior is ``wrap(behavior, req_streaming, resp_streaming)``.

    The wrapper must return an ``async def`` for unary responses and an async generator for
    streaming responses (use :func:`iterate_responses` to call the inner behavior).
    ``deserializer``, when given, wraps the handler's request deserializer (if it has one).
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
    if deserializer is not None and des is not None:
        des = deserializer(des)
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


class _MalformedRequest:
    """What a request that does not parse as its message becomes (see the interceptor)."""

    __slots__ = ()


_MALFORMED = _MalformedRequest()


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserialize`` that returns :data:`_MALFORMED` instead of raising.

    gRPC answers a request deserializer's exception itself, as ``UNKNOWN`` or ``INTERNAL``
    with the parser's text; marking the request lets the wrapped behavior refuse it as
    ``INVALID_ARGUMENT`` through the one mapping instead.
    """

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # not a message, invalid UTF-8, nesting beyond the parser limit
            return _MALFORMED

    return parse


def _malformed() -> InvalidArgumentError:
    return InvalidArgumentError(
        "the request is not a well-formed message of this RPC (wire format, UTF-8 or "
        "nesting depth)",
        reason="malformed_request",
    )


async def _checked_requests(requests: Any) -> AsyncIterator[Any]:
    async for message in requests:
        if message is _MALFORMED:
            raise _malformed()
        yield message


def _response_size(response: Any) -> int:
    size = getattr(response, "ByteSize", None)
    return int(size()) if callable(size) else 0


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps exceptions escaping a handler to a gRPC status (see module docstring).

    Install it *outside* every interceptor that may raise :class:`FlowError` from its
    wrapped behavior (``services.auth.AuthInterceptor``), so one function maps all of them.

    It also keeps two transport failures from reaching a client as such: a request that
    does not deserialize becomes ``INVALID_ARGUMENT`` (``malformed_request``), and a
    protobuf response larger than ``max_response_bytes`` (the server's send limit) becomes
    ``OUT_OF_RANGE`` (``response_too_large``) instead of a stream reset.

    Args:
        max_response_bytes: the largest response sent (``None``: not checked).
    """

    def __init__(self, max_response_bytes: int | None = None) -> None:
        self._max_response = max_response_bytes

    def _check_size(self, response: Any) -> Any:
        if self._max_response is not None and _response_size(response) > self._max_response:
            raise OutOfRangeError(
                "the response would exceed the message size limit of "
                f"{self._max_response} bytes; ask for less (a smaller page, fewer items)",
                reason="response_too_large",
                attributes={"max_message_bytes": str(self._max_response)},
            )
        return response

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        check_size = self._check_size

        def wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool) -> Behavior:
            def checked(request: Any) -> Any:
                if request_streaming:
                    return _checked_requests(request)
                if request is _MALFORMED:
                    raise _malformed()
                return request

            if response_streaming:

                async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                    try:
                        req = checked(request)
                        async for item in iterate_responses(behavior, req, context):
                            yield check_size(item)
                    except Exception as exc:
                        await _abort(context, exc, method)

                return stream

            async def unary(request: Any, context: Context) -> Any:
                try:
                    return check_size(await call_unary(behavior, checked(request), context))
                except Exception as exc:
                    await _abort(context, exc, method)

            return unary

        return wrap_method_handler(handler, wrap, _tolerant)


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
