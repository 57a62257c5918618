"""``services.health_watch``: a background duty that reports a reason turns the server's
gRPC health NOT_SERVING for ``""`` and every served service, and SERVING again when the
reason clears; after the drain began the health stays NOT_SERVING."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import ServiceName, load_config
from services.grpc_server import start_server
from services.health_watch import HealthSource, start_health_watch

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Source:
    def __init__(self) -> None:
        self.reason: str | None = None

    def unhealthy(self) -> str | None:
        return self.reason


async def _status(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
        return int(resp.status)


async def test_health_follows_the_background_source_until_the_drain(tmp_path: Path) -> None:
    cfg = load_config(
        ServiceName.RUNTIME,
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(tmp_path),
            "FLOW_RUNTIME_PORT": "0",
            "FLOW_LISTEN_HOST": "127.0.0.1",
            "FLOW_OTEL_ENABLED": "false",
        },
    )
    running = await start_server(cfg, ())
    source = _Source()
    assert isinstance(source, HealthSource)
    watch = start_health_watch(running, source, interval_s=3600)  # checks driven below
    try:
        await watch.check()
        assert await _status(running.port) == SERVING and watch.reason is None
        source.reason = "runtime worker process crash-looping: slot 0 (3 exits in a row)"
        await watch.check()
        assert await _status(running.port) == NOT_SERVING
        assert watch.reason == source.reason
        source.reason = None
        await watch.check()
        assert await _status(running.port) == SERVING
        await running.stop(0)
        source.reason = "still broken"
        await watch.check()  # ignored after the drain began
    finally:
        await watch.stop()
        await running.stop(0)
    assert watch.reason == "still broken"
