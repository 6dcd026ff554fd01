"""The request path of ``/v1/completions`` and ``/v1/chat/completions``, top to bottom in one place:

    authenticate -> parse -> shape -> plan -> admit -> legs -> relay

- authenticate: the client key, checked by the app (pd_proxy.api.app, pd_proxy.api.auth) before
  the pipeline is entered, so a caller without a key costs no parsing;
- parse: the body read within ``--max-body-bytes``, checked as vLLM reads it
  (pd_proxy.protocol.parse, pd_proxy.protocol.client_fields), and the request id;
- shape: the body's shape picks the way (pd_proxy.routing.shapes): refused with a 400, decode
  alone, one P/D request per choice (fan-out), or planned;
- plan: a P/D-eligible request's ``Route`` (pd_proxy.routing.planner): the path, the replicas,
  the token ids and the predicted cache hits, decided once;
- admit: the request starts when its route has room, else waits in a bounded queue, fair across
  flows (client keys), else is refused at once with 429/503 and ``Retry-After``
  (pd_proxy.admission); no completion leg goes out before it is admitted (the planner's
  ``/tokenize`` may, docs/proxy/code.md says exactly what a backend hears before admission);
- legs and relay: the mode for the route (pd_proxy.modes) runs the legs and relays the answer.

What the stages raise becomes the client's error here; the request is counted and logged once,
from its ``Trace`` and its ``Route``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from pd_proxy.admission.fair_queue import Flow
from pd_proxy.admission.gate import Gate
from pd_proxy.backends.route import LOCAL, PD, Route
from pd_proxy.call import Call, backend_fields
from pd_proxy.config.key_files import BackendKey
from pd_proxy.legs import CLIENT_GONE, NO_LEASE, Mode
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.protocol.client_fields import estimated_tokens, read_fields, request_priority
from pd_proxy.protocol.endpoints import Endpoint
from pd_proxy.protocol.errors import Passthrough, ProxyError, error_response
from pd_proxy.protocol.parse import BadRequest, parse_request
from pd_proxy.routing.planner import Planner
from pd_proxy.routing.shapes import FANOUT, REFUSE, classify, fanout_size
from pd_proxy.tracing import Trace, Tracing

log = logging.getLogger("pd_proxy.request")

# A background job of the pipeline's parts, run by the app while it serves: (name, work).
Job = tuple[str, Callable[[aiohttp.ClientSession], Coroutine[Any, Any, None]]]


def _ms(seconds: float) -> str:
    return "-" if seconds < 0 else f"{seconds * 1e3:.1f}"


class Caller(Protocol):
    """Who sent a request, as the app's key check found it (pd_proxy.api.auth's ``Client``)."""

    @property
    def flow(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def priority(self) -> int: ...


class Pipeline:
    """The completions endpoints of one app, built when the app starts from the parts the
    server's composition root made (pd_proxy.api.assemble): the ``planner``, the ``gate`` (None:
    admission off), and the mode for each way (``local``: decode alone, ``pd``: the P/D mode the
    settings chose, ``fanout``). ``backend_key`` goes to the backends in the legs' header
    fields; ``max_body_bytes``, ``flow_header`` and ``client_priority`` are the settings of the
    same names."""

    def __init__(
        self,
        *,
        planner: Planner,
        gate: Gate | None,
        local: Mode,
        pd: Mode,
        fanout: Mode,
        metrics: ProxyMetrics,
        tracing: Tracing | None,
        backend_key: BackendKey | None,
        max_body_bytes: int,
        flow_header: str | None,
        client_priority: bool,
    ) -> None:
        self.planner = planner
        self.gate = gate
        self.local = local
        self.pd = pd
        self.fanout = fanout
        self.metrics = metrics
        self.tracing = tracing
        self.backend_key = backend_key
        self.max_body_bytes = max_body_bytes
        self.flow_header = flow_header
        self.client_priority = client_priority

    def jobs(self) -> list[Job]:
        """The background work the pipeline's parts need while the app serves."""
        return self.planner.jobs()

    async def handle(
        self, request: web.Request, endpoint: Endpoint, client: Caller
    ) -> web.StreamResponse:
        """Serve one request to ``endpoint`` (``COMPLETIONS`` or ``CHAT_COMPLETIONS``) from
        ``client``, whose key the app has checked (pd_proxy.api.auth)."""
        start = time.perf_counter()
        metrics = self.metrics
        metrics.in_flight_count += 1
        # 32 hex chars like uuid4().hex, for a fraction of its cost.
        trace = Trace(request.headers.get("X-Request-Id") or os.urandom(16).hex(), start)
        if self.tracing is not None:
            trace.otel = self.tracing.request(request.headers, endpoint, trace.rid)
        try:
            try:
                call = await self._parse(request, endpoint, trace)
                response = await self._serve(call, self._flow(request, client, call), trace)
                if trace.status != CLIENT_GONE:
                    trace.status = response.status
                return response
            except ProxyError as exc:
                trace.status = exc.status
                return error_response(
                    exc.status,
                    exc.message,
                    trace.rid,
                    param=exc.param,
                    code=exc.code,
                    retry_after=exc.retry_after,
                )
            except Passthrough as exc:
                trace.status = exc.status
                return web.Response(
                    status=exc.status,
                    body=exc.body,
                    headers={"Content-Type": exc.content_type, "X-Request-Id": trace.rid},
                )
            except Exception:  # a bug must still answer in JSON, with the trace in our log only
                log.exception("rid=%s unexpected error", trace.rid)
                trace.status = 500
                return error_response(500, "internal proxy error", trace.rid)
        except asyncio.CancelledError:
            trace.status = CLIENT_GONE
            raise
        finally:
            self._done(endpoint, trace, time.perf_counter() - start)

    async def _parse(self, request: web.Request, endpoint: Endpoint, trace: Trace) -> Call:
        body = await self._read_body(request)
        try:
            client_body = parse_request(body, endpoint)
        except BadRequest as exc:
            raise ProxyError(400, str(exc)) from None
        read_fields(client_body)
        rid = trace.rid
        if "\r" in rid or "\n" in rid:  # aiohttp's parser lets none through
            raise ProxyError(400, "X-Request-Id must not contain line breaks")
        return Call(request, endpoint, body, client_body, backend_fields(rid, self.backend_key))

    def _flow(self, request: web.Request, client: Caller, call: Call) -> Flow:
        """Who is asking, for the fair queue: the key's flow, or a trusted gateway's header."""
        name = client.flow
        if self.flow_header is not None:
            name = request.headers.get(self.flow_header) or name
        band = client.priority
        if self.client_priority:
            band += request_priority(call.client_body)
        return Flow(name, client.weight, band)

    async def _serve(self, call: Call, flow: Flow, trace: Trace) -> web.StreamResponse:
        """shape -> plan -> admit -> legs -> relay."""
        decision = classify(call.client_body, call.endpoint)
        way = decision.route
        if way == REFUSE:
            self.metrics.refused.labels(decision.shape.name).inc()
            raise ProxyError(400, decision.refusal(), decision.shape.param)
        mode: Mode
        if way == FANOUT:
            route = Route(PD, decision.shape.name)
            cost = fanout_size(call.client_body, call.endpoint) * estimated_tokens(call.body)
            mode = self.fanout
        else:
            if way == LOCAL:
                route = Route(LOCAL, decision.shape.name)
            else:
                began = time.time()
                route = await self.planner.plan(call, trace)
                if trace.otel is not None:
                    trace.otel.planned(route, began)
            known = route.uncached_tokens
            cost = estimated_tokens(call.body) if known is None else known
            mode = self.local if route.path == LOCAL else self.pd
        if self.gate is None:
            trace.route = route
            return await mode(call, route, trace, NO_LEASE)
        otel = trace.otel
        if otel is None:
            route, lease = await self.gate.admit(route, flow, cost)
        else:
            otel.queued(flow.name)
            try:
                route, lease = await self.gate.admit(route, flow, cost)
            except ProxyError as exc:
                otel.admitted(exc.code or "refused")
                raise
            otel.admitted("admitted", route)
        trace.route = route
        try:
            return await mode(call, route, trace, lease)
        finally:
            lease.release()

    def _done(self, endpoint: Endpoint, trace: Trace, elapsed: float) -> None:
        """Count and log a finished request, once."""
        metrics = self.metrics
        metrics.in_flight_count -= 1
        if trace.otel is not None:
            trace.otel.end(trace.status, trace.path)
        metrics.count_request(endpoint, trace.status, trace.path)
        metrics.request_duration.observe(elapsed)
        if log.isEnabledFor(logging.INFO):
            route = trace.route
            log.info(
                "rid=%s %s status=%d path=%s reason=%s hit=%s prefill=%s decode=%s prefill_ms=%s "
                "ttfb_ms=%s total_ms=%.1f",
                trace.rid,
                endpoint,
                trace.status,
                trace.path,
                "-" if route is None else route.reason,
                "-" if route is None or route.prompt_tokens is None else route.decode_hit,
                trace.prefill,
                trace.decode,
                _ms(trace.prefill_s),
                _ms(trace.ttfb_s),
                elapsed * 1e3,
            )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ProxyError(413, f"request body of {length} bytes exceeds the {limit} byte limit")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds the {limit} byte limit") from None
