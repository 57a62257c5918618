"""Tracing: the process's OpenTelemetry set-up and the propagation helpers of every hop.

One trace per Flow run (spec §19 "trace identity"): the run's W3C trace context is
stored when the run is accepted and every later hop continues it — synchronous hops
through gRPC metadata (the ``opentelemetry-instrumentation-grpc`` server interceptor of
``services.grpc_server`` and the client interceptors of ``services.channels``),
asynchronous hops through a small string map persisted next to the row that carries the
work across the gap:

=============================  =========================================================
hop                            carrier
=============================  =========================================================
StartRun / after-save → steps  ``flow_runs.trace_context`` (the ``flow.run.accept`` span)
step attempt → owner           ``runtime_outbox.trace_context`` (+ the envelope's map)
owner acceptance → provider    ``external_commands.trace_context``
receipt → runtime              ``owner_outbox.trace_context``
signal → resolution            ``flow_wake_signals.trace_context``
=============================  =========================================================

Never in a checkpoint payload, an evidence document or a digest: a trace context is
diagnostics, so two enqueues of the same message with different contexts are the same
message, and nothing a Flow reads depends on it.

Helper API (pure apart from the OpenTelemetry context):

* :func:`inject_context` / :func:`extract_context` — W3C TraceContext through the
  library's propagator (STYLE 18; no hand-written ``traceparent`` parsing). Only
  ``traceparent``/``tracestate`` are carried into durable rows (never baggage, which may
  hold anything a caller put there).
* :func:`encode_carrier` / :func:`decode_carrier` — the bounded JSON text a column holds;
  :func:`current_carrier` is the column value of the current span.
* :func:`trace_id_of` — the 32-hex trace id of a carrier (``flow_step_attempts.trace_id``).
* :func:`span` — a span of the ``nexus.flow`` tracer, parented by a carrier or the
  current context; :func:`parent_of` picks the first valid of several candidates.

Set-up: :func:`configure_tracing` installs one SDK ``TracerProvider`` per process
(resource ``service.name=nexus-flow-<service>``, sampler from ``OTEL_TRACES_SAMPLER``, a
``BatchSpanProcessor`` for the ``otlp``/``console`` exporter, none for ``none`` — trace
ids are still minted and propagated); :func:`shutdown_tracing` flushes it at exit. With
``FLOW_OTEL_ENABLED=false`` nothing is installed: every helper degrades to a no-op and
stored carriers stay empty.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.config import ServiceConfig
from services.db import TRACE_CONTEXT_BYTES

__all__ = [
    "MAX_CARRIER_BYTES",
    "TRACER_NAME",
    "configure_tracing",
    "current_carrier",
    "current_trace_id",
    "decode_carrier",
    "encode_carrier",
    "exporter_for",
    "extract_context",
    "inject_context",
    "instrument_engine",
    "link_to",
    "parent_of",
    "sanitize_carrier",
    "shutdown_tracing",
    "span",
    "trace_id_of",
    "tracer",
]

log = logging.getLogger(__name__)

#: Instrumentation scope of every span this project creates.
TRACER_NAME = "nexus.flow"
#: Bound of a stored carrier (JSON text); a W3C ``traceparent`` is 55 characters.
MAX_CARRIER_BYTES = TRACE_CONTEXT_BYTES
_MAX_ENTRIES = 4
_MAX_KEY_CHARS = 64
_MAX_VALUE_CHARS = 512
#: The only propagator whose fields reach durable rows (W3C Trace Context).
_PROPAGATOR = TraceContextTextMapPropagator()
_FIELDS = frozenset(_PROPAGATOR.fields)

Carrier = Mapping[str, str]
#: What a parent can be given as: a carrier, its stored JSON text, a context, or nothing.
ParentLike = Carrier | str | Context | None


class _State:
    """The provider this module installed (so :func:`shutdown_tracing` flushes only it)."""

    provider: TracerProvider | None = None


def exporter_for(cfg: ServiceConfig) -> SpanExporter | None:
    """The span exporter ``FLOW_OTEL_EXPORTER`` names (None for ``none``)."""
    return _exporter(cfg)


def _exporter(cfg: ServiceConfig) -> SpanExporter | None:
    settings = cfg.telemetry
    if settings.exporter == "console":
        return ConsoleSpanExporter(out=sys.stderr)
    if settings.exporter == "otlp":
        # Endpoint, headers, timeout, compression and TLS come from the standard
        # OTEL_EXPORTER_OTLP_* variables, read by the exporter itself.
        if settings.otlp_protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    return None


def configure_tracing(cfg: ServiceConfig) -> TracerProvider | None:
    """Install this process's SDK tracer provider (idempotent; see the module docstring).

    Returns:
        The provider in use, or None when tracing is off (``FLOW_OTEL_ENABLED=false``).
    """
    if not cfg.otel_enabled:
        return None
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current  # installed earlier (this module, or a test harness)
    for warning in cfg.telemetry.warnings:
        log.warning("%s", warning)
    provider = TracerProvider(
        resource=Resource.create(
            {
                "service.name": f"nexus-flow-{cfg.service.value}",
                "service.namespace": "nexus-flow",
                "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
            }
        )
    )
    exporter = _exporter(cfg)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    installed = trace.get_tracer_provider()
    if installed is provider:
        _State.provider = provider
        log.info(
            "tracing on: exporter %s%s",
            cfg.telemetry.exporter,
            f" ({cfg.telemetry.otlp_protocol})" if cfg.telemetry.exporter == "otlp" else "",
        )
    return installed if isinstance(installed, TracerProvider) else provider


def shutdown_tracing() -> None:
    """Flush and stop the provider :func:`configure_tracing` installed (idempotent)."""
    provider, _State.provider = _State.provider, None
    if provider is not None:
        provider.shutdown()


def instrument_engine(
    engine: Any, cfg: ServiceConfig, *, tracer_provider: trace.TracerProvider | None = None
) -> bool:
    """One span per SQL statement on ``engine`` when ``FLOW_OTEL_SQL`` is on (the
    instrumentor is process-wide: a process instruments its one engine).

    Args:
        engine: an ``AsyncEngine`` (its ``sync_engine`` is instrumented).
        cfg: the process configuration.
        tracer_provider: default: the installed provider.

    Returns:
        Whether the engine is instrumented.
    """
    if not cfg.telemetry.sql_spans:
        return False
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    # The instrumentation declares SQLAlchemy < 2.1; it hooks the stable cursor-execute
    # events, which 2.1 keeps (tests/integration/observability checks the spans appear).
    SQLAlchemyInstrumentor().instrument(
        engine=engine.sync_engine,
        tracer_provider=tracer_provider or trace.get_tracer_provider(),
        skip_dep_check=True,
    )
    return True


def tracer() -> trace.Tracer:
    """The ``nexus.flow`` tracer of the installed provider (no-op when tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


# --- carriers ---------------------------------------------------------------------------


def sanitize_carrier(carrier: Mapping[Any, Any] | None) -> dict[str, str]:
    """The W3C fields of ``carrier`` that fit the bounds; anything else is dropped.

    A trace context is diagnostics: a malformed one is ignored, never an error.
    """
    if not carrier:
        return {}
    out: dict[str, str] = {}
    for key, value in carrier.items():
        if not isinstance(key, str) or not isinstance(value, str):
            continue
        name = key.lower()
        if name not in _FIELDS or len(name) > _MAX_KEY_CHARS or len(value) > _MAX_VALUE_CHARS:
            continue
        out[name] = value
        if len(out) >= _MAX_ENTRIES:
            break
    return out


def inject_context(ctx: Context | None = None) -> dict[str, str]:
    """The W3C carrier (``traceparent``, ``tracestate``) of ``ctx`` (default: current);
    ``{}`` when there is no valid span (tracing off, or no span started)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def _as_carrier(parent: Carrier | str | None) -> dict[str, str]:
    if parent is None:
        return {}
    if isinstance(parent, str):
        return decode_carrier(parent)
    return sanitize_carrier(parent)


def extract_context(carrier: Carrier | str | None) -> Context:
    """A context whose parent span is the one ``carrier`` names (a map or its stored
    JSON text); an empty context when it names none or is malformed."""
    return _PROPAGATOR.extract(_as_carrier(carrier), context=Context())


def encode_carrier(carrier: Mapping[Any, Any] | None) -> str | None:
    """The column value of ``carrier``: sorted JSON within :data:`MAX_CARRIER_BYTES`, or
    None when nothing valid remains."""
    clean = sanitize_carrier(carrier)
    if not clean:
        return None
    text = json.dumps(clean, sort_keys=True, separators=(",", ":"))
    return text if len(text.encode("utf-8")) <= MAX_CARRIER_BYTES else None


def decode_carrier(text: str | None) -> dict[str, str]:
    """The carrier a column holds (``{}`` for NULL or anything malformed)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return sanitize_carrier(value) if isinstance(value, dict) else {}


def current_carrier() -> str | None:
    """:func:`encode_carrier` of the current span (the value a row stores)."""
    return encode_carrier(inject_context())


def _span_context(parent: ParentLike) -> trace.SpanContext:
    ctx = parent if isinstance(parent, Context) else extract_context(parent)
    return trace.get_current_span(ctx).get_span_context()


def trace_id_of(parent: ParentLike) -> str | None:
    """The 32-hex trace id ``parent`` belongs to, or None when it names no valid span."""
    sc = _span_context(parent)
    return trace.format_trace_id(sc.trace_id) if sc.is_valid else None


def current_trace_id() -> str | None:
    """The trace id of the current span, or None."""
    sc = trace.get_current_span().get_span_context()
    return trace.format_trace_id(sc.trace_id) if sc.is_valid else None


def parent_of(*candidates: ParentLike) -> Context:
    """The context of the first candidate that names a valid span (``None`` stands for
    the current context); an empty context (a new root) when none does."""
    for candidate in candidates:
        ctx = otel_context.get_current() if candidate is None else candidate
        if not isinstance(ctx, Context):
            ctx = extract_context(ctx)
        if trace.get_current_span(ctx).get_span_context().is_valid:
            return ctx
    return Context()


def link_to(parent: ParentLike) -> Link | None:
    """A span link to ``parent`` (None when it names no valid span)."""
    sc = _span_context(parent)
    return Link(sc) if sc.is_valid else None


@contextmanager
def span(
    name: str,
    *,
    parent: ParentLike = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    links: Sequence[Link | None] = (),
    start_time: int | None = None,
) -> Iterator[Span]:
    """A current span of the ``nexus.flow`` tracer.

    Args:
        name: the span name (``flow.step.attempt``, ``outbox.deliver``, …).
        parent: a carrier/context to continue; when it names no valid span (or is
            None) the current context is continued.
        kind: the span kind.
        attributes: safe identifiers and codes only — never payloads or credentials.
        links: spans this one follows from (None entries are skipped).
        start_time: epoch nanoseconds when the work began (default: now).
    """
    ctx = None if parent is None else parent_of(parent, None)
    with tracer().start_as_current_span(
        name,
        context=ctx,
        kind=kind,
        attributes=dict(attributes or {}),
        links=[link for link in links if link is not None],
        start_time=start_time,
    ) as current:
        yield current
