"""The two-leg P/D flow of a completions request: the prefill leg, then the decode leg.

This is where a request's life is decided: body checks, backend choice with one retry on a
refused connection, the error each failure becomes, timings and the request's log line. Both legs
go through pd_proxy.upstream (a lean keep-alive HTTP/1.1 client); the request JSON is built by
pd_proxy.rewrite, and a streamed decode answer goes back through pd_proxy.sse_relay. With
``--first-token-from-prefill``, ``FirstTokenMode`` runs the legs (protocol: pd_proxy.first_token).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from pd_proxy import first_token as ft
from pd_proxy.auth import BackendKey
from pd_proxy.block_size import BlockSizes
from pd_proxy.config import ProxyConfig
from pd_proxy.errors import Passthrough, ProxyError, error_response, sse_error_event
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.pool import Backend, BackendPool
from pd_proxy.rewrite import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    BadRequest,
    decode_payload,
    dumps,
    kv_params_from_prefill,
    loads,
    parse_request,
    prefill_body,
)
from pd_proxy.shape_routes import ShapeRoutes
from pd_proxy.sse_relay import CLIENT_LEFT, RelayResponse, relay_events, relay_stream
from pd_proxy.upstream import (
    ConnectFailed,
    Reply,
    StaleConnection,
    Upstream,
    UpstreamBroken,
    UpstreamTimeout,
)

SSE_TYPE = "text/event-stream; charset=utf-8"  # vLLM's
JSON_TYPE = "application/json"
# pd_proxy_first_token_requests_total outcomes (FirstTokenMode).
CONTINUED, FINISHED, NORMAL = "continued", "finished", "normal"

log = logging.getLogger("pd_proxy.request")

CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent
T = TypeVar("T")


class Trace:
    """Per-request facts for the log line."""

    __slots__ = ("rid", "start", "path", "prefill", "decode", "prefill_s", "ttfb_s", "status")

    def __init__(self, rid: str, start: float = 0.0) -> None:
        self.rid = rid
        self.start = start  # perf_counter() when the request arrived
        self.path = "pd"  # or "local": decode alone (pd_proxy.shape_routes)
        self.prefill = "-"
        self.decode = "-"
        self.prefill_s = -1.0
        self.ttfb_s = -1.0
        self.status = 500


def _ms(seconds: float) -> str:
    return "-" if seconds < 0 else f"{seconds * 1e3:.1f}"


def _snippet(data: bytes, limit: int = 200) -> str:
    return data[:limit].decode("utf-8", "replace")


async def read_whole(backend: Backend, resp: Reply) -> tuple[Backend, int, bytes, str]:
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
        self.shapes = ShapeRoutes(self, config.local_prefill_max_tokens)
        self.first_token: FirstTokenMode | None = None
        if config.first_token_from_prefill:
            self.first_token = FirstTokenMode(self)

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
        rid = trace.rid
        if "\r" in rid or "\n" in rid:  # aiohttp's parser lets none through; never split a head
            raise ProxyError(400, "X-Request-Id must not contain line breaks")
        headers = self.backend_headers(rid)
        response = await self.shapes.route(request, endpoint, body, client_body, headers, trace)
        if response is not None:
            return response  # refused, decode alone, or fanned out (pd_proxy.shape_routes)
        if self.first_token is not None:
            response = await self.first_token.legs(
                request, endpoint, body, client_body, headers, trace
            )
            if response is not None:
                return response  # None: the request takes the normal flow
        # The normal flow: prefill for the KV, decode for the whole answer. Inline, not a method
        # of its own: each coroutine frame costs the proxy about 1% of its CPU per request.
        prefill = dumps(prefill_body(client_body))
        backend, data = await self.prefill_leg(endpoint, prefill, headers, trace)
        try:
            kv_params = kv_params_from_prefill(data)
        except ValueError:
            raise self.invalid_prefill_json(backend, data) from None
        payload = decode_payload(body, client_body, kv_params)
        return await self.decode(request, endpoint, payload, headers, trace)

    def backend_headers(self, rid: str) -> dict[str, str]:
        """The header fields both legs add: the client's Authorization is never forwarded (its
        key is for the proxy only), the backend key is sent instead."""
        if self.backend_key is None:
            return {"X-Request-Id": rid}
        return {"X-Request-Id": rid, "Authorization": self.backend_key.header()}

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ProxyError(413, f"request body of {length} bytes exceeds the {limit} byte limit")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds the {limit} byte limit") from None

    async def exchange(
        self,
        pool: BackendPool,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        total: float | None,
        silence: float | None,
        trace: Trace,
        consume: Callable[[Backend, Reply], Awaitable[T]],
        retry_stale: bool = False,
    ) -> T:
        """POST to the least-busy backend of ``pool`` and hand its response to ``consume``.

        One leg's whole life (connect, headers, body) sits inside one ``outstanding`` increment,
        so a cancelled client cannot leak it. A refused connection marks the backend down and
        retries once on another; with ``retry_stale`` (the prefill leg), a reused connection that
        closed before any answer sends the request once more, on a new connection to the same
        backend. Other upstream errors while posting or consuming become ``ProxyError``.
        ``total`` bounds each attempt (connect included), ``silence`` each wait for the backend.
        """
        upstream = self.upstream
        assert upstream is not None
        stage = pool.role
        backend = pick(pool)
        for attempt in (0, 1):
            backend.outstanding += 1
            try:
                deadline = None if total is None else upstream.loop.time() + total
                resp = await upstream.post(backend, path, headers, payload, deadline, silence)
                try:
                    return await consume(backend, resp)
                finally:
                    resp.release()  # closes the connection if the body was not read to the end
            except StaleConnection as exc:
                if attempt == 0 and retry_stale:  # the same backend, on a new connection
                    log.info("rid=%s %s %s: %s, sending again", trace.rid, stage, backend.url, exc)
                    continue
                self.metrics.backend_error(stage, backend.url)
                raise ProxyError(502, f"{stage} backend {backend.url} failed: {exc}") from None
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

    def invalid_prefill_json(self, backend: Backend, data: bytes) -> ProxyError:
        self.metrics.backend_error("prefill", backend.url)
        return ProxyError(
            502, f"prefill backend {backend.url} returned invalid JSON: {_snippet(data)}"
        )

    async def prefill_leg(
        self, endpoint: str, payload: bytes, headers: dict[str, str], trace: Trace
    ) -> tuple[Backend, bytes]:
        """POST ``payload`` to a prefill backend; its 200 answer's body, or the error it is."""
        start = time.perf_counter()
        backend, status, data, content_type = await self.exchange(
            self.prefill_pool,
            endpoint,
            payload,
            headers,
            self.config.prefill_timeout,
            None,
            trace,
            read_whole,
            retry_stale=True,
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
        return backend, data

    async def decode(
        self,
        request: web.Request,
        endpoint: str,
        payload: bytes,
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse:
        """The normal decode leg: ``payload`` to a decode backend, its answer relayed."""
        start = time.perf_counter()

        async def answer(backend: Backend, resp: Reply) -> web.StreamResponse:
            trace.decode = backend.url
            return await self._answer(request, resp, backend, start, trace)

        # decode_timeout bounds the silence: before the headers and between stream chunks.
        return await self.exchange(
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
        resp: Reply,
        backend: Backend,
        start: float,
        trace: Trace,
    ) -> web.StreamResponse:
        """The decode leg's answer to the client: an error or JSON whole, a stream relayed."""
        content_type = resp.headers.get("content-type", "application/json")
        if resp.status != 200 or not content_type.startswith("text/event-stream"):
            # Read failures (timeout, broken connection) are mapped by exchange, as for prefill.
            data = await resp.read()
            now = self.first_byte(start, trace)
            self.check_decode_status(backend, resp.status, data, content_type)
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
            lambda: self.first_byte(start, trace, sent=True),
        )
        if client_left:
            trace.status = CLIENT_GONE
        return out

    def check_decode_status(
        self, backend: Backend, status: int, data: bytes, content_type: str
    ) -> None:
        """A decode answer other than 200 as the error it becomes for the client."""
        if status == 200:
            return
        if status == 401:
            raise backend_refused_key(self.metrics, self.backend_key, "decode", backend)
        if 400 <= status < 500:
            raise Passthrough(status, data, content_type)
        self.metrics.backend_error("decode", backend.url)
        raise ProxyError(502, f"decode backend {backend.url} returned {status}: {_snippet(data)}")

    def first_byte(self, start: float, trace: Trace, sent: bool = False) -> float:
        """The decode leg's first byte arrived (``start``: the leg was sent); returns now.
        ``sent``: it goes on to the client at once (a relayed stream), see ``sent``."""
        now = time.perf_counter()
        trace.ttfb_s = elapsed = now - start
        self.metrics.decode_ttfb.observe(elapsed)
        if sent:
            self.metrics.ttfb_by_path[trace.path].observe(now - trace.start)
        return now

    def sent(self, trace: Trace, now: float) -> None:
        """The client gets the first byte of a 200 answer at ``now``."""
        self.metrics.ttfb_by_path[trace.path].observe(now - trace.start)


class FirstTokenMode:
    """``--first-token-from-prefill``: the legs of one app's ``PdFlow`` in this mode (see
    pd_proxy.first_token for the protocol).

    1. The request's parameters decide first: one the continuation cannot reproduce exactly
       (``first_token.request_fallback``) sends it down the normal flow, unchanged.
    2. Prefill leg: the normal one plus ``return_token_ids`` (and ``min_tokens: 1`` when the
       client set any); its answer carries the prompt's token ids and token 1.
    3. Token 1 ended the request (EOS, a stop token or string, a one-token limit): the answer is
       the prefill's alone, and a one-token decode request in the background takes the KV, so
       the prefill frees its blocks at once rather than when their lease ends.
    4. Otherwise, when decode can continue exactly and safely (``continuation_problem``, with the
       prefill's KV block size from pd_proxy.block_size): a stream gets token 1 at once and then
       decode's continuation (prompt + token 1, one token fewer); a JSON answer is decode's with
       token 1 put back in front. If decode cannot continue so, the normal decode leg runs.

    Every request counts in ``pd_proxy_first_token_requests_total{outcome, reason}``.
    """

    def __init__(self, flow: PdFlow) -> None:
        self.flow = flow
        self.block_sizes = BlockSizes(
            lambda: flow.upstream, flow.backend_key, flow.config.health_timeout
        )
        self._background: set[asyncio.Task[None]] = set()
        self._counters: dict[tuple[str, str], Any] = {}
        for outcome in (CONTINUED, FINISHED):  # shown at 0 from the start
            self._counters[outcome, ""] = flow.metrics.first_token.labels(outcome, "")

    def _count(self, outcome: str, reason: str = "") -> None:
        key = (outcome, reason)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.flow.metrics.first_token.labels(outcome, reason)
        child.inc()

    async def legs(
        self,
        request: web.Request,
        endpoint: str,
        body: bytes,
        client_body: dict[str, Any],
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse | None:
        """The answer to a request, or None when it takes the normal flow from the start."""
        flow = self.flow
        reason = ft.request_fallback(endpoint, client_body)
        if reason is not None:
            self._count(NORMAL, reason)
            return None
        self.block_sizes.prefetch(b for b in flow.prefill_pool.backends if b.healthy)
        payload = dumps(ft.prefill_body_first_token(client_body))
        backend, data = await flow.prefill_leg(endpoint, payload, headers, trace)
        try:
            answer = loads(data)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict):
            raise flow.invalid_prefill_json(backend, data)
        kv = answer.get("kv_transfer_params")
        first = ft.parse_first_token(endpoint, answer)
        if isinstance(first, str):
            return await self._normal(
                request, endpoint, body, client_body, kv, headers, trace, first
            )
        if ft.finished_at_first(endpoint, client_body, first):
            self._count(FINISHED)
            self._release(endpoint, client_body, kv, headers, trace.rid)
            return self._finished(endpoint, client_body, first, trace)
        size = None
        if ft.needs_block_size(first):
            size = await self.block_sizes.get(backend)
        reason = ft.continuation_problem(first, size)
        if reason is not None:
            return await self._normal(
                request, endpoint, body, client_body, kv, headers, trace, reason
            )
        self._count(CONTINUED)
        payload = dumps(ft.continuation_body(endpoint, client_body, first))
        if client_body.get("stream"):
            return await self._stream(
                request, endpoint, client_body, first, payload, headers, trace
            )
        return await self._json(endpoint, first, payload, headers, trace)

    async def _normal(
        self,
        request: web.Request,
        endpoint: str,
        body: bytes,
        client_body: dict[str, Any],
        kv: Any,
        headers: dict[str, str],
        trace: Trace,
        reason: str,
    ) -> web.StreamResponse:
        """The normal decode leg after this mode's prefill leg (nothing was sent yet)."""
        self._count(NORMAL, reason)
        payload = decode_payload(body, client_body, kv)
        return await self.flow.decode(request, endpoint, payload, headers, trace)

    def _finished(
        self, endpoint: str, client_body: dict[str, Any], first: ft.FirstToken, trace: Trace
    ) -> web.Response:
        if client_body.get("stream"):
            data = ft.finished_stream(endpoint, client_body, first)
            kind = {"Content-Type": SSE_TYPE, "Cache-Control": "no-cache"}
        else:
            data = ft.finished_json(endpoint, first)
            kind = {"Content-Type": JSON_TYPE}
        self.flow.sent(trace, time.perf_counter())
        return web.Response(body=data, headers={**kind, "X-Request-Id": trace.rid})

    def _release(
        self, endpoint: str, client_body: dict[str, Any], kv: Any, headers: dict[str, str], rid: str
    ) -> None:
        """Let decode take the KV the prefill keeps for it; nobody waits for the answer."""
        if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            return
        payload = dumps(ft.release_body(client_body, kv))
        task = asyncio.create_task(self._release_leg(endpoint, payload, headers, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_leg(
        self, endpoint: str, payload: bytes, headers: dict[str, str], rid: str
    ) -> None:
        flow = self.flow
        try:
            _, status, data, _ = await flow.exchange(
                flow.decode_pool,
                endpoint,
                payload,
                headers,
                None,
                flow.config.decode_timeout,
                Trace(rid),
                read_whole,
            )
        except ProxyError as exc:
            log.warning("rid=%s KV release on decode failed: %s", rid, exc.message)
            return
        if status != 200:
            log.warning("rid=%s KV release on decode answered %d: %s", rid, status, data[:200])

    async def _json(
        self,
        endpoint: str,
        first: ft.FirstToken,
        payload: bytes,
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse:
        flow = self.flow
        start = time.perf_counter()

        async def answer(backend: Backend, resp: Reply) -> web.StreamResponse:
            trace.decode = backend.url
            content_type = resp.headers.get("content-type", JSON_TYPE)
            data = await resp.read()
            now = flow.first_byte(start, trace)
            flow.check_decode_status(backend, resp.status, data, content_type)
            try:
                merged = ft.merge_json(endpoint, first, data)
            except (ValueError, UnicodeDecodeError):
                flow.metrics.backend_error("decode", backend.url)
                raise ProxyError(
                    502,
                    f"decode backend {backend.url} returned an answer that is not one "
                    f"completion: {data[:200].decode('utf-8', 'replace')}",
                ) from None
            flow.sent(trace, now)
            return web.Response(
                body=merged, headers={"Content-Type": JSON_TYPE, "X-Request-Id": trace.rid}
            )

        return await flow.exchange(
            flow.decode_pool,
            endpoint,
            payload,
            headers,
            None,
            flow.config.decode_timeout,
            trace,
            answer,
        )

    async def _stream(
        self,
        request: web.Request,
        endpoint: str,
        client_body: dict[str, Any],
        first: ft.FirstToken,
        payload: bytes,
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse:
        """Token 1 now, then decode's continuation; once sent, failures end the stream."""
        flow = self.flow
        out = RelayResponse(
            headers={
                "Content-Type": SSE_TYPE,
                "Cache-Control": "no-cache",
                "X-Request-Id": trace.rid,
            }
        )
        await out.prepare(request)
        try:
            await out.write(ft.stream_head(endpoint, client_body, first))
        except CLIENT_LEFT:
            trace.status = CLIENT_GONE
            return out
        flow.sent(trace, time.perf_counter())
        start = time.perf_counter()
        filter_ = ft.ContinuationFilter(endpoint, first)

        async def answer(backend: Backend, resp: Reply) -> bool:
            trace.decode = backend.url
            content_type = resp.headers.get("content-type", "")
            if resp.status != 200 or not content_type.startswith("text/event-stream"):
                data = await resp.read()
                flow.first_byte(start, trace)
                try:
                    flow.check_decode_status(backend, resp.status, data, content_type)
                except Passthrough as exc:
                    raise ProxyError(exc.status, _backend_message(backend, exc)) from None
                flow.metrics.backend_error("decode", backend.url)
                raise ProxyError(502, f"decode backend {backend.url} answered JSON, not a stream")
            return await relay_events(
                out,
                resp,
                filter_.feed,
                trace.rid,
                backend,
                flow.metrics,
                flow.config.decode_timeout,
                lambda: flow.first_byte(start, trace),
            )

        try:
            client_left = await flow.exchange(
                flow.decode_pool,
                endpoint,
                payload,
                headers,
                None,
                flow.config.decode_timeout,
                trace,
                answer,
            )
        except ProxyError as exc:
            log.warning("rid=%s after token 1: %s", trace.rid, exc.message)
            try:
                await out.write(sse_error_event(exc.status, exc.message, False))
                await out.write_eof()
            except CLIENT_LEFT:
                client_left = True
            else:
                client_left = False
        if client_left:
            trace.status = CLIENT_GONE
        return out


def _backend_message(backend: Backend, exc: Passthrough) -> str:
    """A decode's own 4xx answer as one line for the stream's error event."""
    message = exc.body[:200].decode("utf-8", "replace")
    try:
        obj = loads(exc.body)
        error = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(error, str):
            message = error
    except (ValueError, UnicodeDecodeError):
        pass
    return f"decode backend {backend.url} refused the continuation ({exc.status}): {message}"
