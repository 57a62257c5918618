"""The error hierarchy, ``status_for`` and the error-mapping interceptor (no network)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from services import errors
from services.errors import (
    ERROR_DETAIL_METADATA_KEY,
    AlreadyExistsError,
    CommitOutcomeUnknownError,
    ConflictError,
    DeadlineExceededError,
    ErrorMappingInterceptor,
    FailedPreconditionError,
    FenceLostError,
    FlowError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    status_for,
)

SC = grpc.StatusCode

# (instance, code, retryable, reason)
CASES: list[tuple[FlowError, grpc.StatusCode, bool, str]] = [
    (
        InvalidArgumentError("bad", field_path="entry.name"),
        SC.INVALID_ARGUMENT,
        False,
        "invalid_argument",
    ),
    (OutOfRangeError("too big"), SC.OUT_OF_RANGE, False, "out_of_range"),
    (NotFoundError("FlowRun", "run-1"), SC.NOT_FOUND, False, "not_found"),
    (AlreadyExistsError("Plan", "p-1"), SC.ALREADY_EXISTS, False, "already_exists"),
    (ConflictError("payload differs"), SC.ABORTED, False, "conflict"),
    (FenceLostError("FlowRun", "run-1", 3, 4), SC.ABORTED, False, "fence_lost"),
    (FailedPreconditionError("sealed"), SC.FAILED_PRECONDITION, False, "failed_precondition"),
    (PermissionDeniedError("no"), SC.PERMISSION_DENIED, False, "permission_denied"),
    (UnauthenticatedError("who"), SC.UNAUTHENTICATED, False, "unauthenticated"),
    (
        ResourceExhaustedError("full", retry_after_s=2),
        SC.RESOURCE_EXHAUSTED,
        True,
        "resource_exhausted",
    ),
    (UnavailableError("db down"), SC.UNAVAILABLE, True, "unavailable"),
    (DeadlineExceededError("slow"), SC.DEADLINE_EXCEEDED, False, "deadline_exceeded"),
    (
        CommitOutcomeUnknownError(entity="FlowRun", key="r"),
        SC.UNKNOWN,
        False,
        "commit_outcome_unknown",
    ),
    (UnimplementedError("later"), SC.UNIMPLEMENTED, False, "unimplemented"),
]


def test_every_concrete_class_is_covered() -> None:
    def subclasses(cls: type) -> set[type]:
        out = set(cls.__subclasses__())
        for sub in cls.__subclasses__():
            out |= subclasses(sub)
        return out

    # Only the kernel's own hierarchy: services define narrower subclasses of these.
    kernel = {c for c in subclasses(FlowError) if c.__module__ == FlowError.__module__}
    assert {type(e) for e, *_ in CASES} == kernel


@pytest.mark.parametrize(
    ("exc", "code", "retryable", "reason"), CASES, ids=lambda v: type(v).__name__
)
def test_status_for_each_class(
    exc: FlowError, code: grpc.StatusCode, retryable: bool, reason: str
) -> None:
    assert status_for(exc) == (code, exc.safe_message)
    assert type(exc).code is code
    assert exc.retryable is retryable
    assert exc.reason == reason
    assert str(exc) == exc.safe_message


def test_structured_fields() -> None:
    fence = FenceLostError("FlowRun", "run-1", expected_version=3, found_version=None)
    assert isinstance(fence, ConflictError)
    assert (fence.entity, fence.key, fence.expected_version, fence.found_version) == (
        "FlowRun",
        "run-1",
        3,
        None,
    )
    assert fence.attributes == {
        "entity": "FlowRun",
        "key": "run-1",
        "expected_version": "3",
        "found_version": "absent",
    }
    assert "expected version 3" in fence.safe_message
    assert NotFoundError("FlowRun", "r-9").attributes == {"entity": "FlowRun", "key": "r-9"}
    assert InvalidArgumentError("bad", field_path="a.b").field_path == "a.b"
    assert ResourceExhaustedError(retry_after_s=1.5).attributes == {"retry_after_s": "1.5"}
    assert PermissionDeniedError(reason="scope_mismatch").reason == "scope_mismatch"
    assert PermissionDeniedError().reason == "permission_denied"  # class default untouched


def test_unknown_exception_is_internal_without_leaking() -> None:
    code, message = status_for(RuntimeError("password=hunter2 at db.internal:3306"))
    assert code is SC.INTERNAL
    assert "hunter2" not in message and "db.internal" not in message
    code, message = status_for(KeyError("secret"), correlation_id="abc123")
    assert code is SC.INTERNAL
    assert "abc123" in message and "secret" not in message


# --- interceptor, driven without a network ------------------------------------------


def _error_detail_class() -> Any:
    """A stand-in for ``common_v1.ErrorDetail`` with the same fields."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="nexus_test_error_detail.proto", package="nexustest", syntax="proto3"
    )
    msg = fdp.message_type.add(name="ErrorDetail")
    f = descriptor_pb2.FieldDescriptorProto
    for number, (name, ftype) in enumerate(
        [
            ("code", f.TYPE_STRING),
            ("message", f.TYPE_STRING),
            ("retryable", f.TYPE_BOOL),
            ("field_path", f.TYPE_STRING),
        ],
        start=1,
    ):
        msg.field.add(name=name, number=number, type=ftype, label=f.LABEL_OPTIONAL)
    entry = msg.nested_type.add(name="AttributesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    msg.field.add(
        name="attributes",
        number=5,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_REPEATED,
        type_name=".nexustest.ErrorDetail.AttributesEntry",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("nexustest.ErrorDetail"))


ErrorDetail = _error_detail_class()


@pytest.fixture
def detail_proto(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(errors, "_error_detail_class", lambda: ErrorDetail)
    return ErrorDetail


class Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...] = ()


class FakeContext:
    """Records ``abort`` the way the aio context behaves: it raises ``AbortError``."""

    def __init__(self) -> None:
        self.aborts: list[tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]] = []

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        self.aborts.append((code, details, tuple(trailing_metadata)))
        raise grpc.aio.AbortError()


async def _intercept(handler: grpc.RpcMethodHandler | None) -> Any:
    async def continuation(_details: Any) -> Any:
        return handler

    return await ErrorMappingInterceptor().intercept_service(
        continuation, Details("/nexus.test.v1.T/M")
    )


async def _call_unary(behavior: Any) -> tuple[Any, FakeContext]:
    wrapped = await _intercept(grpc.unary_unary_rpc_method_handler(behavior))
    ctx = FakeContext()
    try:
        return await wrapped.unary_unary("req", ctx), ctx
    except grpc.aio.AbortError:
        return None, ctx


async def test_success_passes_through() -> None:
    async def ok(request: str, _ctx: Any) -> str:
        return request + "!"

    result, ctx = await _call_unary(ok)
    assert result == "req!" and ctx.aborts == []


async def test_unknown_method_stays_unknown() -> None:
    assert await _intercept(None) is None


async def test_flow_error_maps_to_status_and_typed_detail(detail_proto: Any) -> None:
    async def lost(_r: Any, _c: Any) -> None:
        raise FenceLostError("FlowRun", "run-7", 2, 5)

    _, ctx = await _call_unary(lost)
    [(code, message, trailing)] = ctx.aborts
    assert code is SC.ABORTED
    assert message == "FlowRun fence lost: expected version 2, found 5"
    [(key, raw)] = trailing
    assert key == ERROR_DETAIL_METADATA_KEY
    detail = detail_proto.FromString(raw)
    assert (detail.code, detail.retryable) == ("fence_lost", False)
    assert dict(detail.attributes) == {
        "entity": "FlowRun",
        "key": "run-7",
        "expected_version": "2",
        "found_version": "5",
    }


async def test_field_path_and_retryable_reach_the_detail(detail_proto: Any) -> None:
    async def bad(_r: Any, _c: Any) -> None:
        raise InvalidArgumentError("name too long", field_path="entry.name")

    async def busy(_r: Any, _c: Any) -> None:
        raise UnavailableError()

    _, ctx = await _call_unary(bad)
    detail = detail_proto.FromString(ctx.aborts[0][2][0][1])
    assert (detail.code, detail.field_path, detail.message) == (
        "invalid_argument",
        "entry.name",
        "name too long",
    )
    _, ctx = await _call_unary(busy)
    assert ctx.aborts[0][0] is SC.UNAVAILABLE
    assert detail_proto.FromString(ctx.aborts[0][2][0][1]).retryable is True


async def test_no_detail_without_generated_protos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "_error_detail_class", lambda: None)

    async def missing(_r: Any, _c: Any) -> None:
        raise NotFoundError("FlowRun", "x")

    _, ctx = await _call_unary(missing)
    assert ctx.aborts == [(SC.NOT_FOUND, "FlowRun not found", ())]


async def test_unexpected_exception_is_internal_with_correlation_id(
    detail_proto: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def boom(_r: Any, _c: Any) -> None:
        raise RuntimeError("password=hunter2")

    with caplog.at_level(logging.ERROR, logger="services.errors"):
        _, ctx = await _call_unary(boom)
    [(code, message, trailing)] = ctx.aborts
    assert code is SC.INTERNAL
    assert "hunter2" not in message and "RuntimeError" not in message
    detail = detail_proto.FromString(trailing[0][1])
    assert detail.code == "internal" and "hunter2" not in detail.message
    correlation_id = detail.attributes["correlation_id"]
    assert correlation_id in message
    # The log has the id next to the real exception, for the operator.
    [record] = caplog.records
    assert correlation_id in record.getMessage()
    assert record.exc_info is not None and "hunter2" in str(record.exc_info[1])


async def test_abort_from_the_handler_is_not_remapped() -> None:
    async def aborts(_r: Any, ctx: Any) -> None:
        await ctx.abort(SC.NOT_FOUND, "gone")

    _, ctx = await _call_unary(aborts)
    assert ctx.aborts == [(SC.NOT_FOUND, "gone", ())]


async def test_streaming_error_after_first_message() -> None:
    async def gen(_r: Any, _c: Any) -> AsyncIterator[int]:
        yield 1
        raise ConflictError("moved on")

    wrapped = await _intercept(grpc.unary_stream_rpc_method_handler(gen))
    ctx, got = FakeContext(), []
    with pytest.raises(grpc.aio.AbortError):
        async for item in wrapped.unary_stream("req", ctx):
            got.append(item)
    assert got == [1]
    assert [(c, m) for c, m, _ in ctx.aborts] == [(SC.ABORTED, "moved on")]


async def test_streaming_writer_style_handler_is_supported() -> None:
    written: list[int] = []

    class WriterContext(FakeContext):
        async def write(self, message: int) -> None:
            written.append(message)

    async def writer(_r: Any, ctx: Any) -> None:  # context.write style, like health Watch
        await ctx.write(7)
        raise UnavailableError()

    wrapped = await _intercept(grpc.unary_stream_rpc_method_handler(writer))
    ctx = WriterContext()
    with pytest.raises(grpc.aio.AbortError):
        async for _ in wrapped.unary_stream("req", ctx):
            pass
    assert written == [7]
    assert ctx.aborts[0][0] is SC.UNAVAILABLE


def test_status_message_and_detail_are_bounded_whatever_the_error_holds() -> None:
    from services.errors import (
        MAX_DETAIL_BYTES,
        MAX_STATUS_MESSAGE_BYTES,
        bounded_text,
        decode_error_detail,
        encode_error_detail,
    )

    text = "名" * 50_000
    exc = InvalidArgumentError(
        text, field_path=text, attributes={f"k{i}-{text}": text for i in range(500)}
    )
    _, message = status_for(exc)
    assert len(message.encode()) <= MAX_STATUS_MESSAGE_BYTES
    data = encode_error_detail(exc)
    assert data is not None and len(data) <= MAX_DETAIL_BYTES
    decoded = decode_error_detail(data)
    assert decoded is not None and decoded[0] == "invalid_argument"
    assert "truncated" in decoded[2]
    assert bounded_text("short", 10) == "short"
    assert decode_error_detail(b"\xff\xff") is None
