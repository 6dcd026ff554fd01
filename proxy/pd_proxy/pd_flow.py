"""The two-leg P/D flow of a completions request: the prefill leg, then the decode leg.

This is where a request's life is decided: body checks, backend choice with one retry on a
refused connection, the error each failure becomes, timings and the request's log line. Both legs
go through pd_proxy.upstream (a lean keep-alive HTTP/1.1 client); the request JSON is built by
pd_proxy.rewrite, and a streamed decode answer goes back through pd_proxy.sse_relay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from pd_proxy.auth import BackendKey
from pd_proxy.config import ProxyConfig
from pd_proxy.errors import Passthrough, ProxyError, error_response
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.pool import Backend, BackendPool
from pd_proxy.rewrite import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    BadRequest,
    decode_payload,
    dumps,
    kv_params_from_prefill,
    parse_request,
    prefill_body,
)
from pd_proxy.sse_relay import relay_stream
from pd_proxy.upstream import (
    LARGE_BODY,
    ConnectFailed,
    Connection,
    Upstream,
    UpstreamBroken,
    UpstreamTimeout,
)

log = logging.getLogger("pd_proxy.request")

CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent
T = TypeVar("T")


class Trace:
    """Per-request facts for the log line."""

    __slots__ = ("rid", "start", "prefill", "decode", "prefill_s", "ttfb_s", "status")

    def __init__(self, rid: str, start: float = 0.0) -> None:
        self.rid = rid
        self.start = start  # perf_counter() when the request arrived
        self.prefill = "-"
        self.decode = "-"
        self.prefill_s = -1.0
        self.ttfb_s = -1.0
        self.status = 500


def _ms(seconds: float) -> str:
    return "-" if seconds < 0 else f"{seconds * 1e3:.1f}"


def _snippet(data: bytes, limit: int = 200) -> str:
    return data[:limit].decode("utf-8", "replace")


async def _read_whole(backend: Backend, resp: Connection) -> tuple[Backend, int, bytes, str]:
    """Prefill answers are small JSON: read them whole while the backend still counts them."""
    data = await resp.read()
    return backend, resp.status, data, resp.headers.get("content-type", "application/json")


def pick(pool: BackendPool, exclude: Backend | None = None) -> Backend:
    """The backend for a request to ``pool``; a 503 naming the down ones when none is healthy."""
    backend = pool.pick(exclude)
    if backend is None:
        raise ProxyError(
            503, f"no healthy {pool.role} backend (down: {', '.join(pool.down()) or 'none'})"
        )
    return backend


def mark_down(metrics: ProxyMetrics, backend: Backend, stage: str) -> None:
    """Passive health: a refused connection takes the backend out until a check passes."""
    backend.healthy = False
    metrics.set_health(backend.role, backend.url, False)
    metrics.backend_error(stage, backend.url)


def backend_refused_key(
    metrics: ProxyMetrics, backend_key: BackendKey | None, stage: str, backend: Backend
) -> ProxyError:
    """A backend's 401 is about the proxy's key, not the client's: a 502 that says so."""
    metrics.backend_error(stage, backend.url)
    if backend_key is None:
        hint = "set --backend-api-key-file (PD_PROXY_BACKEND_API_KEY_FILE) to its --api-key"
    else:
        hint = f"check the key in {backend_key.path}"
    message = f"{backend.role} backend {backend.url} rejected the proxy's API key"
    log.error("%s: %s", message, hint)
    return ProxyError(502, message)


class PdFlow:
    """``/v1/completions`` and ``/v1/chat/completions`` for one app; ``upstream`` is set when the
    app starts (it needs a running loop)."""

    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        prefill: BackendPool,
        decode: BackendPool,
        backend_key: BackendKey | None = None,
    ) -> None:
        self.config = config
        self.backend_key = backend_key
        self.metrics = metrics
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.upstream: Upstream | None = None  # the two legs
        # The tail of each stage's 504 message (decode's timeout bounds silence, not the total).
        self._timeout_text = {
            "prefill": f"timed out after {config.prefill_timeout:g}s",
            "decode": f"sent nothing for {config.decode_timeout:g}s",
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, CHAT_COMPLETIONS)

    async def _proxy(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        start = time.perf_counter()
        metrics = self.metrics
        metrics.in_flight_count += 1
        # 32 hex chars like uuid4().hex, for a fraction of its cost.
        trace = Trace(request.headers.get("X-Request-Id") or os.urandom(16).hex(), start)
        try:
            try:
                response = await self._two_legs(request, endpoint, trace)
                if trace.status != CLIENT_GONE:
                    trace.status = response.status
                return response
            except ProxyError as exc:
                trace.status = exc.status
                return error_response(exc.status, exc.message, trace.rid)
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
            metrics.count_request(endpoint, trace.status)
            metrics.request_duration.observe(elapsed)
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "rid=%s %s status=%d prefill=%s decode=%s prefill_ms=%s ttfb_ms=%s "
                    "total_ms=%.1f",
                    trace.rid,
                    endpoint,
                    trace.status,
                    trace.prefill,
                    trace.decode,
                    _ms(trace.prefill_s),
                    _ms(trace.ttfb_s),
                    elapsed * 1e3,
                )

    async def _two_legs(
        self, request: web.Request, endpoint: str, trace: Trace
    ) -> web.StreamResponse:
        body = await self._read_body(request)
        try:
            client_body = parse_request(body, endpoint)
        except BadRequest as exc:
            raise ProxyError(400, str(exc)) from None
        # The client's Authorization is never forwarded: its key is for the proxy only. These
        # header lines follow each backend's fixed ones (Backend.post_head).
        rid = trace.rid.encode("utf-8", "surrogateescape")
        if b"\r" in rid or b"\n" in rid:  # aiohttp's parser lets none through; never split a head
            raise ProxyError(400, "X-Request-Id must not contain line breaks")
        headers = b"X-Request-Id: " + rid + b"\r\n"
        if self.backend_key is not None:
            headers += b"Authorization: " + self.backend_key.header().encode() + b"\r\n"
        kv_params = await self._prefill(endpoint, client_body, headers, trace)
        payload = decode_payload(body, client_body, kv_params)
        return await self._decode(request, endpoint, payload, headers, trace)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ProxyError(413, f"request body of {length} bytes exceeds the {limit} byte limit")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds the {limit} byte limit") from None

    async def _exchange(
        self,
        pool: BackendPool,
        path: str,
        payload: bytes,
        headers: bytes,
        total: float | None,
        silence: float | None,
        trace: Trace,
        consume: Callable[[Backend, Connection], Awaitable[T]],
    ) -> T:
        """POST to the least-busy backend of ``pool`` and hand its response to ``consume``.

        One leg's whole life (connect, headers, body) sits inside one ``outstanding`` increment,
        so a cancelled client cannot leak it. A refused connection marks the backend down and
        retries once on another; upstream errors while posting or consuming become ``ProxyError``.
        ``total`` bounds each attempt (connect included), ``silence`` each wait for the backend.
        """
        upstream = self.upstream
        assert upstream is not None
        stage = pool.role
        backend = pick(pool)
        length = b"Content-Length: %d\r\n\r\n" % len(payload)
        for attempt in (0, 1):
            backend.outstanding += 1
            try:
                head = backend.post_head(path) + headers + length
                data = head + payload if len(payload) < LARGE_BODY else [head, payload]
                deadline = None if total is None else upstream.loop.time() + total
                resp = await upstream.request(backend.address, data, deadline, silence)
                try:
                    return await consume(backend, resp)
                finally:
                    resp.release()  # closes the connection if the body was not read to the end
            except ConnectFailed as exc:
                mark_down(self.metrics, backend, stage)
                retry = pool.pick(exclude=backend)
                if attempt == 0 and retry is not None:
                    log.warning(
                        "rid=%s %s %s unreachable, retrying on %s",
                        trace.rid,
                        stage,
                        backend.url,
                        retry.url,
                    )
                    backend = retry
                    continue
                raise ProxyError(502, f"{stage} backend {backend.url} unreachable: {exc}") from None
            except UpstreamTimeout:
                self.metrics.backend_error(stage, backend.url)
                raise ProxyError(
                    504, f"{stage} backend {backend.url} {self._timeout_text[stage]}"
                ) from None
            except UpstreamBroken as exc:
                self.metrics.backend_error(stage, backend.url)
                raise ProxyError(502, f"{stage} backend {backend.url} failed: {exc}") from None
            finally:
                backend.outstanding -= 1
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _prefill(
        self, endpoint: str, client_body: dict[str, Any], headers: bytes, trace: Trace
    ) -> Any:
        payload = dumps(prefill_body(client_body))
        start = time.perf_counter()
        backend, status, data, content_type = await self._exchange(
            self.prefill_pool,
            endpoint,
            payload,
            headers,
            self.config.prefill_timeout,
            None,
            trace,
            _read_whole,
        )
        trace.prefill = backend.url
        trace.prefill_s = elapsed = time.perf_counter() - start
        self.metrics.prefill_duration.observe(elapsed)
        if status == 401:
            raise backend_refused_key(self.metrics, self.backend_key, "prefill", backend)
        if 400 <= status < 500:
            raise Passthrough(status, data, content_type)
        if status != 200:
            self.metrics.backend_error("prefill", backend.url)
            raise ProxyError(
                502, f"prefill backend {backend.url} returned {status}: {_snippet(data)}"
            )
        try:
            return kv_params_from_prefill(data)
        except ValueError:
            self.metrics.backend_error("prefill", backend.url)
            raise ProxyError(
                502, f"prefill backend {backend.url} returned invalid JSON: {_snippet(data)}"
            ) from None

    async def _decode(
        self,
        request: web.Request,
        endpoint: str,
        payload: bytes,
        headers: bytes,
        trace: Trace,
    ) -> web.StreamResponse:
        start = time.perf_counter()

        async def answer(backend: Backend, resp: Connection) -> web.StreamResponse:
            trace.decode = backend.url
            return await self._answer(request, resp, backend, start, trace)

        # decode_timeout bounds the silence: before the headers and between stream chunks.
        return await self._exchange(
            self.decode_pool,
            endpoint,
            payload,
            headers,
            None,
            self.config.decode_timeout,
            trace,
            answer,
        )

    async def _answer(
        self,
        request: web.Request,
        resp: Connection,
        backend: Backend,
        start: float,
        trace: Trace,
    ) -> web.StreamResponse:
        """The decode leg's answer to the client: an error or JSON whole, a stream relayed."""
        content_type = resp.headers.get("content-type", "application/json")
        if resp.status != 200 or not content_type.startswith("text/event-stream"):
            # Read failures (timeout, broken connection) are mapped by _exchange, as for prefill.
            data = await resp.read()
            now = self._first_byte(start, trace)
            if resp.status == 401:
                raise backend_refused_key(self.metrics, self.backend_key, "decode", backend)
            if 400 <= resp.status < 500:
                raise Passthrough(resp.status, data, content_type)
            if resp.status != 200:
                self.metrics.backend_error("decode", backend.url)
                raise ProxyError(
                    502, f"decode backend {backend.url} returned {resp.status}: {_snippet(data)}"
                )
            self.sent(trace, now)
            return web.Response(
                body=data, headers={"Content-Type": content_type, "X-Request-Id": trace.rid}
            )
        out, client_left = await relay_stream(
            request,
            resp,
            content_type,
            trace.rid,
            backend,
            self.metrics,
            self.config.decode_timeout,
            lambda: self._first_byte(start, trace, sent=True),
        )
        if client_left:
            trace.status = CLIENT_GONE
        return out

    def _first_byte(self, start: float, trace: Trace, sent: bool = False) -> float:
        """The decode leg's first byte arrived (``start``: the leg was sent); returns now.
        ``sent``: it goes on to the client at once (a relayed stream), see ``sent``."""
        now = time.perf_counter()
        trace.ttfb_s = elapsed = now - start
        self.metrics.decode_ttfb.observe(elapsed)
        if sent:
            self.metrics.time_to_first_byte.observe(now - trace.start)
        return now

    def sent(self, trace: Trace, now: float) -> None:
        """The client gets the first byte of a 200 answer at ``now``."""
        self.metrics.time_to_first_byte.observe(now - trace.start)
