"""Fan-out: a request for ``n`` samples or for several prompts as one P/D request per choice.

vLLM runs such a request as several engine requests but a prefill answers one
``kv_transfer_params``: the other copies' KV would stay held until their lease ends. Here each
choice is its own normal P/D request (pd_proxy.modes.fanout_rewrite splits the body), all at once,
each
under its own ``X-Request-Id`` (the client's plus ``-k``: vLLM's NIXL pairs a prefill and a
decode by it), and their answers are merged.

The first leg that fails ends the request: the others are cancelled at once (a cancelled leg
whose prefill answered and whose decode had not started reading lets a one-token decode take its
KV, ``Legs.release_kv``, so the prefill frees it now), and the client gets that leg's own status
and message: before its stream started as the error answer, after as an SSE error event. A
client that leaves cancels every leg the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from pd_proxy.backends.pool import Backend
from pd_proxy.backends.route import Route
from pd_proxy.call import Call, backend_fields
from pd_proxy.config.key_files import BackendKey
from pd_proxy.http.connection import Reply
from pd_proxy.http.relay import CLIENT_LEFT, RelayResponse
from pd_proxy.legs import CLIENT_GONE, Lease, Legs, is_event_stream
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.modes import fanout_rewrite as rewrite_fanout
from pd_proxy.protocol.codec import dumps
from pd_proxy.protocol.endpoints import JSON_TYPE, Endpoint
from pd_proxy.protocol.errors import Passthrough, ProxyError, sse_error_event
from pd_proxy.protocol.pd_bodies import (
    decode_body,
    kv_params_from_prefill,
    prefill_body,
    usage_options,
)
from pd_proxy.protocol.sse import SSE_TYPE
from pd_proxy.routing.shapes import samples
from pd_proxy.tracing import Trace

T = TypeVar("T")
# What consumes one leg's decode answer: (backend, reply, taken) -> its result; it calls
# ``taken()`` once decode has begun answering (so its KV was read).
Consume = Callable[[Backend, Reply, Callable[[], None]], Awaitable[T]]


class ClientGone(Exception):
    """The client hung up while a fan-out streamed: every leg stops."""


class FanoutMode:
    """Called by pd_proxy.pipeline for a request whose shape asked for a fan-out; each leg is
    sent with ``backend_key``, counted in ``metrics``."""

    def __init__(
        self, legs: Legs, *, backend_key: BackendKey | None, metrics: ProxyMetrics
    ) -> None:
        self.legs = legs
        self.backend_key = backend_key
        self._requests = metrics.fanout_requests
        self._legs = metrics.fanout_legs

    async def __call__(
        self, call: Call, route: Route, trace: Trace, lease: Lease
    ) -> web.StreamResponse:
        """Serve ``call``, whose shape (``route.reason``, the counters' label) asked for a
        fan-out; each choice is placed by the scheduler at its own legs."""
        request, endpoint, client_body = call.request, call.endpoint, call.client_body
        bodies = rewrite_fanout.split(client_body, endpoint)
        self._requests.labels(route.reason).inc()
        self._legs.labels(route.reason).inc(len(bodies))
        n = samples(client_body)
        run = _Run(endpoint, trace, lease)
        if client_body.get("stream"):
            return await self._stream(request, run, n, bodies, client_body)
        return await self._json(run, n, bodies)

    async def _leg(self, k: int, run: _Run, body: dict[str, Any], consume: Consume[T]) -> T:
        """Choice ``k`` as one P/D request under its own request id; when cancelled between
        its prefill's answer and its decode's first byte, the prefill's KV is released."""
        legs = self.legs
        endpoint, trace = run.endpoint, run.trace
        rid = f"{trace.rid}-{k}"
        fields = backend_fields(rid, self.backend_key)
        payload = dumps(prefill_body(body))
        backend, data = await legs.prefill_leg(
            endpoint, payload, fields, trace=trace, lease=run.lease
        )
        try:
            kv = kv_params_from_prefill(data)
        except ValueError:
            raise legs.invalid_prefill_json(backend, data) from None
        taken = False

        def take() -> None:
            nonlocal taken
            taken = True

        async def answer(decode: Backend, resp: Reply) -> T:
            trace.decode = decode.url
            return await consume(decode, resp, take)

        try:
            return await legs.decode_to(
                endpoint, dumps(decode_body(body, kv)), fields, trace=trace, consume=answer
            )
        except BaseException:
            if not taken:
                legs.release_kv(endpoint, body, kv, fields, rid)
            raise

    async def _json(self, run: _Run, n: int, bodies: list[dict[str, Any]]) -> web.StreamResponse:
        legs = self.legs
        endpoint, trace = run.endpoint, run.trace
        start = time.perf_counter()

        async def read(backend: Backend, resp: Reply, taken: Callable[[], None]) -> bytes:
            data = await resp.read()
            taken()
            legs.decode_error(backend, resp.status, data, resp.headers.get("content-type", ""))
            return data

        answers = await first_failure_ends_all(
            [self._leg(k, run, body, read) for k, body in enumerate(bodies)]
        )
        now = legs.first_byte(start, trace, run.lease)
        try:
            merged = rewrite_fanout.merge_json(endpoint, n, answers)
        except (ValueError, UnicodeDecodeError):
            raise ProxyError(502, "a fan-out leg's decode answer is not one completion") from None
        legs.sent(trace, now)
        return web.Response(
            body=merged, headers={"Content-Type": JSON_TYPE, "X-Request-Id": trace.rid}
        )

    async def _stream(
        self,
        request: web.Request,
        run: _Run,
        n: int,
        bodies: list[dict[str, Any]],
        client_body: dict[str, Any],
    ) -> web.StreamResponse:
        """The legs' streams merged into one; its headers go with the first merged event."""
        trace = run.trace
        relay = _MergedStream(request, self.legs, run, n, len(bodies))
        try:
            await first_failure_ends_all(
                [self._leg(k, run, body, relay.leg(k)) for k, body in enumerate(bodies)]
            )
        except ClientGone:
            trace.status = CLIENT_GONE
            return relay.out
        except (ProxyError, Passthrough) as failure:
            if not relay.started:
                raise  # nothing sent yet: the client gets the failure as the answer
            await relay.end(sse_error_event(failure.status, failure.message, False), trace)
            return relay.out
        await relay.end(relay.merge.finish(usage_options(client_body)[0]), trace)
        return relay.out


@dataclass(frozen=True, slots=True)
class _Run:
    """One fan-out request's endpoint, trace and lease, shared by its legs."""

    endpoint: Endpoint
    trace: Trace
    lease: Lease


class _MergedStream:
    """The client's one stream, fed by every leg's decode stream through one ``StreamMerge``."""

    def __init__(self, request: web.Request, legs: Legs, run: _Run, n: int, count: int) -> None:
        self.request = request
        self.legs = legs
        self.trace = trace = run.trace
        self.lease = run.lease
        self.merge = rewrite_fanout.StreamMerge(run.endpoint, n, count)
        self.out = RelayResponse(
            headers={
                "Content-Type": SSE_TYPE,
                "Cache-Control": "no-cache",
                "X-Request-Id": trace.rid,
            }
        )
        self.started = False
        self._start = time.perf_counter()
        self._lock = asyncio.Lock()

    def leg(self, k: int) -> Consume[None]:
        """The consumer of leg ``k``'s decode answer: its events go to the client as they come."""
        legs = self.legs

        async def relay(backend: Backend, resp: Reply, taken: Callable[[], None]) -> None:
            if not is_event_stream(resp):
                data = await resp.read()
                taken()
                legs.decode_error(backend, resp.status, data, resp.headers.get("content-type", ""))
                raise legs.decode_failed(backend, "answered JSON, not a stream")
            while chunk := await resp.readany():
                taken()
                backend.progress += 1
                data = self.merge.feed(k, chunk)
                if data:
                    await self.send(data)

        return relay

    async def send(self, data: bytes) -> None:
        """Write merged events (the headers go with the first); ``ClientGone`` if it left."""
        async with self._lock:
            try:
                if not self.started:
                    await self.out.prepare(self.request)
                    self.started = True
                    now = self.legs.first_byte(self._start, self.trace, self.lease)
                    self.legs.sent(self.trace, now)
                await self.out.write(data)
            except CLIENT_LEFT:
                raise ClientGone from None

    async def end(self, tail: bytes, trace: Trace) -> None:
        """The stream's last bytes (the usage chunk and ``[DONE]``, or an error event)."""
        try:
            await self.send(tail)
            await self.out.write_eof()
        except (ClientGone, *CLIENT_LEFT):
            trace.status = CLIENT_GONE


async def first_failure_ends_all(legs: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``legs`` at once; their results in order, or the first failure raised once every
    other leg has been cancelled (and has finished cancelling)."""
    tasks = [asyncio.ensure_future(leg) for leg in legs]
    try:
        pending: set[asyncio.Future[T]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in done if not t.cancelled() and t.exception()), None)
            if failed is not None:
                exc = failed.exception()
                assert exc is not None
                raise exc
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
