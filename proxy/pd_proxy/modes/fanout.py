"""Fan-out: a request for ``n`` samples or for several prompts as one P/D request per choice.

vLLM runs such a request as several engine requests but a prefill answers one
``kv_transfer_params``: the other copies' KV would stay held until their lease ends. Here each
choice is its own normal P/D request (pd_proxy.fanout splits the body), all at once, each under
its own ``X-Request-Id`` (the client's plus ``-k``: vLLM's NIXL pairs a prefill and a decode by
it), and their answers are merged. When one leg fails the others still run to their end, so every
prefill's KV is read and freed; the client then gets the first failure (before its stream
started, as the error answer; after, as an SSE error event).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from pd_proxy import fanout
from pd_proxy.errors import Passthrough, ProxyError, sse_error_event
from pd_proxy.legs import CLIENT_GONE, JSON_TYPE, SSE_TYPE, Legs, Trace
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.pool import Backend
from pd_proxy.rewrite import decode_body, dumps, kv_params_from_prefill, prefill_body
from pd_proxy.shapes import Shape, samples
from pd_proxy.sse_relay import CLIENT_LEFT, RelayResponse
from pd_proxy.upstream import Fields, Reply


class FanoutMode:
    """Called by pd_proxy.modes.by_shape with the shape that asked for it (the counters' label)."""

    def __init__(self, legs: Legs, metrics: ProxyMetrics) -> None:
        self.legs = legs
        self._requests = metrics.fanout_requests
        self._legs = metrics.fanout_legs

    async def __call__(
        self,
        request: web.Request,
        endpoint: str,
        client_body: dict[str, Any],
        headers: Fields,
        trace: Trace,
        shape: Shape,
    ) -> web.StreamResponse:
        bodies = fanout.split(client_body, endpoint)
        self._requests.labels(shape.name).inc()
        self._legs.labels(shape.name).inc(len(bodies))
        n = samples(client_body)
        if client_body.get("stream"):
            options = client_body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await self._stream(request, endpoint, n, bodies, usage, headers, trace)
        return await self._json(endpoint, n, bodies, headers, trace)

    async def _prefill(
        self, endpoint: str, body: dict[str, Any], headers: Fields, trace: Trace
    ) -> bytes:
        """One leg's prefill; its decode leg's body."""
        legs = self.legs
        backend, data = await legs.prefill_leg(endpoint, dumps(prefill_body(body)), headers, trace)
        try:
            kv = kv_params_from_prefill(data)
        except ValueError:
            raise legs.invalid_prefill_json(backend, data) from None
        return dumps(decode_body(body, kv))

    async def _json(
        self,
        endpoint: str,
        n: int,
        bodies: list[dict[str, Any]],
        headers: Fields,
        trace: Trace,
    ) -> web.StreamResponse:
        legs = self.legs
        start = time.perf_counter()

        async def one(k: int, body: dict[str, Any]) -> bytes:
            fields = legs.backend_headers(f"{trace.rid}-{k}")  # leg k's own request id
            payload = await self._prefill(endpoint, body, fields, trace)

            async def read(backend: Backend, resp: Reply) -> bytes:
                trace.decode = backend.url
                data = await resp.read()
                content_type = resp.headers.get("content-type", JSON_TYPE)
                legs.decode_error(backend, resp.status, data, content_type)
                return data

            return await legs.decode_to(endpoint, payload, fields, trace, read)

        results = await asyncio.gather(
            *(one(k, body) for k, body in enumerate(bodies)), return_exceptions=True
        )
        now = legs.first_byte(start, trace)
        answers = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            answers.append(result)
        try:
            merged = fanout.merge_json(endpoint, n, answers)
        except (ValueError, UnicodeDecodeError):
            raise ProxyError(502, "a fan-out leg's decode answer is not one completion") from None
        legs.sent(trace, now)
        return web.Response(
            body=merged, headers={"Content-Type": JSON_TYPE, "X-Request-Id": trace.rid}
        )

    async def _stream(
        self,
        request: web.Request,
        endpoint: str,
        n: int,
        bodies: list[dict[str, Any]],
        include_usage: bool,
        headers: Fields,
        trace: Trace,
    ) -> web.StreamResponse:
        legs = self.legs
        merge = fanout.StreamMerge(endpoint, n, len(bodies))
        out = RelayResponse(
            headers={
                "Content-Type": SSE_TYPE,
                "Cache-Control": "no-cache",
                "X-Request-Id": trace.rid,
            }
        )
        state: dict[str, Any] = {"prepared": False, "failure": None, "client_left": False}
        lock = asyncio.Lock()
        start = time.perf_counter()

        async def send(data: bytes) -> None:
            if state["failure"] is not None or state["client_left"]:
                return  # keep reading (the KV is freed), send nothing more
            async with lock:
                try:
                    if not state["prepared"]:
                        await out.prepare(request)
                        state["prepared"] = True
                        legs.sent(trace, legs.first_byte(start, trace))
                    await out.write(data)
                except CLIENT_LEFT:
                    state["client_left"] = True

        async def one(k: int, body: dict[str, Any]) -> None:
            fields = legs.backend_headers(f"{trace.rid}-{k}")  # leg k's own request id
            payload = await self._prefill(endpoint, body, fields, trace)

            async def relay(backend: Backend, resp: Reply) -> None:
                trace.decode = backend.url
                content_type = resp.headers.get("content-type", "")
                if resp.status != 200 or not content_type.startswith("text/event-stream"):
                    data = await resp.read()
                    legs.decode_error(backend, resp.status, data, content_type)
                    raise ProxyError(502, f"decode backend {backend.url} answered JSON")
                while chunk := await resp.readany():
                    backend.progress += 1
                    data = merge.feed(k, chunk)
                    if data:
                        await send(data)

            try:
                await legs.decode_to(endpoint, payload, fields, trace, relay)
            except (ProxyError, Passthrough) as exc:
                if state["failure"] is None:
                    state["failure"] = exc
                raise

        results = await asyncio.gather(
            *(one(k, body) for k, body in enumerate(bodies)), return_exceptions=True
        )
        failure = state["failure"]
        if failure is None:
            failure = next((r for r in results if isinstance(r, BaseException)), None)
        if not state["prepared"]:
            if failure is not None:
                raise failure
            await send(b"")
        if state["client_left"]:
            trace.status = CLIENT_GONE
            return out
        try:
            if failure is None:
                await out.write(merge.finish(include_usage))
            else:
                status = getattr(failure, "status", 502)
                message = getattr(failure, "message", None) or f"a fan-out leg failed ({status})"
                await out.write(sse_error_event(status, message, False))
            await out.write_eof()
        except CLIENT_LEFT:
            trace.status = CLIENT_GONE
        return out
