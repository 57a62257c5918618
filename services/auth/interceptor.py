"""The server side: :class:`AuthInterceptor` and the request-scope check.

See :mod:`services.auth` for the rule :func:`check_request_scope` enforces and for the
interceptor order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.errors import (
    Behavior,
    Context,
    PermissionDeniedError,
    UnauthenticatedError,
    call_unary,
    iterate_responses,
    wrap_method_handler,
)

from .credentials import CredentialVerifier
from .identity import AuthFailure, TrustedIdentity, identity_context, refuse

__all__ = ["EXEMPT_METHOD_PREFIXES", "AuthInterceptor", "check_request_scope"]

#: Methods reachable without a credential.
EXEMPT_METHOD_PREFIXES: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


_SCOPE_COMPONENTS = (
    "org_id",
    "app_installation_id",
    "runtime_capability_id",
    "runtime_work_binding_digest",
)
_SCOPE_CONTAINERS = ("scope", "binding")


def _string_field(message: Message, name: str) -> str:
    fd = message.DESCRIPTOR.fields_by_name.get(name)
    if fd is None or fd.type != FieldDescriptor.TYPE_STRING or fd.is_repeated:
        return ""
    value: str = getattr(message, name)
    return value


def _set_message_field(message: Message, name: str) -> Message | None:
    fd = message.DESCRIPTOR.fields_by_name.get(name)
    if fd is None or fd.type != FieldDescriptor.TYPE_MESSAGE or fd.is_repeated:
        return None
    if not message.HasField(name):
        return None
    sub: Message = getattr(message, name)
    return sub


def _require(value: str, trusted: str | None, field_path: str) -> None:
    if value and value != trusted:
        raise PermissionDeniedError(
            "request scope does not match the caller's credential",
            reason="scope_mismatch",
            field_path=field_path,
        )


def check_request_scope(request: object, identity: TrustedIdentity) -> None:
    """Reject a request whose body names a scope other than the trusted one.

    See the module docstring for the exact rule. Non-protobuf requests pass.

    Raises:
        PermissionDeniedError: with ``field_path`` naming the disagreeing field.
    """
    if not isinstance(request, Message):
        return
    _require(_string_field(request, "org_id"), identity.org_id, "org_id")
    trusted = identity.scope_components()
    for container in _SCOPE_CONTAINERS:
        sub = _set_message_field(request, container)
        if sub is None:
            continue
        for name in _SCOPE_COMPONENTS:
            _require(_string_field(sub, name), trusted[name], f"{container}.{name}")


async def _checked_stream(requests: Any, identity: TrustedIdentity) -> AsyncIterator[Any]:
    async for message in requests:
        check_request_scope(message, identity)
        yield message


def _bearer_credential(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        raise refuse(AuthFailure.MISSING)
    if len(values) > 1 or not isinstance(values[0], str):
        raise refuse(AuthFailure.MALFORMED)
    scheme, _, credential = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise refuse(AuthFailure.MALFORMED)
    return credential.strip()


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every non-exempt RPC and checks its request scope.

    Must sit *inside* ``services.errors.ErrorMappingInterceptor`` (see module docstring).
    """

    def __init__(
        self,
        verifier: CredentialVerifier,
        *,
        exempt_prefixes: Sequence[str] = EXEMPT_METHOD_PREFIXES,
    ) -> None:
        self._verifier = verifier
        self._exempt = tuple(exempt_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        try:
            identity = self._verifier.verify(
                _bearer_credential(handler_call_details.invocation_metadata)
            )
        except UnauthenticatedError as exc:
            return _refusing_handler(handler, exc)
        return wrap_method_handler(handler, _authenticated(identity))


def _authenticated(identity: TrustedIdentity) -> Callable[[Behavior, bool, bool], Behavior]:
    def checked(request: Any, request_streaming: bool) -> Any:
        if request_streaming:
            return _checked_stream(request, identity)
        check_request_scope(request, identity)
        return request

    def wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool) -> Behavior:
        if response_streaming:

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                with identity_context(identity):
                    req = checked(request, request_streaming)
                    async for item in iterate_responses(behavior, req, context):
                        yield item

            return stream

        async def unary(request: Any, context: Context) -> Any:
            with identity_context(identity):
                return await call_unary(behavior, checked(request, request_streaming), context)

        return unary

    return wrap


def _refusing_handler(
    handler: grpc.RpcMethodHandler, exc: UnauthenticatedError
) -> grpc.RpcMethodHandler:
    """A handler of the same shape that raises ``exc``.

    It has no request deserializer: an unauthenticated payload is never parsed.
    """

    async def unary(_request: Any, _context: Any) -> Any:
        raise exc

    async def stream(_request: Any, _context: Any) -> AsyncIterator[Any]:
        raise exc
        yield  # makes this an async generator

    ser = handler.response_serializer
    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, None, ser)
        return grpc.stream_unary_rpc_method_handler(unary, None, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, None, ser)
    return grpc.unary_unary_rpc_method_handler(unary, None, ser)
