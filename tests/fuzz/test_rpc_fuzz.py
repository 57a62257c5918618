"""Descriptor-driven fuzz of every RPC of the three services (issue 10, item 10).

The RPCs are *discovered* from the proto descriptors of
``nexus/flow/{catalog,runtime,effect}/v1/service.proto``, so an RPC added later — or one
that answers ``UNIMPLEMENTED`` today (``EffectOwnerService``, ``WakeSignalService``) and
is implemented by a later change — is covered without touching this file. For each RPC,
``hypothesis`` generates requests from the input message's descriptor
(:mod:`.strategies`: boundary and random values of every field, deep ``Struct`` values,
unknown enum numbers, over-long identifiers, known values of the seeded tenant) and
sends them with a valid credential of the seeded demo scope (all audiences, operator
roles) through a client with *default* channel options (4 MiB messages, 8 KiB metadata).
For every answer:

* the status is never ``INTERNAL`` or ``UNKNOWN``;
* a non-OK status carries the services' typed error detail, i.e. it was decided by the
  service and mapped by the one error interceptor — not a transport error, and not
  swallowed by an oversized trailer the client cannot read;
* a refused request wrote nothing: the row count of every table of the three databases
  is unchanged (except the writes the contract documents for a refusal, :data:`_ALLOWED`);

and after each RPC every server still reports SERVING. Malformed wire payloads (not a
message, invalid UTF-8, nesting beyond the parser's limit) must be refused
``INVALID_ARGUMENT`` the same way.

Seeded (``derandomize``) and bounded: ``FLOW_TEST_FUZZ_EXAMPLES`` examples per RPC (default
25 on SQLite, 10 on MariaDB).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings

import services.proto  # noqa: F401  (registers the generated descriptors)
from services.config import ServiceName
from services.errors import ERROR_DETAIL_METADATA_KEY
from services.proto import common_v1
from tests.fuzz.stack import FuzzEnv
from tests.fuzz.strategies import message_strategy

#: A generated request of several hundred KB is reported, not reproduced in a warning.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

_PACKAGES = {
    "catalog": ServiceName.CATALOG,
    "runtime": ServiceName.RUNTIME,
    "effect": ServiceName.EFFECT_OWNER,
}
_NEVER = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
_CALL_TIMEOUT_S = 60.0

#: Writes the contract documents for a *refused* request: (rpc, status, reason prefix)
#: -> tables that may change. A §8.3 conflict commits the REJECTED generation and then
#: answers FAILED_PRECONDITION (catalog_svc.service); a failing before-save Flow leaves
#: its audit evidence after the rollback (runtime_svc.api.records).
_ALLOWED: dict[tuple[str, grpc.StatusCode, str], frozenset[str]] = {
    ("SubmitEntry", grpc.StatusCode.FAILED_PRECONDITION, ""): frozenset(
        {"catalog.capability_catalog_generations", "catalog.catalog_requests"}
    ),
    **{
        (rpc, grpc.StatusCode.FAILED_PRECONDITION, "before_save."): frozenset(
            {"runtime.audit_records"}
        )
        for rpc in ("CreateRecord", "UpdateRecord", "DeleteRecord")
    },
}


def _rpcs() -> Iterator[tuple[ServiceName, str, MethodDescriptor]]:
    pool = descriptor_pool.Default()
    for package, audience in _PACKAGES.items():
        file = pool.FindFileByName(f"nexus/flow/{package}/v1/service.proto")
        for service in file.services_by_name.values():
            for method in service.methods:
                yield audience, service.full_name, method


RPCS = sorted(_rpcs(), key=lambda r: (r[1], r[2].name))


def _examples(env: FuzzEnv) -> int:
    default = 25 if env.stack.db_urls[ServiceName.RUNTIME].startswith("sqlite") else 10
    return int(os.environ.get("FLOW_TEST_FUZZ_EXAMPLES", default))


def _error_detail(err: grpc.RpcError) -> Any:
    for key, value in err.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_DETAIL_METADATA_KEY:
            return common_v1.ErrorDetail.FromString(value)
    return None


def _describe(request: Message | bytes) -> str:
    text = repr(request) if isinstance(request, bytes) else text_format.MessageToString(request)
    return text if len(text) < 600 else text[:600] + f"… ({len(text)} chars)"


def _invoke(
    env: FuzzEnv, audience: ServiceName, path: str, method: MethodDescriptor, payload: bytes
) -> Any:
    channel = env.channels[audience]
    response_cls = GetMessageClass(method.output_type)
    identity = lambda b: b  # noqa: E731
    kwargs = {"metadata": env.metadata, "timeout": _CALL_TIMEOUT_S}
    if method.client_streaming and method.server_streaming:
        return list(
            channel.stream_stream(path, identity, response_cls.FromString)(
                iter([payload]), **kwargs
            )
        )
    if method.client_streaming:
        return channel.stream_unary(path, identity, response_cls.FromString)(
            iter([payload]), **kwargs
        )
    if method.server_streaming:
        return list(
            channel.unary_stream(path, identity, response_cls.FromString)(payload, **kwargs)
        )
    return channel.unary_unary(path, identity, response_cls.FromString)(payload, **kwargs)


def check_call(
    env: FuzzEnv,
    audience: ServiceName,
    service: str,
    method: MethodDescriptor,
    request: Message | bytes,
    *,
    expect: grpc.StatusCode | None = None,
) -> None:
    """Send ``request`` and assert the fuzz invariants (module docstring)."""
    path = f"/{service}/{method.name}"
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    if len(payload) > env.stack.max_bytes:
        # Larger than FLOW_GRPC_MAX_MESSAGE_BYTES: gRPC refuses it RESOURCE_EXHAUSTED before
        # any service code runs (docs/api-contract.md); nothing is read, nothing written.
        expect = grpc.StatusCode.RESOURCE_EXHAUSTED
    before = env.stack.row_counts()
    try:
        _invoke(env, audience, path, method, payload)
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        details = err.details()  # type: ignore[attr-defined]
        where = f"{path} -> {code.name} {details!r}\nrequest: {_describe(request)}"
        assert code not in _NEVER, where
        if expect is not None:
            assert code == expect, where
        detail = _error_detail(err)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(payload) > env.stack.max_bytes:
            assert env.stack.row_counts() == before, f"an unread request wrote: {where}"
            return
        assert detail is not None, f"no typed error detail (not the service's answer): {where}"
        after = env.stack.row_counts()
        changed = {table for table, rows in after.items() if rows != before[table]}
        allowed: frozenset[str] = frozenset()
        for (rpc, status, prefix), tables in _ALLOWED.items():
            if rpc == method.name and status == code and detail.code.startswith(prefix):
                allowed |= tables
        assert changed <= allowed, f"a refused request wrote {sorted(changed - allowed)}: {where}"
        return
    assert expect is None, f"{path} answered OK, expected {expect}: {_describe(request)}"


def assert_serving(env: FuzzEnv) -> None:
    for audience, channel in env.channels.items():
        stub = health_pb2_grpc.HealthStub(channel)
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING, audience


@pytest.mark.parametrize(
    ("audience", "service", "method"),
    RPCS,
    ids=[f"{s.rsplit('.', 1)[1]}.{m.name}" for _, s, m in RPCS],
)
def test_generated_requests_get_a_clear_status_and_refusals_write_nothing(
    fuzz_env: FuzzEnv, audience: ServiceName, service: str, method: MethodDescriptor
) -> None:
    strategy = message_strategy(method.input_type, fuzz_env.known, fuzz_env.special)

    @settings(
        max_examples=_examples(fuzz_env),
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(request: Message) -> None:
        check_call(fuzz_env, audience, service, method, request)

    one()
    assert_serving(fuzz_env)


def _first_string_field(descriptor: Descriptor) -> FieldDescriptor | None:
    return next(
        (
            f
            for f in descriptor.fields
            if f.type == FieldDescriptor.TYPE_STRING and not f.is_repeated
        ),
        None,
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _deep_struct_bytes(depth: int) -> bytes:
    """A ``google.protobuf.Struct`` nested ``depth`` levels, serialized by hand (a parser
    refuses it beyond its recursion limit)."""
    from google.protobuf.struct_pb2 import Struct

    inner = Struct()
    node = inner
    for _ in range(depth):
        node = node.fields["a"].struct_value
    return inner.SerializeToString()


def _malformed(descriptor: Descriptor) -> Iterator[tuple[str, bytes]]:
    yield "not a message", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"
    yield "truncated length", b"\x0a\x80\x80\x80\x08abc"
    field = _first_string_field(descriptor)
    if field is not None:
        tag = _varint(field.number << 3 | 2)
        yield "invalid utf-8", tag + b"\x03\xff\xfe\xfd"
    for f in descriptor.fields:
        if (
            f.type == FieldDescriptor.TYPE_MESSAGE
            and f.message_type.full_name == "google.protobuf.Struct"
        ):
            body = _deep_struct_bytes(400)
            yield (
                "nesting beyond the parser limit",
                _varint(f.number << 3 | 2) + _varint(len(body)) + body,
            )
            break


@pytest.mark.parametrize(
    ("audience", "service", "method"),
    RPCS,
    ids=[f"{s.rsplit('.', 1)[1]}.{m.name}" for _, s, m in RPCS],
)
def test_malformed_payloads_are_invalid_argument(
    fuzz_env: FuzzEnv, audience: ServiceName, service: str, method: MethodDescriptor
) -> None:
    for _name, payload in _malformed(method.input_type):
        check_call(
            fuzz_env, audience, service, method, payload, expect=grpc.StatusCode.INVALID_ARGUMENT
        )
    assert_serving(fuzz_env)


def test_the_documented_refusal_writes_name_real_tables(fuzz_env: FuzzEnv) -> None:
    tables = set(fuzz_env.stack.row_counts())
    for allowed in _ALLOWED.values():
        assert allowed <= tables
