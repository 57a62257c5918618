"""Documented limits every request is checked against before a servicer sees it.

One walk over the deserialized request, driven by its descriptor, so every RPC — and
every RPC added later — gets the same answer for the same kind of bad input
(``INVALID_ARGUMENT`` naming the field, the value never echoed):

* **identifier and name lengths** (:data:`FIELD_LIMITS`, by field name, documented in
  ``docs/api-contract.md`` and the proto comments): no value reaches a database column
  it does not fit (MariaDB/TiDB would refuse it with an error the client could not
  read); any other string field has :data:`DEFAULT_MAX_CHARS` (``too_long``);
* **enum numbers** the proto does not define (``unknown_enum_value``);
* **timestamps and durations** outside the range protobuf can represent
  (``invalid_timestamp`` / ``invalid_duration``);
* **non-finite numbers** (NaN, ±infinity) — JSON, and so a ``Struct``, cannot hold them
  (``non_finite_number``);
* **nesting**: messages deeper than :data:`MAX_DEPTH` (``too_deep``) — the parser stops
  at its own limit first; this bound also holds for messages built in process.

:class:`RequestLimitsInterceptor` applies it; it sits inside the auth interceptor, so an
unauthenticated request is never inspected (``services.grpc_server``).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
import grpc.aio
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.db import DIGEST_LEN, ID_LEN, KEY_LEN, TOKEN_LEN
from services.errors import (
    Behavior,
    Context,
    InvalidArgumentError,
    call_unary,
    iterate_responses,
    wrap_method_handler,
)

__all__ = [
    "DEFAULT_MAX_CHARS",
    "FIELD_LIMITS",
    "MAX_DEPTH",
    "RequestLimitsInterceptor",
    "check_request",
    "limit_for",
]

#: Longest API name (object, Flow) — the runtime stores them in ``ID_LEN`` columns.
NAME_LEN = ID_LEN
#: Longest field, parameter or relationship name (catalog metadata, record fields).
MEMBER_NAME_LEN = 128
#: Longest display label, picklist value or short free text.
LABEL_LEN = 255
#: Longest string of any field not named in :data:`FIELD_LIMITS`.
DEFAULT_MAX_CHARS = 1024
#: Deepest message nesting accepted (a ``Struct`` nests two levels per level: the Value
#: and the Struct; the wire parser already stops at about 100 message levels, so this
#: bound matters for messages built in process).
MAX_DEPTH = 96

#: Maximum length in characters of each string field, by field name (repeated fields:
#: of each element). ``docs/api-contract.md`` lists the same table; a test keeps them equal.
FIELD_LIMITS: Mapping[str, int] = {
    # identities of trusted scope and of rows
    "org_id": ID_LEN,
    "app_installation_id": ID_LEN,
    "runtime_capability_id": ID_LEN,
    "catalog_generation_id": ID_LEN,
    "catalog_generation_ids": ID_LEN,
    "plan_id": ID_LEN,
    "flow_version_id": ID_LEN,
    "flow_run_id": ID_LEN,
    "record_id": ID_LEN,
    "parent_record_id": ID_LEN,
    "command_id": ID_LEN,
    "wake_signal_id": ID_LEN,
    "step_execution_id": ID_LEN,
    "submission_attempt_id": ID_LEN,
    "runtime_outbox_message_id": ID_LEN,
    "runtime_release_id": ID_LEN,
    "effect_owner_kind": ID_LEN,
    "message_family": ID_LEN,
    "handler_implementation_version": ID_LEN,
    "reason_code": ID_LEN,
    "checkpoint_id": ID_LEN,
    "producer_kind": ID_LEN,
    # content digests and fingerprints
    "runtime_work_binding_digest": DIGEST_LEN,
    "runtime_metadata_view_digest": DIGEST_LEN,
    "catalog_digest": DIGEST_LEN,
    "catalog_snapshot_digest": DIGEST_LEN,
    "plan_digest": DIGEST_LEN,
    "entry_digest": DIGEST_LEN,
    "payload_digest": DIGEST_LEN,
    "evidence_digest": DIGEST_LEN,
    "service_release_digest": DIGEST_LEN,
    "binding_fingerprint": DIGEST_LEN,
    # caller-chosen keys and tokens
    "request_id": TOKEN_LEN,
    "idempotency_key": KEY_LEN,
    "effect_handoff_key": KEY_LEN,
    "producer_key": KEY_LEN,
    "evidence_reference": KEY_LEN,
    "handler_ref": KEY_LEN,
    # operator free text kept in an audit record (PauseRun, RetryQuarantinedRun)
    "reason": KEY_LEN,
    "wake_token": TOKEN_LEN,
    "holder_id": TOKEN_LEN,
    "action_type": TOKEN_LEN,
    "owner_registration_id": TOKEN_LEN,
    "page_token": DEFAULT_MAX_CHARS,
    # map keys and string values (a map's entry message may bound them further,
    # _QUALIFIED_LIMITS)
    "key": DEFAULT_MAX_CHARS,
    "value": DEFAULT_MAX_CHARS,
    # API names
    "flow_api_name": NAME_LEN,
    "flow_api_names": NAME_LEN,
    "object_api_name": NAME_LEN,
    "parent_object_api_name": NAME_LEN,
    "child_object_api_name": NAME_LEN,
    "reference_object_api_name": NAME_LEN,
    "api_name": MEMBER_NAME_LEN,
    "child_field_api_name": MEMBER_NAME_LEN,
    "relationship_name": MEMBER_NAME_LEN,
    "name": MEMBER_NAME_LEN,
    # labels and short text
    "label": LABEL_LEN,
    "picklist_values": LABEL_LEN,
    "key_shape": LABEL_LEN,
    "metadata_path": LABEL_LEN,
    "namespace": LABEL_LEN,
    "partition": LABEL_LEN,
    "record_identity": LABEL_LEN,
    "resource_class": LABEL_LEN,
    "resource_classes": LABEL_LEN,
    "payload_reference": KEY_LEN,
    # expressions and documents (bounded further by their own parsers and byte limits)
    "entry_condition": 10_000,
    "source_json": 2 * 1024 * 1024,
    "input_json": 4 * 1024 * 1024,
    "payload_json": 4 * 1024 * 1024,
    "evidence_json": 16 * 1024,
}

#: Message-qualified overrides (``<full message name>.<field>``) where one field name
#: means two things.
_QUALIFIED_LIMITS: Mapping[str, int] = {
    "nexus.flow.catalog.v1.ObjectSchema.api_name": NAME_LEN,
    # A plan is read by its id or by its digest.
    "nexus.flow.runtime.v1.GetPlanRequest.plan_id": DIGEST_LEN,
    # Record field values and Flow inputs: bounded by the message size and by the
    # metadata view's own rules (max_length), not by a name limit.
    "google.protobuf.Value.string_value": 4 * 1024 * 1024,
    # W3C trace context carried in an outbox envelope (services.telemetry bounds).
    "nexus.flow.common.v1.RuntimeOutboxEnvelope.TraceContextEntry.key": 64,
    "nexus.flow.common.v1.RuntimeOutboxEnvelope.TraceContextEntry.value": 512,
}

_TIMESTAMP = "google.protobuf.Timestamp"
_DURATION = "google.protobuf.Duration"
_MIN_SECONDS, _MAX_SECONDS = -62_135_596_800, 253_402_300_799  # 0001-01-01 .. 9999-12-31
_MAX_DURATION_SECONDS = 315_576_000_000
_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


def limit_for(message_name: str, field_name: str) -> int:
    """The maximum length (characters) of string field ``field_name`` of the message
    whose full name is ``message_name``."""
    qualified = _QUALIFIED_LIMITS.get(f"{message_name}.{field_name}")
    if qualified is not None:
        return qualified
    return FIELD_LIMITS.get(field_name, DEFAULT_MAX_CHARS)


def _refuse(path: str, reason: str, message: str, **attributes: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, reason=reason, field_path=path, attributes=attributes)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_time(message: Message, path: str) -> None:
    seconds, nanos = message.seconds, message.nanos  # type: ignore[attr-defined]
    if message.DESCRIPTOR.full_name == _TIMESTAMP:
        if not (_MIN_SECONDS <= seconds <= _MAX_SECONDS and 0 <= nanos <= 999_999_999):
            raise _refuse(path, "invalid_timestamp", f"{path or 'timestamp'} is out of range")
        return
    if (
        abs(seconds) > _MAX_DURATION_SECONDS
        or abs(nanos) > 999_999_999
        or (seconds > 0 > nanos)
        or (seconds < 0 < nanos)
    ):
        raise _refuse(path, "invalid_duration", f"{path or 'duration'} is out of range")


def _check_scalar(owner: str, field: Any, value: Any, path: str) -> None:
    if field.type == FieldDescriptor.TYPE_STRING:
        limit = limit_for(owner, field.name)
        if len(value) > limit:
            raise _refuse(
                path,
                "too_long",
                f"{field.name} is longer than {limit} characters",
                max_length=str(limit),
            )
    elif field.type == FieldDescriptor.TYPE_ENUM:
        if field.enum_type.values_by_number.get(value) is None:
            raise _refuse(path, "unknown_enum_value", f"{field.name} is not a known value")
    elif field.type in _FLOATS and not math.isfinite(value):
        raise _refuse(path, "non_finite_number", f"{field.name} must be a finite number")


def _check(message: Message, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _refuse(path, "too_deep", f"the request nests deeper than {MAX_DEPTH} levels")
    owner: str = message.DESCRIPTOR.full_name
    if owner in (_TIMESTAMP, _DURATION):
        _check_time(message, path)
        return
    for field, value in message.ListFields():
        here = _join(path, field.name)
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for i, item in enumerate(value):
                    _check_scalar(owner, field, item, f"{here}[{i}]")
            else:
                _check_scalar(owner, field, value, here)
            continue
        entry: Any = field.message_type
        if entry.GetOptions().map_entry:
            _check_map(entry, value, here, depth)
        elif field.is_repeated:
            for i, item in enumerate(value):
                _check(item, f"{here}[{i}]", depth + 1)
        else:
            _check(value, here, depth + 1)


def _check_map(entry: Any, value: Any, path: str, depth: int) -> None:
    key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
    for key, item in value.items():
        shown = str(key) if len(str(key)) <= 64 else "<long key>"
        item_path = f"{path}[{shown}]"
        if key_field.type == FieldDescriptor.TYPE_STRING:
            _check_scalar(entry.full_name, key_field, key, item_path)
        if value_field.type == FieldDescriptor.TYPE_MESSAGE:
            _check(item, item_path, depth + 1)
        else:
            _check_scalar(entry.full_name, value_field, item, item_path)


def check_request(message: object) -> None:
    """Refuse a request that breaks a documented limit (module docstring).

    Raises:
        InvalidArgumentError: naming the field (``field_path``) and the limit; the value
            is never part of the message.
    """
    if isinstance(message, Message):
        _check(message, "", 0)


async def _checked_stream(requests: Any) -> AsyncIterator[Any]:
    async for message in requests:
        check_request(message)
        yield message


class RequestLimitsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Applies :func:`check_request` to every request message (streams message by message).

    Sits inside ``AuthInterceptor`` (an unauthenticated request is never inspected) and
    inside ``ErrorMappingInterceptor`` (its refusals are mapped by the one mapping).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        def wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool) -> Behavior:
            def checked(request: Any) -> Any:
                if request_streaming:
                    return _checked_stream(request)
                check_request(request)
                return request

            if response_streaming:

                async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                    async for item in iterate_responses(behavior, checked(request), context):
                        yield item

                return stream

            async def unary(request: Any, context: Context) -> Any:
                return await call_unary(behavior, checked(request), context)

            return unary

        return wrap_method_handler(handler, wrap)
