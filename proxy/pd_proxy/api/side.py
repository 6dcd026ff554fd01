"""The routes beside the P/D flow: ``/v1/models``, ``/health``, ``/metrics`` and 404/405.

None of them runs the two legs, so none needs the legs' upstream client: ``/v1/models`` is one
plain GET to a decode backend through the aiohttp session, and the rest answer from the proxy's
own state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.config.key_files import BackendKey
from pd_proxy.http.exchange import mark_down, pick
from pd_proxy.legs import backend_refused_key
from pd_proxy.metrics import CONTENT_TYPE, ProxyMetrics
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS, JSON_TYPE
from pd_proxy.protocol.errors import ProxyError, error_response

# Errors that mean the request never reached the backend, so another one may take it.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


class SideEndpoints:
    """Bound to one app and its aiohttp ``session`` (shared with the health checks; pd_proxy.api.app
    builds both when the app starts); ``draining`` is set when the app begins to shut down.
    ``/v1/models`` is bounded as a prefill leg is (``prefill_timeout``, ``connect_timeout``);
    ``/health`` is 503 while ``not_ready`` says why (cache-aware routing waiting for KV events)."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        prefill: BackendPool,
        decode: BackendPool,
        session: aiohttp.ClientSession,
        *,
        backend_key: BackendKey | None,
        prefill_timeout: float,
        connect_timeout: float,
        not_ready: Callable[[], str | None] | None = None,
    ) -> None:
        self.backend_key = backend_key
        self.not_ready = not_ready  # the planner's: what it waits to know before serving
        self.metrics = metrics
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.session = session
        self.draining = False
        # /v1/models (aiohttp); the legs' limits are passed to the upstream client as numbers.
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=prefill_timeout, sock_connect=connect_timeout
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models`` answered by a decode backend (it serves the same model)."""
        status = 500
        backend: Backend | None = None
        try:
            backend = pick(self.decode_pool)
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
                    content_type = resp.headers.get("Content-Type", JSON_TYPE)
            except CONNECT_ERRORS as exc:
                mark_down(self.metrics, backend, "models")
                raise ProxyError(502, f"decode backend {backend.url} unreachable: {exc}") from None
            except asyncio.TimeoutError:
                self.metrics.backend_error("models", backend.url)
                raise ProxyError(504, f"decode backend {backend.url} timed out") from None
            except aiohttp.ClientError as exc:
                self.metrics.backend_error("models", backend.url)
                raise ProxyError(502, f"decode backend {backend.url} failed: {exc!r}") from None
            if status == 401:
                raise backend_refused_key(self.metrics, self.backend_key, "models", backend)
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
        waiting = None if self.not_ready is None else self.not_ready()
        if waiting is not None:
            problems.append(waiting)
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


def metrics_page(metrics: ProxyMetrics) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /metrics`` of ``metrics``: it needs nothing built at start, so the metrics listener
    serves it too."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    return page


async def not_found(request: web.Request) -> web.Response:
    """404 for an unknown route, 405 for a completions endpoint asked with another method."""
    if request.path in (COMPLETIONS, CHAT_COMPLETIONS):
        return error_response(405, f"{request.method} is not allowed on {request.path}; use POST")
    return error_response(404, f"no route for {request.method} {request.path}")
