"""Process set-up of the telemetry: the ``/metrics`` endpoint and state scan of
``services.service_main`` (a taken port is a configuration error), and the optional SQL
spans (``FLOW_OTEL_SQL``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text

from runtime_svc.observability import RuntimeStateSource
from services import db, migrate
from services.config import ConfigError, ServiceConfig, ServiceName, load_config
from services.metrics import FlowMetrics, start_metrics_server
from services.service_main import start_observability
from services.telemetry import instrument_engine
from tests.support.metrics import scrape
from tests.support.procs import free_port

pytestmark = pytest.mark.asyncio


def _cfg(tmp_path: Path, **env: str) -> ServiceConfig:
    return load_config(
        ServiceName.RUNTIME, {"FLOW_ENV": "test", "FLOW_DATA_DIR": str(tmp_path), **env}
    )


async def test_no_port_no_endpoint_and_a_taken_port_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    engine = db.create_engine(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}")
    try:
        off = await start_observability(_cfg(tmp_path), engine, [])
        assert off.server is None
        await off.stop()
        taken = start_metrics_server("127.0.0.1", 0, FlowMetrics())
        try:
            with pytest.raises(ConfigError, match="FLOW_METRICS_PORT"):
                await start_observability(
                    _cfg(tmp_path, FLOW_METRICS_PORT=str(taken.port)),
                    engine,
                    [],
                )
        finally:
            taken.stop()
    finally:
        await engine.dispose()


async def test_the_endpoint_and_the_scan_start_and_stop_together(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'r.db'}"
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url)
    port = free_port()
    cfg = _cfg(tmp_path, FLOW_METRICS_PORT=str(port), FLOW_METRICS_STATE_MS="50")
    try:
        observed = await start_observability(cfg, engine, [RuntimeStateSource()])
        try:
            assert observed.server is not None and observed.server.port == port

            async def scanned() -> bool:
                return (await scrape(port)).value("nexus_flow_state_scan_timestamp_seconds") > 0

            for _ in range(200):
                if await scanned():
                    break
                await asyncio.sleep(0.05)
            assert await scanned()
            assert (await scrape(port)).has("nexus_flow_runs")
        finally:
            await observed.stop()
            await observed.stop()  # idempotent
    finally:
        await engine.dispose()


async def test_sql_spans_only_when_asked(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = db.create_engine(f"sqlite+aiosqlite:///{tmp_path / 's.db'}")
    try:
        assert not instrument_engine(engine, _cfg(tmp_path), tracer_provider=provider)
        assert instrument_engine(
            engine,
            _cfg(tmp_path, FLOW_OTEL_SQL="true"),
            tracer_provider=provider,
        )
        try:
            async with db.transaction(engine, readonly=True) as conn:
                await conn.execute(text("SELECT 1"))
        finally:
            SQLAlchemyInstrumentor().uninstrument()
        names = [s.name for s in exporter.get_finished_spans()]
        assert any(n.startswith("SELECT") for n in names), names
    finally:
        await engine.dispose()
        provider.shutdown()
