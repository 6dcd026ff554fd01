"""What happened to one request: its ``Trace`` (the facts its log line and metrics read, and
the moments its spans are told of; it holds no admission lease and decides nothing), and, with
tracing on, OpenTelemetry spans for the request, its plan, its wait in the admission queue, each
leg and the relay, configured by the standard ``OTEL_*`` variables.

- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``) turns tracing on;
  without one there is no exporter, no SDK import and nothing on the request path but a
  ``None`` check per stage.
- ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` (the
  default, as vLLM's) or ``http/protobuf``; the same two variables configure the vLLM servers.
- ``OTEL_SERVICE_NAME`` (default ``pd-proxy``), ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: read by the SDK itself.
- ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: off whatever the endpoint.

A client's W3C ``traceparent`` is continued. Each leg sends its own span's ``traceparent`` to
vLLM, which makes it the parent of the server's ``llm_request`` span, so one trace shows which
replica did what.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_proxy.backends.route import PD, RoutePath

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from pd_proxy.backends.route import Route
    from pd_proxy.metrics import ProxyMetrics

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"  # vLLM's default: one setting reaches the proxy and every server
SERVICE_NAME = "pd-proxy"
HTTP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's signal path, added to a generic endpoint


class Trace:
    """What happened to one request, for its log line and metrics: filled in as it goes, never
    read to decide anything (the decision is the ``Route``)."""

    __slots__ = (
        "rid",
        "start",
        "path",
        "prefill",
        "decode",
        "prefill_s",
        "ttfb_s",
        "status",
        "otel",
        "route",
    )

    def __init__(self, rid: str, start: float = 0.0) -> None:
        self.rid = rid
        self.start = start  # perf_counter() when the request arrived
        self.path: RoutePath = PD  # or LOCAL: decode alone (pd_proxy.modes.decode_alone)
        self.prefill = "-"
        self.decode = "-"
        self.prefill_s = -1.0
        self.ttfb_s = -1.0
        self.status = 500
        self.otel: RequestSpans | None = None  # the request's spans when tracing is on
        self.route: Route | None = None  # the route it went (for the log line), once admitted

    def first_byte(self, start: float, metrics: ProxyMetrics, sent: bool = False) -> float:
        """The decode leg's first byte arrived (``start``: the leg was sent); returns now. The
        spans start the relay (the legs tell the admission lease, pd_proxy.legs). ``sent``: it
        goes on to the client at once (a relayed stream), see ``sent``."""
        now = time.perf_counter()
        self.ttfb_s = elapsed = now - start
        if self.otel is not None:
            self.otel.first_byte()
        metrics.decode_ttfb.observe(elapsed)
        if sent:
            metrics.ttfb_by_path[self.path].observe(now - self.start)
        return now

    def sent(self, metrics: ProxyMetrics, now: float) -> None:
        """The client gets the first byte of a 200 answer at ``now``."""
        metrics.ttfb_by_path[self.path].observe(now - self.start)


class TracingError(ValueError):
    """The ``OTEL_*`` settings name something the proxy cannot export to."""


@dataclass(frozen=True)
class TracingSettings:
    endpoint: str
    protocol: str


def settings_from(environ: Mapping[str, str]) -> TracingSettings | None:
    """What the environment asks for; None when tracing is off. Pure."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    endpoint = next((environ[v].strip() for v in ENDPOINT_VARS if environ.get(v, "").strip()), "")
    if not endpoint:
        return None
    protocol = next(
        (environ[v].strip() for v in PROTOCOL_VARS if environ.get(v, "").strip()),
        DEFAULT_PROTOCOL,
    )
    if protocol not in PROTOCOLS:
        raise TracingError(f"{PROTOCOL_VARS[0]}={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if protocol == "http/protobuf" and not environ.get(ENDPOINT_VARS[0], "").strip():
        # The generic variable names the collector; the traces signal has its own path there.
        endpoint = endpoint.rstrip("/") + HTTP_TRACES_PATH
    return TracingSettings(endpoint, protocol)


def traceparent(span: Span) -> bytes:
    """The W3C header line that makes ``span`` a remote parent, as raw header bytes."""
    ctx = span.get_span_context()
    line = f"traceparent: 00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}\r\n"
    return line.encode("ascii")


class Tracing:
    """The proxy's tracer provider and exporter (built once per process, when the app starts)."""

    def __init__(self, settings: TracingSettings) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; ours is the default.
        defaults = Resource({SERVICE_KEY: SERVICE_NAME})
        resource = defaults.merge(Resource.create())
        if str(resource.attributes.get(SERVICE_KEY, "")).startswith("unknown_service"):
            resource = resource.merge(defaults)
        self.settings = settings
        self.provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint))
        )
        self.tracer: Tracer = self.provider.get_tracer("pd_proxy")
        self._propagator = TraceContextTextMapPropagator()

    def request(self, headers: Mapping[str, str], endpoint: str, rid: str) -> RequestSpans:
        """The spans of one request, under the client's ``traceparent`` when it sent one."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(
            f"POST {endpoint}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": endpoint, "pd.request_id": rid},
        )
        return RequestSpans(self.tracer, span)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch still holds


class RequestSpans:
    """One request's spans: the request span and its children, started and ended explicitly
    (a leg's span ends when the leg does, which is not where a ``with`` block would end)."""

    __slots__ = ("_tracer", "span", "_context", "_kv", "_queue", "_relay")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracer = tracer
        self.span = span
        self._context = set_span_in_context(span)
        self._kv: dict[str, Any] | None = None
        self._queue: Span | None = None
        self._relay: Span | None = None

    def _child(self, name: str, attributes: dict[str, Any], client: bool = False) -> Span:
        from opentelemetry.trace import SpanKind

        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        return self._tracer.start_span(
            name, context=self._context, kind=kind, attributes=attributes
        )

    def planned(self, route: Route, start: float) -> None:
        """The plan stage, from ``start`` (``time.time()``) to now, with the route it chose."""
        span = self._tracer.start_span(
            "plan",
            context=self._context,
            start_time=int(start * 1e9),
            attributes=route_attributes(route),
        )
        span.end()

    def queued(self, flow: str) -> None:
        self._queue = self._child("admission queue", {"pd.flow": flow})

    def admitted(self, outcome: str, route: Route | None = None) -> None:
        span, self._queue = self._queue, None
        if span is None:
            return
        span.set_attribute("pd.admission", outcome)
        if route is not None:
            span.set_attributes(route_attributes(route))
        span.end()

    def kv_params(self, kv: Any) -> None:
        """The prefill's ``kv_transfer_params``: the decode leg's span names the remote request."""
        self._kv = kv if isinstance(kv, dict) else None

    def leg(self, role: str, path: str, backend: str) -> Span:
        attributes: dict[str, Any] = {"pd.leg": role, "url.path": path, "server.address": backend}
        kv = self._kv
        if role == "decode" and kv is not None:
            for key in ("remote_request_id", "remote_engine_id", "remote_host"):
                if kv.get(key) is not None:
                    attributes[f"pd.kv.{key}"] = str(kv[key])
        name = (
            "prefill leg" if role == "prefill" else "decode leg" if path.startswith("/v1") else path
        )
        return self._child(name, attributes, client=True)

    def first_byte(self) -> None:
        """Decode's first byte: the relay to the client starts."""
        if self._relay is None:
            self._relay = self._child("relay", {})

    def end(self, status: int, path: str) -> None:
        for span in (self._relay, self._queue):
            if span is not None:
                span.end()
        self.span.set_attribute("http.response.status_code", status)
        self.span.set_attribute("pd.path", path)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


def end_leg(span: Span, status: int | None, error: str | None = None) -> None:
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def route_attributes(route: Route) -> dict[str, Any]:
    """The span attributes of a route: what was decided, where, and what was predicted."""
    out: dict[str, Any] = {"pd.route.path": route.path, "pd.route.reason": route.reason}
    if route.prefill is not None:
        out["pd.route.prefill"] = route.prefill.url
    if route.decode is not None:
        out["pd.route.decode"] = route.decode.url
    if route.prompt_tokens is not None:
        out["pd.route.prompt_tokens"] = route.prompt_tokens
        out["pd.route.decode_hit_tokens"] = route.decode_hit
        out["pd.route.prefill_hit_tokens"] = route.prefill_hit
    uncached = route.uncached_tokens
    if uncached is not None:
        out["pd.route.uncached_tokens"] = uncached
    return out


def now() -> float:
    return time.time()
