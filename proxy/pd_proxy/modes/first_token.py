"""First token from prefill (``--first-token-from-prefill``) as a mode of the flow: the legs of
the protocol whose pure parts live in pd_proxy.modes.first_token_rewrite.

1. The request's parameters decide first: one the continuation cannot reproduce exactly
   (``first_token.request_fallback``) takes the normal mode, unchanged.
2. Prefill leg: the normal one plus ``return_token_ids`` (and ``min_tokens: 1`` when the
   client set any); its answer carries the prompt's token ids and token 1.
3. Token 1 ended the request (EOS, a stop token or string, a one-token limit): the answer is
   the prefill's alone, and a one-token decode request in the background takes the KV, so
   the prefill frees its blocks at once rather than when their lease ends.
4. Otherwise, when decode can continue exactly and safely (``continuation_problem``, with the
   prefill's KV block size from pd_proxy.routing.block_size): a stream gets token 1 at once and then
   decode's continuation (prompt + token 1, one token fewer); a JSON answer is decode's with
   token 1 put back in front. If decode cannot continue so, the normal decode leg runs.

Every request counts in ``pd_proxy_first_token_requests_total{outcome, reason}``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.backends.route import Route
from pd_proxy.call import Call
from pd_proxy.http.connection import Reply
from pd_proxy.http.relay import CLIENT_LEFT, RelayResponse
from pd_proxy.legs import CLIENT_GONE, Lease, Legs, is_event_stream
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.modes import first_token_rewrite as ft
from pd_proxy.modes.normal import NormalMode
from pd_proxy.protocol.codec import dumps, loads
from pd_proxy.protocol.endpoints import JSON_TYPE, Endpoint
from pd_proxy.protocol.errors import Passthrough, ProxyError, sse_error_event
from pd_proxy.protocol.pd_bodies import decode_payload
from pd_proxy.protocol.sse import SSE_TYPE
from pd_proxy.routing.block_size import BlockSizes
from pd_proxy.tracing import Trace

log = logging.getLogger("pd_proxy.request")

# pd_proxy_first_token_requests_total outcomes.
CONTINUED, FINISHED, NORMAL = "continued", "finished", "normal"


class FirstTokenMode:
    """``--first-token-from-prefill`` on one app's legs (see the module docstring): ``normal``
    serves the requests this mode cannot serve exactly, ``block_sizes`` tells the ``prefill``
    pool's KV block sizes; counted in ``metrics``."""

    def __init__(
        self,
        legs: Legs,
        *,
        normal: NormalMode,
        block_sizes: BlockSizes,
        prefill: BackendPool,
        metrics: ProxyMetrics,
    ) -> None:
        self.legs = legs
        self.normal = normal
        self.block_sizes = block_sizes
        self.prefill_pool = prefill
        self.metrics = metrics
        self._counters: dict[tuple[str, str], Any] = {}
        for outcome in (CONTINUED, FINISHED):  # shown at 0 from the start
            self._counters[outcome, ""] = metrics.first_token.labels(outcome, "")

    def _count(self, outcome: str, reason: str = "") -> None:
        key = (outcome, reason)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.metrics.first_token.labels(outcome, reason)
        child.inc()

    async def __call__(
        self, call: Call, route: Route, trace: Trace, lease: Lease
    ) -> web.StreamResponse:
        legs = self.legs
        endpoint, client_body, headers = call.endpoint, call.client_body, call.headers
        want = route.decode
        reason = ft.request_fallback(endpoint, client_body)
        if reason is not None:
            self._count(NORMAL, reason)
            return await self.normal(call, route, trace, lease)
        self.block_sizes.prefetch(b for b in self.prefill_pool.backends if b.healthy)
        payload = dumps(ft.prefill_body_first_token(client_body))
        backend, data = await legs.prefill_leg(
            endpoint,
            payload,
            headers,
            trace=trace,
            lease=lease,
            want=route.prefill,
            tokens=route.uncached_tokens or 0,
        )
        try:
            answer = loads(data)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict):
            raise legs.invalid_prefill_json(backend, data)
        kv = answer.get("kv_transfer_params")
        if trace.otel is not None:
            trace.otel.kv_params(kv)
        first = ft.parse_first_token(endpoint, answer)
        if isinstance(first, str):
            return await self._normal(call, kv, first, trace=trace, lease=lease, want=want)
        if ft.finished_at_first(endpoint, client_body, first):
            self._count(FINISHED)
            legs.release_kv(endpoint, client_body, kv, headers, trace.rid)
            return self._finished(endpoint, client_body, first, trace)
        size = None
        if ft.needs_block_size(first):
            size = await self.block_sizes.get(backend)
        reason = ft.continuation_problem(first, size)
        if reason is not None:
            return await self._normal(call, kv, reason, trace=trace, lease=lease, want=want)
        self._count(CONTINUED)
        payload = dumps(ft.continuation_body(endpoint, client_body, first))
        if client_body.get("stream"):
            return await self._stream(call, first, payload, trace=trace, lease=lease, want=want)
        return await self._json(call, first, payload, trace=trace, lease=lease, want=want)

    async def _normal(
        self, call: Call, kv: Any, reason: str, *, trace: Trace, lease: Lease, want: Backend | None
    ) -> web.StreamResponse:
        """The normal decode leg after this mode's prefill leg (nothing was sent yet)."""
        self._count(NORMAL, reason)
        payload = decode_payload(call.body, call.client_body, kv)
        return await self.legs.decode_leg(call, payload, trace=trace, lease=lease, want=want)

    def _finished(
        self, endpoint: Endpoint, client_body: dict[str, Any], first: ft.FirstToken, trace: Trace
    ) -> web.Response:
        if client_body.get("stream"):
            data = ft.finished_stream(endpoint, client_body, first)
            kind = {"Content-Type": SSE_TYPE, "Cache-Control": "no-cache"}
        else:
            data = ft.finished_json(endpoint, first)
            kind = {"Content-Type": JSON_TYPE}
        self.legs.sent(trace, time.perf_counter())
        return web.Response(body=data, headers={**kind, "X-Request-Id": trace.rid})

    async def _json(
        self,
        call: Call,
        first: ft.FirstToken,
        payload: bytes,
        *,
        trace: Trace,
        lease: Lease,
        want: Backend | None,
    ) -> web.StreamResponse:
        legs = self.legs
        endpoint = call.endpoint
        start = time.perf_counter()

        async def answer(backend: Backend, resp: Reply) -> web.StreamResponse:
            trace.decode = backend.url
            content_type = resp.headers.get("content-type", JSON_TYPE)
            data = await resp.read()
            now = legs.first_byte(start, trace, lease)
            legs.decode_error(backend, resp.status, data, content_type)
            try:
                merged = ft.merge_json(endpoint, first, data)
            except (ValueError, UnicodeDecodeError):
                raise legs.decode_failed(
                    backend,
                    "returned an answer that is not one completion: "
                    f"{data[:200].decode('utf-8', 'replace')}",
                ) from None
            legs.sent(trace, now)
            return web.Response(
                body=merged, headers={"Content-Type": JSON_TYPE, "X-Request-Id": trace.rid}
            )

        return await legs.decode_to(
            endpoint, payload, call.headers, trace=trace, consume=answer, want=want
        )

    async def _stream(
        self,
        call: Call,
        first: ft.FirstToken,
        payload: bytes,
        *,
        trace: Trace,
        lease: Lease,
        want: Backend | None,
    ) -> web.StreamResponse:
        """Token 1 now, then decode's continuation; once sent, failures end the stream."""
        legs = self.legs
        request, endpoint, client_body = call.request, call.endpoint, call.client_body
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
        legs.sent(trace, time.perf_counter())
        start = time.perf_counter()
        filter_ = ft.ContinuationFilter(endpoint, first)

        async def answer(backend: Backend, resp: Reply) -> bool:
            trace.decode = backend.url
            content_type = resp.headers.get("content-type", "")
            if not is_event_stream(resp):
                data = await resp.read()
                legs.first_byte(start, trace, lease)
                try:
                    legs.decode_error(backend, resp.status, data, content_type)
                except Passthrough as exc:
                    raise ProxyError(
                        exc.status,
                        f"decode backend {backend.url} refused the continuation "
                        f"({exc.status}): {exc.message}",
                    ) from None
                raise legs.decode_failed(backend, "answered JSON, not a stream")
            return await legs.relay_into(
                out,
                resp,
                backend,
                transform=filter_.feed,
                trace=trace,
                start=start,
                lease=lease,
            )

        try:
            client_left = await legs.decode_to(
                endpoint, payload, call.headers, trace=trace, consume=answer, want=want
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
