"""OpenTelemetry tracing for every splitserve process: setup from the standard `OTEL_*`
environment variables, W3C trace context in and out of gRPC metadata and HTTP headers, and a
JSON-lines span file for tests and local debugging.

Environment (read once, by `configure_tracing` at process start):

    OTEL_TRACES_EXPORTER      comma-separated: otlp | console | none (default: none, tracing off)
    OTEL_SERVICE_NAME         the service name on every span (default: the process's role)
    OTEL_SDK_DISABLED=true    tracing off, whatever else is set
    OTEL_EXPORTER_OTLP_*      endpoint, headers, protocol (grpc; http/protobuf if installed)
    OTEL_TRACES_SAMPLER(_ARG) sampling, read by the SDK itself
    SPLITSERVE_TRACES_FILE    also append every span to this file, one JSON object a line

With tracing off nothing is set up: `start_span` hands back OpenTelemetry's shared
non-recording span, nothing is injected into outgoing calls and nothing is extracted from
incoming ones, so the request path pays for a few attribute lookups and no span processing.

Spans are started with explicit parents (`parent=` a span or a context), not from the ambient
context: decode and prefill work runs in async generators and engine callbacks, where a
context attached in one step would leak into the next.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from splitserve.engine.telemetry import RequestSteps

logger = logging.getLogger(__name__)

TRACES_FILE_ENV = "SPLITSERVE_TRACES_FILE"
EXPORTERS = ("otlp", "console", "none")
INSTRUMENTATION_NAME = "splitserve"

# Span attribute names: OpenTelemetry's GenAI conventions where one fits, ours otherwise.
REQUEST_ID = "gen_ai.request.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "splitserve.cached_tokens"

Span = trace.Span
NO_SPAN: Span = trace.INVALID_SPAN  # non-recording: every method is a no-op
Parent = Span | Context | None
Attributes = Mapping[str, str | bool | int | float | Sequence[str] | Sequence[int]]


@dataclass(frozen=True)
class TracingSettings:
    service_name: str
    exporters: tuple[str, ...]  # of EXPORTERS, without "none"
    traces_file: str | None  # SPLITSERVE_TRACES_FILE

    @property
    def is_enabled(self) -> bool:
        return bool(self.exporters) or self.traces_file is not None

    @classmethod
    def from_env(
        cls, default_service_name: str, environ: Mapping[str, str] | None = None
    ) -> TracingSettings:
        """Raises ValueError naming the variable for an exporter we do not know."""
        env = os.environ if environ is None else environ
        service_name = env.get("OTEL_SERVICE_NAME") or default_service_name
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls(service_name, (), None)
        names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",")]
        unknown = [n for n in names if n and n not in EXPORTERS]
        if unknown:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER must name exporters of {EXPORTERS}, got {unknown}"
            )
        exporters = tuple(n for n in dict.fromkeys(names) if n and n != "none")
        return cls(service_name, exporters, env.get(TRACES_FILE_ENV) or None)


# ---- process-wide state -----------------------------------------------------------------------

# One provider per process; None while tracing is off. Kept here rather than in OpenTelemetry's
# global slot, which can be set only once (tests reconfigure).
_provider = None
_tracer: trace.Tracer | None = None
# time.time_ns() - time.monotonic_ns(): turns the engine's monotonic timestamps into span times.
_monotonic_to_epoch_ns = time.time_ns() - time.monotonic_ns()


def configure_tracing(
    default_service_name: str,
    environ: Mapping[str, str] | None = None,
    extra_exporters: Iterable[SpanExporter] = (),
) -> TracingSettings:
    """Sets this process's tracer up from the environment; `extra_exporters` (SpanExporter
    instances, e.g. an in-memory one in tests) are added with synchronous export."""
    global _provider, _tracer
    settings = TracingSettings.from_env(default_service_name, environ)
    shutdown_tracing()
    extra = list(extra_exporters)
    if not settings.is_enabled and not extra:
        return settings
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name}))
    for name in settings.exporters:
        exporter = _named_exporter(name, environ)
        processor = SimpleSpanProcessor if name == "console" else BatchSpanProcessor
        provider.add_span_processor(processor(exporter))
    if settings.traces_file is not None:
        extra.append(JsonLinesSpanExporter(settings.traces_file))
    for exporter in extra:
        # Synchronous: a test reads the spans as soon as the request is answered.
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer(INSTRUMENTATION_NAME)
    logger.info("tracing on: service %s, exporters %s", settings.service_name, settings.exporters)
    return settings


def shutdown_tracing() -> None:
    """Flushes and stops the exporters; tracing is off afterwards."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def is_enabled() -> bool:
    return _tracer is not None


def _named_exporter(name: str, environ: Mapping[str, str] | None):
    if name == "console":
        return ConsoleSpanExporter()
    env = os.environ if environ is None else environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.startswith("http"):
        try:
            # optional: the HTTP exporter is not a dependency of ours
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} needs the package "
                "opentelemetry-exporter-otlp-proto-http; or use grpc"
            ) from None
        return OTLPSpanExporter()
    # lazy: half a second of imports, paid only by a process that exports over OTLP
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


# ---- spans ------------------------------------------------------------------------------------


def start_span(
    name: str,
    parent: Parent = None,
    attributes: Attributes | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    start_time: float | None = None,
) -> Span:
    """A started span (the caller ends it), child of `parent`; `parent=None` means the
    current span (a root span when there is none). `start_time` is a time.monotonic()
    reading. Non-recording while tracing is off."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_span(
        name,
        context=_as_context(parent),
        kind=kind,
        attributes=attributes,
        start_time=None if start_time is None else monotonic_to_ns(start_time),
    )


def record_span(
    name: str,
    parent: Parent,
    start_time: float,
    end_time: float,
    attributes: Attributes | None = None,
) -> None:
    """A span for something already over (times are time.monotonic() readings)."""
    if _tracer is None:
        return
    span = start_span(name, parent, attributes, start_time=start_time)
    span.end(end_time=monotonic_to_ns(end_time))


def end_span(span: Span, error: BaseException | None = None, end_time: float | None = None):
    """Ends `span`, marked failed when `error` is given."""
    if not span.is_recording():
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=None if end_time is None else monotonic_to_ns(end_time))


def child_span(name: str, parent: Parent, attributes: Attributes | None = None):
    """`with child_span(...) as span:` a span around a block, ended (and marked failed on an
    exception) when it leaves; not made current."""
    if _tracer is None:
        return nullcontext(NO_SPAN)
    return span_scope(start_span(name, parent, attributes))


def span_scope(span: Span) -> AbstractContextManager[Span]:
    """`with span_scope(span):` ends an already started `span` when the block leaves: marked
    failed with the exception if one escapes it (cancellation included), plain otherwise. The
    one place the services end a span around a block; it does not make the span current
    (`use_span` inside it does)."""
    return _SpanScope(span)


class _SpanScope:
    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, error_type, error, traceback) -> None:
        end_span(self.span, error)


def use_span(span: Span) -> AbstractContextManager:
    """Makes `span` the current one for a block (children started with `parent=None` and
    outgoing calls' metadata then follow it); does not end it."""
    if not span.is_recording():
        return nullcontext(span)
    return trace.use_span(span, end_on_exit=False)


def current_span() -> Span:
    return trace.get_current_span()


def monotonic_to_ns(seconds: float) -> int:
    return int(seconds * 1e9) + _monotonic_to_epoch_ns


def _as_context(parent: Parent) -> Context | None:
    if parent is None or isinstance(parent, Context):
        return parent
    return trace.set_span_in_context(parent)


def record_engine_spans(
    prefix: str,
    parent: Span,
    steps: RequestSteps | None,
    received_time: float,
    queue_end_time: float | None,
) -> None:
    """`<prefix>.queue` (received until the engine took the request up) and one
    `<prefix>.chunk` per prefill chunk the engine ran for it, under `parent`."""
    if not parent.is_recording():
        return
    if queue_end_time is not None:
        record_span(f"{prefix}.queue", parent, received_time, max(queue_end_time, received_time))
    for index, chunk in enumerate(steps.prefill_chunks if steps is not None else ()):
        attributes = {
            "splitserve.chunk.index": index,
            "splitserve.chunk.start_position": chunk.start_position,
            "splitserve.chunk.num_tokens": chunk.num_tokens,
            "splitserve.chunk.batch_num_tokens": chunk.batch_num_tokens,
        }
        record_span(f"{prefix}.chunk", parent, chunk.start_time, chunk.end_time, attributes)


# ---- propagation ------------------------------------------------------------------------------


def grpc_metadata(parent: Parent = None) -> tuple[tuple[str, str], ...]:
    """Metadata that carries `parent` (default: the current span) to the callee, as W3C
    `traceparent` / `tracestate`; empty while tracing is off."""
    if _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=_as_context(parent))
    return tuple(carrier.items())


def context_from_grpc(servicer_context) -> Context | None:
    """The caller's trace context from an incoming call's metadata; None when tracing is off
    (a span started with it as parent is then a root span)."""
    if _tracer is None:
        return None
    metadata = servicer_context.invocation_metadata() or ()
    return propagate.extract({key: value for key, value in metadata})


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The client's trace context from HTTP headers (`traceparent`), or None."""
    if _tracer is None:
        return None
    return propagate.extract(headers)


# ---- the span file ----------------------------------------------------------------------------


class JsonLinesSpanExporter(SpanExporter):
    """A SpanExporter appending one JSON object per finished span to a file (several processes
    may share it: each span is one write on a file opened for appending)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(
            json.dumps(span_record(span), separators=(",", ":")) + "\n" for span in spans
        )
        with self._lock:
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span) -> dict:
    """A finished SDK span as the plain dict the span file holds."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "parent_span_id": format(span.parent.span_id, "016x") if span.parent else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


def read_span_file(path: str) -> list[dict]:
    """Every span record in a span file, in the order they were written."""
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]
