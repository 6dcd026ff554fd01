"""HTTP handlers: the two-leg P/D flow, health, models and metrics.

Both legs go through pd_proxy.upstream (a lean keep-alive HTTP/1.1 client); health checks and
``/v1/models`` use the aiohttp session. The decode path relays upstream bytes as they arrive (no
per-chunk parsing); only the last chunk is kept, to know whether a broken stream needs an event
separator before its error event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pd_proxy.auth import BackendKey, ClientKeys
from pd_proxy.config import ProxyConfig
from pd_proxy.discovery import Discovery
from pd_proxy.errors import Passthrough, ProxyError, error_response, sse_error_event
from pd_proxy.metrics import CONTENT_TYPE, ProxyMetrics
from pd_proxy.pool import Backend, BackendPool, HealthChecker
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
from pd_proxy.upstream import (
    LARGE_BODY,
    ConnectFailed,
    Connection,
    Upstream,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
)

log = logging.getLogger("pd_proxy.request")

CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent
# Errors that mean the request never reached the backend, so another one may take it.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
T = TypeVar("T")


class RelayResponse(web.StreamResponse):
    """A stream whose headers leave with its first chunk: one send instead of two.

    aiohttp's own ``Response`` opts into this buffering; for a relay it costs nothing, since the
    client cannot act on the headers before the first token anyway.
    """

    _send_headers_immediately = False


class Trace:
    """Per-request facts for the log line."""

    __slots__ = ("rid", "prefill", "decode", "prefill_s", "ttfb_s", "status")

    def __init__(self, rid: str) -> None:
        self.rid = rid
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


class ProxyHandlers:
    """Bound to one app; ``session`` is set when the app starts (it needs a running loop)."""

    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        prefill: BackendPool,
        decode: BackendPool,
        client_keys: ClientKeys | None = None,
        backend_key: BackendKey | None = None,
    ) -> None:
        self.config = config
        self.client_keys = client_keys  # checked in front of the handlers (app.py)
        self.backend_key = backend_key
        self.metrics = metrics
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.session: aiohttp.ClientSession | None = None  # health checks, /v1/models
        self.upstream: Upstream | None = None  # the two legs
        self.checker: HealthChecker | None = None
        self.discovery: Discovery | None = None  # set by build_app when backends are discovered
        self.draining = False
        # /v1/models (aiohttp); the legs' limits are passed to the upstream client as numbers.
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout, sock_connect=config.connect_timeout
        )
        # The tail of each stage's 504 message (decode's timeout bounds silence, not the total).
        self._timeout_text = {
            "prefill": f"timed out after {config.prefill_timeout:g}s",
            "decode": f"sent nothing for {config.decode_timeout:g}s",
        }

    # ----------------------------------------------------------------- completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, CHAT_COMPLETIONS)

    async def _proxy(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        start = time.perf_counter()
        metrics = self.metrics
        metrics.in_flight_count += 1
        # 32 hex chars like uuid4().hex, for a fraction of its cost.
        trace = Trace(request.headers.get("X-Request-Id") or os.urandom(16).hex())
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

    def _pick(self, pool: BackendPool, exclude: Backend | None = None) -> Backend:
        backend = pool.pick(exclude)
        if backend is None:
            raise ProxyError(
                503, f"no healthy {pool.role} backend (down: {', '.join(pool.down()) or 'none'})"
            )
        return backend

    def _mark_down(self, backend: Backend, stage: str) -> None:
        """Passive health: a refused connection takes the backend out until a check passes."""
        backend.healthy = False
        self.metrics.set_health(backend.role, backend.url, False)
        self.metrics.backend_error(stage, backend.url)

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
        backend = self._pick(pool)
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
                self._mark_down(backend, stage)
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
            raise self._backend_refused_key("prefill", backend)
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

        async def relay(backend: Backend, resp: Connection) -> web.StreamResponse:
            trace.decode = backend.url
            return await self._relay(request, resp, backend, start, trace)

        # decode_timeout bounds the silence: before the headers and between stream chunks.
        return await self._exchange(
            self.decode_pool,
            endpoint,
            payload,
            headers,
            None,
            self.config.decode_timeout,
            trace,
            relay,
        )

    async def _relay(
        self,
        request: web.Request,
        resp: Connection,
        backend: Backend,
        start: float,
        trace: Trace,
    ) -> web.StreamResponse:
        content_type = resp.headers.get("content-type", "application/json")
        if resp.status != 200 or not content_type.startswith("text/event-stream"):
            # Read failures (timeout, broken connection) are mapped by _exchange, as for prefill.
            data = await resp.read()
            self._first_byte(start, trace)
            if resp.status == 401:
                raise self._backend_refused_key("decode", backend)
            if 400 <= resp.status < 500:
                raise Passthrough(resp.status, data, content_type)
            if resp.status != 200:
                self.metrics.backend_error("decode", backend.url)
                raise ProxyError(
                    502, f"decode backend {backend.url} returned {resp.status}: {_snippet(data)}"
                )
            return web.Response(
                body=data, headers={"Content-Type": content_type, "X-Request-Id": trace.rid}
            )

        out = RelayResponse(
            headers={
                "Content-Type": content_type,
                "Cache-Control": "no-cache",
                "X-Request-Id": trace.rid,
            }
        )
        await out.prepare(request)
        last = b"\n\n"
        failure: BaseException | None = None
        chunk = await self._read_chunk(resp)
        if isinstance(chunk, bytes):
            self._first_byte(start, trace)
        while isinstance(chunk, bytes) and chunk:
            try:
                if resp.at_eof():
                    # Last chunk: send it with the chunked terminator in one write.
                    await out.write_eof(chunk)
                    return out
                await out.write(chunk)
            except (ConnectionResetError, aiohttp.ClientConnectionError):
                trace.status = CLIENT_GONE
                return out
            last = chunk
            chunk = await self._read_chunk(resp)
        if not isinstance(chunk, bytes):
            failure = chunk
            self.metrics.backend_error("decode", backend.url)
            if isinstance(failure, UpstreamTimeout):
                status, message = (
                    504,
                    (
                        f"decode backend {backend.url} sent nothing for "
                        f"{self.config.decode_timeout:g}s"
                    ),
                )
            else:
                status, message = 502, f"decode backend {backend.url} broke the stream: {failure}"
            log.warning("rid=%s %s", trace.rid, message)
            try:
                await out.write(sse_error_event(status, message, not last.endswith(b"\n\n")))
            except (ConnectionResetError, aiohttp.ClientConnectionError):
                trace.status = CLIENT_GONE
                return out
        try:
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            trace.status = CLIENT_GONE
        return out

    def _backend_refused_key(self, stage: str, backend: Backend) -> ProxyError:
        """A backend's 401 is about the proxy's key, not the client's: a 502 that says so."""
        self.metrics.backend_error(stage, backend.url)
        if self.backend_key is None:
            hint = "set --backend-api-key-file (PD_PROXY_BACKEND_API_KEY_FILE) to its --api-key"
        else:
            hint = f"check the key in {self.backend_key.path}"
        message = f"{backend.role} backend {backend.url} rejected the proxy's API key"
        log.error("%s: %s", message, hint)
        return ProxyError(502, message)

    @staticmethod
    async def _read_chunk(resp: Connection) -> bytes | UpstreamError:
        """Next upstream chunk, b"" at a clean end, or the exception that broke the stream."""
        try:
            return await resp.readany()
        except UpstreamError as exc:
            return exc

    def _first_byte(self, start: float, trace: Trace) -> None:
        trace.ttfb_s = elapsed = time.perf_counter() - start
        self.metrics.decode_ttfb.observe(elapsed)

    # ----------------------------------------------------------------- other endpoints
    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models`` answered by a decode backend (it serves the same model)."""
        assert self.session is not None
        status = 500
        backend: Backend | None = None
        try:
            backend = self._pick(self.decode_pool)
            backend.outstanding += 1  # a draining backend is dropped only once this is done
            headers = {}
            if self.backend_key is not None:
                headers["Authorization"] = self.backend_key.header()
            try:
                async with self.session.get(
                    backend.endpoint("/v1/models"), headers=headers, timeout=self.prefill_timeout
                ) as resp:
                    data = await resp.read()
                    status = resp.status
                    content_type = resp.headers.get("Content-Type", "application/json")
            except CONNECT_ERRORS as exc:
                self._mark_down(backend, "models")
                raise ProxyError(502, f"decode backend {backend.url} unreachable: {exc}") from None
            except asyncio.TimeoutError:
                self.metrics.backend_error("models", backend.url)
                raise ProxyError(504, f"decode backend {backend.url} timed out") from None
            except aiohttp.ClientError as exc:
                self.metrics.backend_error("models", backend.url)
                raise ProxyError(502, f"decode backend {backend.url} failed: {exc!r}") from None
            if status == 401:
                raise self._backend_refused_key("models", backend)
            if status >= 500:
                self.metrics.backend_error("models", backend.url)
                raise ProxyError(502, f"decode backend {backend.url} returned {status}")
            return web.Response(status=status, body=data, headers={"Content-Type": content_type})
        except ProxyError as exc:
            status = exc.status
            return error_response(exc.status, exc.message)
        finally:
            if backend is not None:
                backend.outstanding -= 1
            self.metrics.count_request("/v1/models", status)

    async def health(self, request: web.Request) -> web.Response:
        """200 while a prefill and a decode backend are healthy; else 503 naming what is down.

        Draining backends (discovery dropped them; in-flight requests finishing) are listed apart:
        they take no new requests, so they count neither as healthy nor as down.
        """
        pools = (self.prefill_pool, self.decode_pool)
        body: dict[str, Any] = {
            pool.role: {b.url: b.healthy for b in pool.backends} for pool in pools
        }
        body["draining"] = [b.url for p in pools for b in p.draining]
        problems = [f"no healthy {p.role} backend" for p in pools if not p.healthy()]
        if self.draining:
            problems.append("proxy is shutting down")
        down = [url for p in pools for url in p.down()]
        body["down"] = down
        if problems:
            body["status"] = "unavailable"
            body["error"] = {
                "message": "; ".join(problems) + (f" (down: {', '.join(down)})" if down else ""),
                "type": "service_unavailable",
                "code": 503,
            }
            return web.json_response(body, status=503)
        body["status"] = "ok"
        return web.json_response(body)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def not_found(self, request: web.Request) -> web.Response:
        if request.path in (COMPLETIONS, CHAT_COMPLETIONS):
            return error_response(
                405, f"{request.method} is not allowed on {request.path}; use POST"
            )
        return error_response(404, f"no route for {request.method} {request.path}")
