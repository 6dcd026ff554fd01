"""The legs every mode of the flow is made of: the prefill leg, the normal decode leg, and the one
mapping from a decode answer's status to the error the client gets.

Each leg is one exchange with a backend of its pool (pd_proxy.http.exchange: failover, retries
and what a failure means), to the replica its ``Route`` chose while that is healthy. A mode
(pd_proxy.modes) is a strategy with the ``Mode`` signature, chosen once at start-up, that runs a
request's legs. ``Legs`` is built by the server's composition root (pd_proxy.api.assemble) from
explicit parts; the modes and the canary call its legs and take nothing else from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeVar

from aiohttp import web

from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.backends.route import Route
from pd_proxy.call import Call
from pd_proxy.config.key_files import BackendKey
from pd_proxy.http.connection import Reply
from pd_proxy.http.exchange import Exchange, read_whole
from pd_proxy.http.relay import relay_events, relay_stream
from pd_proxy.http.upstream import Fields
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.protocol.codec import dumps
from pd_proxy.protocol.endpoints import JSON_TYPE, Endpoint
from pd_proxy.protocol.errors import Passthrough, ProxyError
from pd_proxy.protocol.pd_bodies import release_body
from pd_proxy.protocol.sse import MEDIA_TYPE
from pd_proxy.tracing import Trace

log = logging.getLogger("pd_proxy.request")

CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent
T = TypeVar("T")


class Lease(Protocol):
    """What an admitted request holds (pd_proxy.admission.lease), told by the legs as they go:
    the prefill answered, decode's first byte came. The pipeline releases it at the end."""

    def prefill_done(self) -> None: ...

    def decode_started(self) -> None: ...

    def release(self) -> None: ...


class NoLease:
    """The lease of a request that holds none (admission off, side requests)."""

    __slots__ = ()

    def prefill_done(self) -> None:
        pass

    def decode_started(self) -> None:
        pass

    def release(self) -> None:
        pass


NO_LEASE: Lease = NoLease()


class Mode(Protocol):
    """How a request's legs run (pd_proxy.modes) along its route, holding ``lease``: the answer
    to the client, or an error raised. Every mode, fan-out included, takes the same four."""

    async def __call__(
        self, call: Call, route: Route, trace: Trace, lease: Lease
    ) -> web.StreamResponse: ...


def is_event_stream(resp: Reply) -> bool:
    """A 200 answer that streams events; anything else (JSON, an error) is read whole."""
    return resp.status == 200 and resp.headers.get("content-type", "").startswith(MEDIA_TYPE)


def snippet(data: bytes, limit: int = 200) -> str:
    return data[:limit].decode("utf-8", "replace")


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
    """The legs of one app's requests to its ``prefill`` and ``decode`` pools, each one
    ``exchange`` (built when the app starts: its client needs a running loop, see
    pd_proxy.api.app). ``prefill_timeout`` bounds a prefill leg; ``decode_timeout`` the
    silence of a decode leg."""

    def __init__(
        self,
        exchange: Exchange,
        prefill: BackendPool,
        decode: BackendPool,
        *,
        metrics: ProxyMetrics,
        backend_key: BackendKey | None,
        prefill_timeout: float,
        decode_timeout: float,
    ) -> None:
        self.exchange = exchange
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.metrics = metrics
        self.backend_key = backend_key  # named in the 502 of a backend that refuses it
        self.prefill_timeout = prefill_timeout
        self.decode_timeout = decode_timeout
        self._background: set[asyncio.Task[None]] = set()  # KV releases nobody waits for

    def invalid_prefill_json(self, backend: Backend, data: bytes) -> ProxyError:
        self.metrics.backend_error("prefill", backend.url)
        return ProxyError(
            502, f"prefill backend {backend.url} returned invalid JSON: {snippet(data)}"
        )

    async def prefill_leg(
        self,
        endpoint: Endpoint,
        payload: bytes,
        headers: Fields,
        *,
        trace: Trace,
        lease: Lease,
        want: Backend | None = None,
        tokens: int = 0,
    ) -> tuple[Backend, bytes]:
        """POST ``payload`` to a prefill backend (``want`` while it is usable); its 200 answer's
        body, or the error it is. ``tokens``: the prompt tokens it computes."""
        start = time.perf_counter()
        backend, status, data, content_type = await self.exchange(
            self.prefill_pool,
            endpoint,
            payload,
            headers,
            trace=trace,
            consume=read_whole,
            total=self.prefill_timeout,
            movable=True,
            want=want,
            tokens=tokens,
        )
        trace.prefill = backend.url
        trace.prefill_s = elapsed = time.perf_counter() - start
        lease.prefill_done()
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
        endpoint: Endpoint,
        payload: bytes,
        headers: Fields,
        *,
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
            trace=trace,
            consume=consume,
            silence=self.decode_timeout,
            want=want,
        )

    async def decode_leg(
        self,
        call: Call,
        payload: bytes,
        *,
        trace: Trace,
        lease: Lease,
        want: Backend | None = None,
        tokens: int = 0,
    ) -> web.StreamResponse:
        """The normal decode leg of ``call``: ``payload`` to a decode backend, its answer relayed
        (``tokens``: the prompt tokens it computes itself, on the decode-alone path)."""
        start = time.perf_counter()

        async def answer(backend: Backend, resp: Reply) -> web.StreamResponse:
            trace.decode = backend.url
            content_type = resp.headers.get("content-type", JSON_TYPE)
            if not is_event_stream(resp):
                # Read failures (timeout, broken connection) are mapped by exchange.
                data = await resp.read()
                now = self.first_byte(start, trace, lease)
                self.decode_error(backend, resp.status, data, content_type)
                self.sent(trace, now)
                return web.Response(
                    body=data, headers={"Content-Type": content_type, "X-Request-Id": trace.rid}
                )
            out, client_left = await relay_stream(
                call.request,
                resp,
                backend,
                content_type=content_type,
                rid=trace.rid,
                metrics=self.metrics,
                decode_timeout=self.decode_timeout,
                first_byte=partial(trace.first_byte, start, self.metrics, True),
                started=lease.decode_started,
            )
            if client_left:
                trace.status = CLIENT_GONE
            return out

        return await self.exchange(  # not decode_to: one coroutine frame less per request
            self.decode_pool,
            call.endpoint,
            payload,
            call.headers,
            trace=trace,
            consume=answer,
            silence=self.decode_timeout,
            want=want,
            tokens=tokens,
        )

    async def relay_into(
        self,
        out: web.StreamResponse,
        resp: Reply,
        backend: Backend,
        *,
        transform: Callable[[bytes], bytes],
        trace: Trace,
        start: float,
        lease: Lease,
    ) -> bool:
        """A decode leg's event stream relayed through ``transform`` into ``out``, a stream its
        mode already opened (``start``: the leg was sent); true when the client left."""
        return await relay_events(
            out,
            resp,
            backend,
            transform=transform,
            rid=trace.rid,
            metrics=self.metrics,
            decode_timeout=self.decode_timeout,
            first_byte=partial(trace.first_byte, start, self.metrics),
            started=lease.decode_started,
        )

    def release_kv(
        self, endpoint: Endpoint, client_body: dict[str, Any], kv: Any, headers: Fields, rid: str
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

    async def _release_leg(
        self, endpoint: Endpoint, payload: bytes, headers: Fields, rid: str
    ) -> None:
        try:
            _, status, data, _ = await self.decode_to(
                endpoint, payload, headers, trace=Trace(rid), consume=read_whole
            )
        except ProxyError as exc:
            log.warning("rid=%s KV release on decode failed: %s", rid, exc.message)
            return
        if status != 200:
            log.warning("rid=%s KV release on decode answered %d: %s", rid, status, data[:200])

    def decode_failed(self, backend: Backend, what: str) -> ProxyError:
        """A decode answer the mode cannot use: counted as the backend's error, a 502 saying
        ``what`` it did."""
        self.metrics.backend_error("decode", backend.url)
        return ProxyError(502, f"decode backend {backend.url} {what}")

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

    def first_byte(self, start: float, trace: Trace, lease: Lease, sent: bool = False) -> float:
        """The decode leg's first byte arrived (``start``: the leg was sent); returns now. The
        lease gives back the decode's pending pull; the trace records the time."""
        now = trace.first_byte(start, self.metrics, sent)
        lease.decode_started()
        return now

    def sent(self, trace: Trace, now: float) -> None:
        """The client gets the first byte of a 200 answer at ``now``."""
        trace.sent(self.metrics, now)
