"""The routes other than the normal two legs that a request's shape can take (pd_proxy.shapes):
refused before any backend is touched, decode alone, or one P/D request per choice.

Decode alone sends the client's own bytes to a decode backend, without ``kv_transfer_params``:
vLLM's decode then prefills the prompt itself, as a single instance would. A fan-out runs its
legs at once, each the normal prefill and decode legs under its own ``X-Request-Id`` (the
client's id plus ``-k``), and merges their answers (pd_proxy.fanout). When one leg fails the
others still run to their end, so each prefill's KV is read and freed, not left to its lease;
the client then gets the first failure (before its stream started: as the error answer; after:
as an SSE error event).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from aiohttp import web

from pd_proxy import fanout, local_prefill
from pd_proxy.errors import Passthrough, ProxyError, sse_error_event
from pd_proxy.pool import Backend
from pd_proxy.rewrite import decode_body, dumps, kv_params_from_prefill, prefill_body
from pd_proxy.shapes import FANOUT, LOCAL, PD, REFUSE, classify, samples
from pd_proxy.sse_relay import CLIENT_LEFT, RelayResponse
from pd_proxy.upstream import Reply


class Trace(Protocol):
    """What this module writes of pd_proxy.pd_flow.Trace (not imported: no import cycle)."""

    rid: str
    path: str  # "pd" or "local": the pd_proxy_requests_total label
    prefill: str
    decode: str
    status: int


# pd_proxy.pd_flow.PdFlow: its legs (prefill_leg, exchange, decode), pools, metrics and timing
# helpers; typed Any, as importing it here would make an import cycle.
PdFlow = Any
log = logging.getLogger("pd_proxy.request")
SSE_TYPE = "text/event-stream; charset=utf-8"
JSON_TYPE = "application/json"
TOKENIZE = "/tokenize"  # vLLM's; counts a chat prompt after its template
CLIENT_GONE = 499  # as pd_proxy.pd_flow counts a client that left


def leg_headers(headers: dict[str, str], rid: str, k: int) -> dict[str, str]:
    """The header fields of fan-out leg ``k``: its own request id (vLLM's NIXL handshake pairs a
    prefill and a decode by it), the rest as the client request's."""
    return {**headers, "X-Request-Id": f"{rid}-{k}"}


class ShapeRoutes:
    """Routes one app's requests by shape; ``route`` answers None for the normal two legs."""

    def __init__(self, flow: PdFlow, local_prefill_max_tokens: int = 0) -> None:
        self.flow = flow
        self.local_max = local_prefill_max_tokens
        metrics = flow.metrics
        self._refused = metrics.refused
        self._fanouts = metrics.fanout_requests
        self._legs = metrics.fanout_legs

    async def route(
        self,
        request: web.Request,
        endpoint: str,
        body: bytes,
        client_body: dict[str, Any],
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse | None:
        decision = classify(client_body, endpoint)
        if decision.route == PD:
            if self.local_max <= 0:
                return None
            count = await self._prompt_tokens(endpoint, client_body, headers, trace)
            if not local_prefill.goes_local(count, self.local_max):
                return None
            trace.path = "local"
            return await self.flow.decode(request, endpoint, body, headers, trace)
        if decision.route == REFUSE:
            self._refused.labels(decision.shape.name).inc()
            raise ProxyError(400, decision.refusal(), decision.shape.param)
        if decision.route == LOCAL:
            trace.path = "local"
            return await self.flow.decode(request, endpoint, body, headers, trace)
        assert decision.route == FANOUT
        legs = fanout.split(client_body, endpoint)
        self._fanouts.labels(decision.shape.name).inc()
        self._legs.labels(decision.shape.name).inc(len(legs))
        n = samples(client_body)
        if client_body.get("stream"):
            options = client_body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await self._stream(request, endpoint, n, legs, usage, headers, trace)
        return await self._json(endpoint, n, legs, headers, trace)

    async def _prompt_tokens(
        self, endpoint: str, client_body: dict[str, Any], headers: dict[str, str], trace: Trace
    ) -> int | None:
        """The prompt's length in the served model's tokens (decode's ``/tokenize``, which
        applies the chat template); None when it cannot be known, and the request takes P/D."""
        count = local_prefill.direct_count(client_body, endpoint)
        if count is not None:
            return count
        body = local_prefill.tokenize_body(client_body, endpoint)
        if body is None:
            return None
        flow = self.flow

        async def read(backend: Backend, resp: Reply) -> tuple[int, bytes]:
            return resp.status, await resp.read()

        try:
            status, data = await flow.exchange(
                flow.decode_pool,
                TOKENIZE,
                dumps(body),
                headers,
                flow.config.decode_timeout,
                None,
                trace,
                read,
            )
        except ProxyError as exc:
            log.warning("rid=%s counting the prompt failed, P/D: %s", trace.rid, exc.message)
            return None
        try:
            return local_prefill.count_from_answer(data) if status == 200 else None
        except (ValueError, UnicodeDecodeError):
            return None

    async def _prefill(
        self, endpoint: str, leg: dict[str, Any], headers: dict[str, str], trace: Trace
    ) -> bytes:
        """One leg's prefill; the decode leg's body."""
        flow = self.flow
        backend, data = await flow.prefill_leg(endpoint, dumps(prefill_body(leg)), headers, trace)
        try:
            kv = kv_params_from_prefill(data)
        except ValueError:
            raise flow.invalid_prefill_json(backend, data) from None
        return dumps(decode_body(leg, kv))

    async def _json(
        self,
        endpoint: str,
        n: int,
        legs: list[dict[str, Any]],
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse:
        flow = self.flow
        start = time.perf_counter()

        async def one(k: int, leg: dict[str, Any]) -> bytes:
            lines = leg_headers(headers, trace.rid, k)
            payload = await self._prefill(endpoint, leg, lines, trace)

            async def read(backend: Backend, resp: Reply) -> bytes:
                trace.decode = backend.url
                data = await resp.read()
                content_type = resp.headers.get("content-type", JSON_TYPE)
                flow.check_decode_status(backend, resp.status, data, content_type)
                return data

            return await flow.exchange(
                flow.decode_pool,
                endpoint,
                payload,
                lines,
                None,
                flow.config.decode_timeout,
                trace,
                read,
            )

        results = await asyncio.gather(
            *(one(k, leg) for k, leg in enumerate(legs)), return_exceptions=True
        )
        now = flow.first_byte(start, trace)
        answers = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            answers.append(result)
        try:
            merged = fanout.merge_json(endpoint, n, answers)
        except (ValueError, UnicodeDecodeError):
            raise ProxyError(502, "a fan-out leg's decode answer is not one completion") from None
        flow.sent(trace, now)
        return web.Response(
            body=merged, headers={"Content-Type": JSON_TYPE, "X-Request-Id": trace.rid}
        )

    async def _stream(
        self,
        request: web.Request,
        endpoint: str,
        n: int,
        legs: list[dict[str, Any]],
        include_usage: bool,
        headers: dict[str, str],
        trace: Trace,
    ) -> web.StreamResponse:
        flow = self.flow
        merge = fanout.StreamMerge(endpoint, n, len(legs))
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
                        flow.sent(trace, flow.first_byte(start, trace))
                    await out.write(data)
                except CLIENT_LEFT:
                    state["client_left"] = True

        async def one(k: int, leg: dict[str, Any]) -> None:
            lines = leg_headers(headers, trace.rid, k)
            payload = await self._prefill(endpoint, leg, lines, trace)

            async def relay(backend: Backend, resp: Reply) -> None:
                trace.decode = backend.url
                content_type = resp.headers.get("content-type", "")
                if resp.status != 200 or not content_type.startswith("text/event-stream"):
                    data = await resp.read()
                    flow.check_decode_status(backend, resp.status, data, content_type)
                    raise ProxyError(502, f"decode backend {backend.url} answered JSON")
                while chunk := await resp.readany():
                    data = merge.feed(k, chunk)
                    if data:
                        await send(data)

            try:
                await flow.exchange(
                    flow.decode_pool,
                    endpoint,
                    payload,
                    lines,
                    None,
                    flow.config.decode_timeout,
                    trace,
                    relay,
                )
            except (ProxyError, Passthrough) as exc:
                if state["failure"] is None:
                    state["failure"] = exc
                raise

        results = await asyncio.gather(
            *(one(k, leg) for k, leg in enumerate(legs)), return_exceptions=True
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
