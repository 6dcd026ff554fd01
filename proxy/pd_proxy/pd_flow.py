"""The handlers of ``/v1/completions`` and ``/v1/chat/completions``: a request's life around its
legs.

A handler reads and checks the body, hands the request to the mode chosen at start-up
(pd_proxy.modes, made of pd_proxy.legs), turns what it raises into the client's error, and counts
and logs the request: metrics, timings and one log line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from aiohttp import web

from pd_proxy import modes
from pd_proxy.auth import BackendKey
from pd_proxy.config import ProxyConfig
from pd_proxy.errors import Passthrough, ProxyError, error_response
from pd_proxy.legs import CLIENT_GONE, Legs, Trace
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.pool import BackendPool
from pd_proxy.request_fields import read_fields
from pd_proxy.rewrite import BadRequest, parse_request
from pd_proxy.upstream import Upstream

log = logging.getLogger("pd_proxy.request")


def _ms(seconds: float) -> str:
    return "-" if seconds < 0 else f"{seconds * 1e3:.1f}"


class PdFlow:
    """The two completions endpoints of one app, on its ``upstream`` client (pd_proxy.app builds
    it when the app starts)."""

    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        prefill: BackendPool,
        decode: BackendPool,
        upstream: Upstream,
        backend_key: BackendKey | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.legs = Legs(config, metrics, prefill, decode, upstream, backend_key)
        self.mode = modes.select(self.legs)
        # The first-token mode when it is the P/D one (its block sizes and counters), else None.
        pd = self.mode.pd if isinstance(self.mode, modes.ByShapeMode) else self.mode
        self.first_token = pd if isinstance(pd, modes.FirstTokenMode) else None
        # Cache-aware routing's planner (pd_proxy.cache), whose watch loop the app runs.
        self.cache_router = getattr(self.mode, "cache", None)

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """Serve one request to ``endpoint`` (``COMPLETIONS`` or ``CHAT_COMPLETIONS``)."""
        start = time.perf_counter()
        metrics = self.metrics
        metrics.in_flight_count += 1
        # 32 hex chars like uuid4().hex, for a fraction of its cost.
        trace = Trace(request.headers.get("X-Request-Id") or os.urandom(16).hex(), start)
        try:
            try:
                body = await self._read_body(request)
                try:
                    client_body = parse_request(body, endpoint)
                except BadRequest as exc:
                    raise ProxyError(400, str(exc)) from None
                read_fields(client_body)
                rid = trace.rid
                if "\r" in rid or "\n" in rid:  # aiohttp's parser lets none through
                    raise ProxyError(400, "X-Request-Id must not contain line breaks")
                headers = self.legs.backend_headers(rid)
                response = await self.mode(request, endpoint, body, client_body, headers, trace)
                if trace.status != CLIENT_GONE:
                    trace.status = response.status
                return response
            except ProxyError as exc:
                trace.status = exc.status
                return error_response(exc.status, exc.message, trace.rid, exc.param)
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
            elapsed = time.perf_counter() - start
            metrics.in_flight_count -= 1
            metrics.count_request(endpoint, trace.status, trace.path)
            metrics.request_duration.observe(elapsed)
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "rid=%s %s status=%d path=%s prefill=%s decode=%s prefill_ms=%s ttfb_ms=%s "
                    "total_ms=%.1f",
                    trace.rid,
                    endpoint,
                    trace.status,
                    trace.path,
                    trace.prefill,
                    trace.decode,
                    _ms(trace.prefill_s),
                    _ms(trace.ttfb_s),
                    elapsed * 1e3,
                )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ProxyError(413, f"request body of {length} bytes exceeds the {limit} byte limit")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds the {limit} byte limit") from None
