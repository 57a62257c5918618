"""The shared server bootstrap, served for real on loopback port 0.

A tiny JSON service registered through a generic handler stands in for the
generated protos, so this test depends on no service's contract.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services import errors
from services.auth import (
    CredentialSource,
    WorkloadClaims,
    bearer_client_interceptors,
    channel_credentials,
    current_identity,
    generate_keypair,
    load_signing_key,
)
from services.config import ServiceConfig, ServiceName, load_config
from services.errors import (
    ERROR_DETAIL_METADATA_KEY,
    MAX_DETAIL_BYTES,
    InvalidArgumentError,
    NotFoundError,
)
from services.faults import FaultHookError
from services.grpc_server import RunningServer, ServiceRegistration, serve_forever, start_server
from tests.support.pki import issue_pki

SERVICE = "nexus.test.v1.EchoService"
MAX_BYTES = 64 * 1024
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _ser(value: Any) -> bytes:
    return json.dumps(value).encode()


def _des(data: bytes) -> Any:
    return json.loads(data)


class EchoServicer:
    async def Echo(self, request: Any, _ctx: Any) -> Any:
        identity = current_identity()
        return {"echo": request["payload"], "subject": identity.subject, "org": identity.org_id}

    async def Big(self, request: Any, _ctx: Any) -> Any:
        return {"blob": "x" * request["size"]}

    async def Fail(self, _request: Any, _ctx: Any) -> Any:
        raise RuntimeError("password=hunter2 host=db.internal")

    async def Missing(self, request: Any, _ctx: Any) -> Any:
        raise NotFoundError("FlowRun", request["id"])

    async def Count(self, request: Any, _ctx: Any) -> AsyncIterator[Any]:
        for i in range(request["n"]):
            yield {"i": i}

    async def Huge(self, request: Any, _ctx: Any) -> Any:
        """An error built from unbounded client input (what a careless servicer does)."""
        text = request["text"]
        raise InvalidArgumentError(
            f"bad {text}",
            field_path=f"fields.{text}",
            attributes={f"fields.{text}{i}": text for i in range(request["n"])},
        )

    async def BigStruct(self, request: Struct, _ctx: Any) -> Struct:
        out = Struct()
        out.update({"blob": "x" * int(request.fields["size"].number_value)})
        return out


def add_echo(servicer: EchoServicer, server: grpc.aio.Server) -> None:
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        name: unary(getattr(servicer, name), _des, _ser)
        for name in ("Echo", "Big", "Fail", "Missing")
    }
    handlers["Count"] = grpc.unary_stream_rpc_method_handler(servicer.Count, _des, _ser)
    handlers["Huge"] = unary(servicer.Huge, _des, _ser)
    handlers["BigStruct"] = unary(servicer.BigStruct, Struct.FromString, Struct.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


REGISTRATIONS = [ServiceRegistration(SERVICE, add_echo, EchoServicer())]


@pytest.fixture
def signing_key(tmp_path: Path) -> Ed25519PrivateKey:
    private, public = generate_keypair()
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    (tmp_path / "trusted.json").write_text(json.dumps({"it": pem}))
    return private


def make_cfg(tmp_path: Path, **overrides: str) -> ServiceConfig:
    env = {
        "FLOW_ENV": "test",
        "FLOW_DATA_DIR": str(tmp_path / "data"),
        "FLOW_LISTEN_HOST": "127.0.0.1",
        "FLOW_RUNTIME_PORT": "0",
        "FLOW_AUTH_TRUSTED_KEYS": str(tmp_path / "trusted.json"),
        "FLOW_GRPC_MAX_MESSAGE_BYTES": str(MAX_BYTES),
        "FLOW_OTEL_ENABLED": "true",
        "FLOW_SHUTDOWN_GRACE_S": "1",
    }
    return load_config(ServiceName.RUNTIME, env | overrides)


@pytest.fixture
async def running(tmp_path: Path, signing_key: Ed25519PrivateKey) -> AsyncIterator[RunningServer]:
    server = await start_server(make_cfg(tmp_path), REGISTRATIONS)
    yield server
    await server.stop(0)


def credential_source(key: Ed25519PrivateKey, kid: str = "it") -> CredentialSource:
    claims = WorkloadClaims(subject="it-client", audiences=(ServiceName.RUNTIME,), org_id="org-1")
    return CredentialSource(key, kid, claims)


def authed_channel(port: int, key: Ed25519PrivateKey, kid: str = "it") -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", interceptors=bearer_client_interceptors(credential_source(key, kid))
    )


def method(channel: grpc.aio.Channel, name: str) -> Any:
    return channel.unary_unary(
        f"/{SERVICE}/{name}", request_serializer=_ser, response_deserializer=_des
    )


async def check_health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(response.status)


async def test_health_and_reflection_without_credentials(running: RunningServer) -> None:
    assert running.port > 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        assert await check_health(channel) == SERVING
        assert await check_health(channel, SERVICE) == SERVING

        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=10)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
    names = {s.name for s in response.list_services_response.service}
    assert names == {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


async def test_calls_need_a_credential_and_see_the_identity(
    running: RunningServer, signing_key: Ed25519PrivateKey
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as anonymous:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(anonymous, "Echo")({"payload": "hi"}, timeout=10)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == "workload credential missing"

    async with authed_channel(running.port, signing_key) as channel:
        reply = await method(channel, "Echo")({"payload": "hi"}, timeout=10)
        assert reply == {"echo": "hi", "subject": "it-client", "org": "org-1"}
        stream = channel.unary_stream(
            f"/{SERVICE}/Count", request_serializer=_ser, response_deserializer=_des
        )
        assert [m["i"] async for m in stream({"n": 3}, timeout=10)] == [0, 1, 2]

    async with authed_channel(running.port, signing_key, kid="other") as wrong_key:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(wrong_key, "Echo")({"payload": "hi"}, timeout=10)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_errors_are_mapped_on_the_wire(
    running: RunningServer, signing_key: Ed25519PrivateKey
) -> None:
    async with authed_channel(running.port, signing_key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(channel, "Missing")({"id": "run-1"}, timeout=10)
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.NOT_FOUND,
            "FlowRun not found",
        )

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(channel, "Fail")({}, timeout=10)
        assert info.value.code() is grpc.StatusCode.INTERNAL
        details = info.value.details() or ""
        assert "correlation id" in details
        assert (
            "hunter2" not in details
            and "db.internal" not in details
            and "RuntimeError" not in details
        )


async def test_typed_error_detail_reaches_the_client(
    running: RunningServer, signing_key: Ed25519PrivateKey
) -> None:
    detail_cls = errors._error_detail_class()
    if detail_cls is None:
        pytest.skip("generated protos (services.proto.common_v1) not built")
    async with authed_channel(running.port, signing_key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(channel, "Missing")({"id": "run-1"}, timeout=10)
    trailing = dict(info.value.trailing_metadata() or ())
    detail = detail_cls.FromString(trailing[ERROR_DETAIL_METADATA_KEY])
    assert (detail.code, detail.retryable) == ("not_found", False)
    assert dict(detail.attributes) == {"entity": "FlowRun", "key": "run-1"}


async def test_message_size_limit(running: RunningServer, signing_key: Ed25519PrivateKey) -> None:
    async with authed_channel(running.port, signing_key) as channel:
        assert (await method(channel, "Big")({"size": 1000}, timeout=10))["blob"] == "x" * 1000
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(channel, "Echo")({"payload": "y" * (MAX_BYTES + 1)}, timeout=10)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(channel, "Big")({"size": MAX_BYTES + 1}, timeout=10)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def _detail(err: grpc.aio.AioRpcError) -> Any:
    from services.proto import common_v1

    for key, value in err.trailing_metadata() or ():
        if key == ERROR_DETAIL_METADATA_KEY:
            return common_v1.ErrorDetail.FromString(value)
    return None


async def test_a_malformed_request_is_invalid_argument_with_detail(
    running: RunningServer, signing_key: Ed25519PrivateKey
) -> None:
    async with authed_channel(running.port, signing_key) as channel:
        raw = channel.unary_unary(
            f"/{SERVICE}/Echo", request_serializer=lambda b: b, response_deserializer=_des
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff not json", timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _detail(info.value).code == "malformed_request"


async def test_error_answers_stay_within_default_client_metadata_limits(
    running: RunningServer, signing_key: Ed25519PrivateKey
) -> None:
    """A refusal that would echo 16 KB of client input two thousand times still reaches a
    client with gRPC's default 8 KiB metadata limit as the real status and detail."""
    text = "é" * 8_000  # two bytes each, tripled by percent-encoding
    async with authed_channel(running.port, signing_key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(channel, "Huge")({"text": text, "n": 2_000}, timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert len((info.value.details() or "").encode()) <= 512
    detail = _detail(info.value)
    assert detail is not None and detail.code == "invalid_argument"
    assert detail.ByteSize() <= MAX_DETAIL_BYTES
    assert "truncated" in detail.attributes


async def test_a_response_over_the_message_limit_is_out_of_range(
    running: RunningServer, signing_key: Ed25519PrivateKey
) -> None:
    async with authed_channel(running.port, signing_key) as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/BigStruct",
            request_serializer=Struct.SerializeToString,
            response_deserializer=Struct.FromString,
        )
        request = Struct()
        request.update({"size": 1_000})
        assert len((await call(request, timeout=10)).fields["blob"].string_value) == 1_000
        request.update({"size": MAX_BYTES + 1})
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request, timeout=10)
    assert info.value.code() is grpc.StatusCode.OUT_OF_RANGE
    assert _detail(info.value).code == "response_too_large"


async def test_stop_reports_not_serving_then_stops(
    tmp_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    server = await start_server(make_cfg(tmp_path), REGISTRATIONS)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=30
        )
        assert (await watch.read()).status == SERVING
        stopping = asyncio.create_task(server.stop(0.5))
        assert (await watch.read()).status == NOT_SERVING
        await stopping
        await server.stop()  # idempotent
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check_health(channel)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_taken_port_is_an_error(running: RunningServer, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        await start_server(make_cfg(tmp_path, FLOW_RUNTIME_PORT=str(running.port)), REGISTRATIONS)


async def test_production_refuses_fault_hooks(
    tmp_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    cfg = make_cfg(tmp_path, FLOW_ENV="production", FLOW_CRASH_AT="after_claim")
    with pytest.raises(FaultHookError):
        await start_server(cfg, REGISTRATIONS)


async def test_dev_keys_are_created_on_first_start(tmp_path: Path) -> None:
    env = {"FLOW_ENV": "development", "FLOW_DATA_DIR": str(tmp_path), "FLOW_RUNTIME_PORT": "0"}
    cfg = load_config(ServiceName.RUNTIME, env)
    assert not cfg.auth_trusted_keys.exists()
    server = await start_server(cfg, REGISTRATIONS)
    try:
        key = load_signing_key(cfg.auth_signing_key)
        async with authed_channel(server.port, key, kid=cfg.auth_signing_key_id) as channel:
            assert (await method(channel, "Echo")({"payload": "dev"}, timeout=10))["echo"] == "dev"
    finally:
        await server.stop(0)


async def test_serve_forever_logs_and_returns_after_stop(
    tmp_path: Path, signing_key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    started: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    with caplog.at_level(logging.INFO, logger="services.grpc_server"):
        task = asyncio.create_task(
            serve_forever(make_cfg(tmp_path), REGISTRATIONS, started.set_result)
        )
        server = await asyncio.wait_for(started, 30)
        await server.stop(0)
        await asyncio.wait_for(task, 30)
    assert f"runtime serving on 127.0.0.1:{server.port}" in caplog.messages


# --- mTLS ---------------------------------------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    return issue_pki(tmp_path)


async def test_mtls_requires_a_client_certificate(
    tmp_path: Path, signing_key: Ed25519PrivateKey, pki: dict[str, Path]
) -> None:
    cfg = make_cfg(
        tmp_path,
        FLOW_TLS_CERT=str(pki["server_cert"]),
        FLOW_TLS_KEY=str(pki["server_key"]),
        FLOW_TLS_CLIENT_CA=str(pki["ca"]),
    )
    server = await start_server(cfg, REGISTRATIONS)
    target = f"127.0.0.1:{server.port}"
    options = [("grpc.ssl_target_name_override", "localhost")]
    try:
        with_cert = channel_credentials(
            root_ca=pki["ca"],
            client_cert=pki["client_cert"],
            client_key=pki["client_key"],
            call_credentials=credential_source(signing_key),
        )
        async with grpc.aio.secure_channel(target, with_cert, options=options) as channel:
            assert await check_health(channel) == SERVING
            # The workload credential rides as call credentials over TLS.
            assert (await method(channel, "Echo")({"payload": "tls"}, timeout=10))[
                "subject"
            ] == "it-client"

        without_cert = channel_credentials(root_ca=pki["ca"])
        async with grpc.aio.secure_channel(target, without_cert, options=options) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await check_health(channel)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
