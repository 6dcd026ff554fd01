"""The legs every mode of the flow is made of: backend choice, one exchange with a backend, the
prefill leg, the normal decode leg, and the one mapping from a decode answer's status to the error
the client gets.

``Legs.exchange`` is a leg's whole life (pd_proxy.http.upstream does the HTTP): a refused connection
marks the backend down and goes to another once; the prefill leg also moves once when its backend
goes down while it waits (a hung replica, pd_proxy.routing.breaker) or its connection breaks
before an answer, and goes once more when a reused connection closed before any answer; every other
upstream failure becomes a ``ProxyError`` (502, or 504 for a time limit). A mode
(pd_proxy.modes) is a strategy with the ``Mode`` signature, chosen once at start-up, that runs a
request's legs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar

from aiohttp import web

from pd_proxy.api.auth import BackendKey
from pd_proxy.config import ProxyConfig
from pd_proxy.errors import Passthrough, ProxyError
from pd_proxy.http.connection import (
    ConnectFailed,
    Reply,
    StaleConnection,
    UpstreamBroken,
    UpstreamTimeout,
)
from pd_proxy.http.relay import relay_stream
from pd_proxy.http.sse import MEDIA_TYPE
from pd_proxy.http.upstream import Fields, Upstream
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.rewrite import JSON_TYPE, dumps, release_body
from pd_proxy.route import Route
from pd_proxy.routing.breaker import Breaker
from pd_proxy.routing.pool import Backend, BackendPool
from pd_proxy.tracing import Trace, end_leg, traceparent

log = logging.getLogger("pd_proxy.request")

CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent
T = TypeVar("T")


class Move(NamedTuple):
    """Why a leg's attempt ended, and where it goes again (None: nowhere healthy)."""

    why: str
    to: Backend | None
    reason: str  # pd_proxy_retries_total's label


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """One client request as the pipeline parsed it: what every stage after parsing reads.

    ``body`` is the client's bytes, ``client_body`` their JSON object, ``headers`` the fields both
    legs add (``Legs.backend_headers``).
    """

    request: web.Request
    endpoint: str
    body: bytes
    client_body: dict[str, Any]
    headers: Fields


class Mode(Protocol):
    """How a request's legs run (pd_proxy.modes) along its route: the answer to the client, or
    an error raised."""

    async def __call__(self, call: Call, route: Route, trace: Trace) -> web.StreamResponse: ...


def is_event_stream(resp: Reply) -> bool:
    """A 200 answer that streams events; anything else (JSON, an error) is read whole."""
    return resp.status == 200 and resp.headers.get("content-type", "").startswith(MEDIA_TYPE)


def snippet(data: bytes, limit: int = 200) -> str:
    return data[:limit].decode("utf-8", "replace")


async def read_whole(backend: Backend, resp: Reply) -> tuple[Backend, int, bytes, str]:
    """Prefill answers are small JSON: read them whole while the backend still counts them."""
    data = await resp.read()
    return backend, resp.status, data, resp.headers.get("content-type", JSON_TYPE)


def pick(pool: BackendPool, exclude: Backend | None = None) -> Backend:
    """The backend for a request to ``pool``; a 503 naming the down ones when none is healthy."""
    backend = pool.pick(exclude)
    if backend is None:
        raise ProxyError(
            503, f"no healthy {pool.role} backend (down: {', '.join(pool.down()) or 'none'})"
        )
    return backend


def mark_down(metrics: ProxyMetrics, backend: Backend, stage: str) -> None:
    """Passive health: a refused connection takes the backend out until a check passes (its
    waiting prefill legs move to another)."""
    backend.went_down()
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


class Legs:
    """The legs of one app's requests, through its ``upstream`` client (built when the app
    starts: it needs a running loop, see pd_proxy.api.app)."""

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
        self.backend_key = backend_key
        self.metrics = metrics
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.upstream = upstream
        self._background: set[asyncio.Task[None]] = set()  # KV releases nobody waits for

    def backend_headers(self, rid: str) -> Fields:
        """The header fields both legs add, encoded once: the client's Authorization is never
        forwarded (its key is for the proxy only), the backend key is sent instead."""
        if self.backend_key is None:
            return Fields.of({"X-Request-Id": rid})
        return Fields.of({"X-Request-Id": rid, "Authorization": self.backend_key.header()})

    async def exchange(
        self,
        pool: BackendPool,
        path: str,
        payload: bytes,
        headers: Fields,
        total: float | None,
        silence: float | None,
        trace: Trace,
        consume: Callable[[Backend, Reply], Awaitable[T]],
        movable: bool = False,
        want: Backend | None = None,
        tokens: int = 0,
    ) -> T:
        """POST to a backend of ``pool`` (``pick``) and hand its answer to ``consume``.

        One attempt's whole life (connect, headers, body) sits inside one ``outstanding``
        increment, so a cancelled client cannot leak it. A leg goes at most twice:

        - a refused connection (the request never left) marks the backend down and goes to
          another, for every leg;
        - a ``movable`` leg (the prefill's: it has no answer to lose) also goes again when its
          backend goes down while it waits (pd_proxy.routing.pool ``Backend.went_down``: a hung
          replica), or the connection broke before an answer (to another backend), or a reused
          connection closed before any answer (the same backend, on a new connection). What the
          first attempt may hold on its backend is freed there: the closed connection aborts
          the request, and KV already handed out expires with its lease.

        ``want`` is the backend the route chose ahead; it takes the leg while it is healthy and
        not draining, else the pool picks. ``tokens`` (the route's uncached prompt tokens this
        leg computes) count in the backend's ``tokens_in_flight`` while the leg runs there: the
        work the cache scorer sees queued on it. Each retry is counted in
        ``pd_proxy_retries_total``. Other upstream errors become a ``ProxyError`` (502, or 504
        for a time limit). ``total`` bounds each attempt (connect included), ``silence`` each
        wait for the backend.
        """
        upstream = self.upstream
        stage = pool.role
        chosen = want is not None and want.healthy and not want.draining
        backend = want if chosen and want is not None else pick(pool)
        task = asyncio.current_task() if movable else None
        moved = resent = False  # at most one move to another backend, one resend on a new conn
        otel = trace.otel
        while True:
            backend.outstanding += 1
            backend.tokens_in_flight += tokens
            if task is not None:
                backend.waiters[task] = False
            answered = False
            sent = headers
            span = None
            if otel is not None:
                span = otel.leg(stage, path, backend.url)
                sent = Fields(headers + traceparent(span))
            try:
                deadline = None if total is None else upstream.loop.time() + total
                resp = await upstream.post(backend, path, sent, payload, deadline, silence)
                answered = True
                backend.progress += 1
                try:
                    result = await consume(backend, resp)
                finally:
                    status = resp.status  # release() resets it when the connection is reused
                    resp.release()  # closes the connection if the body was not read to the end
                    if span is not None:
                        end_leg(span, status)
                        span = None
                if backend.probing:
                    Breaker.proved(backend)
                return result
            except asyncio.CancelledError:
                # Told to move (its backend went down), not the client leaving: go elsewhere.
                if task is None or not backend.waiters.get(task) or task.uncancel() > 0:
                    raise
                move = Move("went down before answering", pool.pick(exclude=backend), "unhealthy")
            except StaleConnection as exc:
                if not movable:
                    self.metrics.backend_error(stage, backend.url)
                    raise ProxyError(502, f"{stage} backend {backend.url} failed: {exc}") from None
                move = Move(str(exc), backend, "stale_connection")
            except ConnectFailed as exc:
                if task is not None:
                    backend.waiters.pop(task, None)  # the move below is this leg's own
                mark_down(self.metrics, backend, stage)
                move = Move(f"unreachable: {exc}", pool.pick(exclude=backend), "unreachable")
            except UpstreamTimeout:
                self.metrics.backend_error(stage, backend.url)
                limit = f"timed out after {total:g}s" if total else f"sent nothing for {silence:g}s"
                raise ProxyError(504, f"{stage} backend {backend.url} {limit}") from None
            except UpstreamBroken as exc:
                self.metrics.backend_error(stage, backend.url)
                if not movable or answered:
                    raise ProxyError(502, f"{stage} backend {backend.url} failed: {exc}") from None
                move = Move(f"failed: {exc}", pool.pick(exclude=backend), "broken")
            finally:
                backend.outstanding -= 1
                backend.tokens_in_flight -= tokens
                if task is not None:
                    backend.waiters.pop(task, None)
                if span is not None:  # the attempt ended before an answer
                    end_leg(span, None, "no answer")
            again = resent if move.to is backend else moved
            if again or move.to is None:
                raise ProxyError(502, f"{stage} backend {backend.url} {move.why}")
            log.log(
                logging.INFO if move.to is backend else logging.WARNING,  # an idle close: routine
                "rid=%s %s %s %s, sending again to %s",
                trace.rid,
                stage,
                backend.url,
                move.why,
                move.to.url,
            )
            self.metrics.retry(stage, move.reason)
            if move.to is backend:
                resent = True
            else:
                moved = True
            backend = move.to

    def invalid_prefill_json(self, backend: Backend, data: bytes) -> ProxyError:
        self.metrics.backend_error("prefill", backend.url)
        return ProxyError(
            502, f"prefill backend {backend.url} returned invalid JSON: {snippet(data)}"
        )

    async def prefill_leg(
        self,
        endpoint: str,
        payload: bytes,
        headers: Fields,
        trace: Trace,
        want: Backend | None = None,
        tokens: int = 0,
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
            movable=True,
            want=want,
            tokens=tokens,
        )
        trace.prefill = backend.url
        trace.prefill_s = elapsed = time.perf_counter() - start
        if trace.lease is not None:
            trace.lease.prefill_done()
        self.metrics.prefill_duration.observe(elapsed)
        if status == 401:
            raise backend_refused_key(self.metrics, self.backend_key, "prefill", backend)
        if 400 <= status < 500:
            raise Passthrough(status, data, content_type)
        if status != 200:
            self.metrics.backend_error("prefill", backend.url)
            raise ProxyError(
                502, f"prefill backend {backend.url} returned {status}: {snippet(data)}"
            )
        return backend, data

    async def decode_to(
        self,
        endpoint: str,
        payload: bytes,
        headers: Fields,
        trace: Trace,
        consume: Callable[[Backend, Reply], Awaitable[T]],
        want: Backend | None = None,
    ) -> T:
        """``payload`` to a decode backend, its answer to ``consume``; ``decode_timeout`` bounds
        the silence (before the headers and between stream chunks), not the total."""
        return await self.exchange(
            self.decode_pool,
            endpoint,
            payload,
            headers,
            None,
            self.config.decode_timeout,
            trace,
            consume,
            want=want,
        )

    async def decode_leg(
        self,
        request: web.Request,
        endpoint: str,
        payload: bytes,
        headers: Fields,
        trace: Trace,
        want: Backend | None = None,
        tokens: int = 0,
    ) -> web.StreamResponse:
        """The normal decode leg: ``payload`` to a decode backend, its answer relayed
        (``tokens``: the prompt tokens it computes itself, on the decode-alone path)."""
        start = time.perf_counter()

        async def answer(backend: Backend, resp: Reply) -> web.StreamResponse:
            trace.decode = backend.url
            content_type = resp.headers.get("content-type", JSON_TYPE)
            if not is_event_stream(resp):
                # Read failures (timeout, broken connection) are mapped by exchange.
                data = await resp.read()
                now = self.first_byte(start, trace)
                self.decode_error(backend, resp.status, data, content_type)
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
                partial(trace.first_byte, start, self.metrics, True),
            )
            if client_left:
                trace.status = CLIENT_GONE
            return out

        return await self.exchange(  # not decode_to: one coroutine frame less per request
            self.decode_pool,
            endpoint,
            payload,
            headers,
            None,
            self.config.decode_timeout,
            trace,
            answer,
            want=want,
            tokens=tokens,
        )

    def release_kv(
        self, endpoint: str, client_body: dict[str, Any], kv: Any, headers: Fields, rid: str
    ) -> None:
        """Let a decode take the KV a prefill keeps for a request that will not read it (token 1
        ended it, a fan-out leg was cancelled), so the prefill frees its blocks now rather than
        when their lease ends. Nobody waits for the answer."""
        if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            return
        payload = dumps(release_body(client_body, kv))
        task = asyncio.create_task(self._release_leg(endpoint, payload, headers, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_leg(self, endpoint: str, payload: bytes, headers: Fields, rid: str) -> None:
        try:
            _, status, data, _ = await self.decode_to(
                endpoint, payload, headers, Trace(rid), read_whole
            )
        except ProxyError as exc:
            log.warning("rid=%s KV release on decode failed: %s", rid, exc.message)
            return
        if status != 200:
            log.warning("rid=%s KV release on decode answered %d: %s", rid, status, data[:200])

    def decode_error(self, backend: Backend, status: int, data: bytes, content_type: str) -> None:
        """The one mapping of a decode answer's status to the client's error: 200 passes, 401 is
        the proxy's key (502), another 4xx is the client's (passed through), the rest a 502."""
        if status == 200:
            return
        if status == 401:
            raise backend_refused_key(self.metrics, self.backend_key, "decode", backend)
        if 400 <= status < 500:
            raise Passthrough(status, data, content_type)
        self.metrics.backend_error("decode", backend.url)
        raise ProxyError(502, f"decode backend {backend.url} returned {status}: {snippet(data)}")

    def first_byte(self, start: float, trace: Trace, sent: bool = False) -> float:
        """The decode leg's first byte arrived (``start``: the leg was sent); returns now."""
        return trace.first_byte(start, self.metrics, sent)

    def sent(self, trace: Trace, now: float) -> None:
        """The client gets the first byte of a 200 answer at ``now``."""
        trace.sent(self.metrics, now)
