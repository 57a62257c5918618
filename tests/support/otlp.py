"""A tiny OTLP/gRPC trace collector for tests: service processes export their spans to it
(``FLOW_OTEL_EXPORTER=otlp``, ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``) and the test reads
them back, with the test process's own spans from the SDK's in-memory exporter.

It implements ``opentelemetry.proto.collector.trace.v1.TraceService`` (the generated
servicer shipped with ``opentelemetry-proto``) on a loopback port of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import format_span_id, format_trace_id

__all__ = ["Collected", "Collector", "collected_from_sdk", "otlp_collector"]


@dataclass(frozen=True)
class Collected:
    """One span as the tests compare it (ids as lower-case hex)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    attributes: Mapping[str, Any]


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


@dataclass
class Collector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """Stores every exported span."""

    spans: list[Collected] = field(default_factory=list)

    async def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        Collected(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=_KINDS.get(int(s.kind), str(s.kind)),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def collected_from_sdk(spans: Iterable[ReadableSpan], service: str) -> list[Collected]:
    """The test process's own spans (in-memory exporter) in the collector's shape."""
    out = []
    for s in spans:
        ctx = s.context
        assert ctx is not None
        out.append(
            Collected(
                service=service,
                name=s.name,
                trace_id=format_trace_id(ctx.trace_id),
                span_id=format_span_id(ctx.span_id),
                parent_span_id="" if s.parent is None else format_span_id(s.parent.span_id),
                kind=s.kind.name.lower(),
                attributes=dict(s.attributes or {}),
            )
        )
    return out


@contextlib.asynccontextmanager
async def otlp_collector() -> AsyncIterator[tuple[Collector, int]]:
    """Serve a :class:`Collector` on a free loopback port; yields it and the port."""
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield collector, port
    finally:
        await server.stop(0)
