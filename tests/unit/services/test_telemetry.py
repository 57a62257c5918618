"""``services.telemetry``: carriers through the W3C propagator, their storage form, the
span helpers, and the FLOW_OTEL_* configuration (exporter, deprecated console flag)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services import telemetry
from services.config import ConfigError, ServiceConfig, ServiceName, load_config

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A local SDK provider behind ``telemetry.tracer()`` (the global one is left alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer(telemetry.TRACER_NAME))
    try:
        yield provider, exporter
    finally:
        provider.shutdown()


def test_carriers_keep_only_bounded_w3c_fields() -> None:
    dirty = {
        "traceparent": TRACEPARENT,
        "TraceState": "vendor=1",
        "baggage": "user=alice",  # never persisted
        "x": "y",
        "tracestate2": "z" * 600,
        7: "not a key",
    }
    assert telemetry.sanitize_carrier(dirty) == {
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=1",
    }
    assert telemetry.sanitize_carrier(None) == {}
    assert telemetry.sanitize_carrier({"traceparent": "x" * 513}) == {}


def test_encode_and_decode_round_trip_and_never_raise() -> None:
    text = telemetry.encode_carrier({"traceparent": TRACEPARENT})
    assert text is not None and json.loads(text) == {"traceparent": TRACEPARENT}
    assert telemetry.decode_carrier(text) == {"traceparent": TRACEPARENT}
    assert telemetry.encode_carrier({}) is None
    assert telemetry.encode_carrier({"baggage": "a=b"}) is None
    for garbage in (None, "", "not json", "[1, 2]", '{"traceparent": 5}'):
        assert telemetry.decode_carrier(garbage) == {}


def test_trace_id_of_reads_the_propagated_context() -> None:
    assert telemetry.trace_id_of({"traceparent": TRACEPARENT}) == (
        "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert telemetry.trace_id_of(json.dumps({"traceparent": TRACEPARENT})) == (
        "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert telemetry.trace_id_of(None) is None
    assert telemetry.trace_id_of({"traceparent": "00-zz-yy-01"}) is None


def test_inject_is_empty_without_a_span_and_round_trips_with_one(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    assert telemetry.inject_context() == {}
    assert telemetry.current_carrier() is None
    assert telemetry.current_trace_id() is None
    with telemetry.span("outer") as outer:
        carrier = telemetry.inject_context()
        assert set(carrier) == {"traceparent"}
        sc = outer.get_span_context()
        assert telemetry.trace_id_of(carrier) == trace.format_trace_id(sc.trace_id)
        assert telemetry.current_trace_id() == trace.format_trace_id(sc.trace_id)
        stored = telemetry.current_carrier()
    assert telemetry.decode_carrier(stored) == carrier


def test_span_continues_a_stored_carrier_as_its_parent(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    _, exporter = spans
    with telemetry.span("producer"):
        stored = telemetry.current_carrier()
    # Later, in another task with no current span: the stored carrier is the parent.
    with telemetry.span("consumer", parent=stored):
        pass
    producer, consumer = exporter.get_finished_spans()
    assert consumer.parent is not None
    assert consumer.parent.span_id == producer.context.span_id
    assert consumer.context.trace_id == producer.context.trace_id


def test_span_with_an_empty_carrier_continues_the_current_context(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    _, exporter = spans
    with (
        telemetry.span("request"),
        telemetry.span("child", parent=None),
        telemetry.span("fallback", parent="garbage"),
    ):
        pass
    fallback, child, request = exporter.get_finished_spans()
    assert child.parent is not None and child.parent.span_id == request.context.span_id
    assert fallback.parent is not None and fallback.parent.span_id == child.context.span_id


def test_parent_of_prefers_the_first_valid_candidate(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    carrier = {"traceparent": TRACEPARENT}
    # No current span: the carrier.
    ctx = telemetry.parent_of(None, carrier)
    assert trace.get_current_span(ctx).get_span_context().trace_id == int(
        "4bf92f3577b34da6a3ce929d0e0e4736", 16
    )
    with telemetry.span("current") as current:
        ctx = telemetry.parent_of(None, carrier)
        assert trace.get_current_span(ctx) is current
    assert not trace.get_current_span(telemetry.parent_of(None, {})).get_span_context().is_valid
    assert telemetry.link_to(carrier) is not None
    assert telemetry.link_to(None) is None
    assert otel_context.get_current() is not None


def _cfg(**env: str) -> ServiceConfig:
    return load_config(ServiceName.RUNTIME, {"FLOW_ENV": "test", **env})


def test_exporter_configuration_and_the_deprecated_console_flag() -> None:
    assert _cfg().telemetry.exporter == "none"
    assert _cfg().otel_enabled is True
    otlp = _cfg(FLOW_OTEL_EXPORTER="otlp").telemetry
    assert (otlp.exporter, otlp.otlp_protocol) == ("otlp", "http/protobuf")
    grpc = _cfg(FLOW_OTEL_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="grpc").telemetry
    assert grpc.otlp_protocol == "grpc"
    traces = _cfg(
        FLOW_OTEL_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
    ).telemetry
    assert traces.otlp_protocol == "http/protobuf"
    deprecated = _cfg(FLOW_OTEL_CONSOLE_EXPORT="true")
    assert deprecated.telemetry.exporter == "console"
    assert deprecated.otel_console_export is True
    assert any("deprecated" in w for w in deprecated.telemetry.warnings)
    off = _cfg(FLOW_OTEL_ENABLED="false")
    assert off.telemetry.exporter == "none" and off.telemetry.sql_spans is False


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"FLOW_OTEL_EXPORTER": "jaeger"}, "FLOW_OTEL_EXPORTER"),
        ({"FLOW_OTEL_EXPORTER": "otlp", "FLOW_OTEL_CONSOLE_EXPORT": "true"}, "contradicts"),
        ({"FLOW_OTEL_ENABLED": "false", "FLOW_OTEL_EXPORTER": "otlp"}, "FLOW_OTEL_ENABLED"),
        (
            {"FLOW_OTEL_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        ({"FLOW_METRICS_PORT": "70000"}, "FLOW_METRICS_PORT"),
        ({"FLOW_METRICS_PORT": "abc"}, "FLOW_METRICS_PORT"),
        ({"FLOW_METRICS_STATE_ORGS": "0"}, "FLOW_METRICS_STATE_ORGS"),
    ],
)
def test_malformed_or_contradicting_settings_are_refused(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        _cfg(**env)


def test_metrics_port_unset_means_no_endpoint_and_zero_means_a_free_port() -> None:
    assert _cfg().telemetry.metrics_port is None
    assert _cfg(FLOW_METRICS_PORT="0").telemetry.metrics_port == 0
    assert _cfg(FLOW_METRICS_PORT="9464").telemetry.metrics_port == 9464
    assert _cfg(FLOW_METRICS_STATE_MS="0").telemetry.state_interval_ms == 0


def test_configure_tracing_is_off_when_disabled() -> None:
    assert telemetry.configure_tracing(_cfg(FLOW_OTEL_ENABLED="false")) is None


def test_the_exporter_setting_selects_the_exporter_class() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    assert telemetry.exporter_for(_cfg()) is None
    assert isinstance(
        telemetry.exporter_for(_cfg(FLOW_OTEL_EXPORTER="console")), ConsoleSpanExporter
    )
    assert isinstance(
        telemetry.exporter_for(_cfg(FLOW_OTEL_CONSOLE_EXPORT="true")), ConsoleSpanExporter
    )
    http = telemetry.exporter_for(_cfg(FLOW_OTEL_EXPORTER="otlp"))
    assert isinstance(http, HttpExporter)
    grpc_exporter = telemetry.exporter_for(
        _cfg(FLOW_OTEL_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    )
    assert isinstance(grpc_exporter, GrpcExporter)
    for exporter in (http, grpc_exporter):
        assert exporter is not None
        exporter.shutdown()
