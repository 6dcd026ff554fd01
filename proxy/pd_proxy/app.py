"""App factory and runner: wires config, pools, metrics, handlers and the shared client session.

``build_app`` is what in-process tests use; ``make_runner`` adds the server settings the proxy
relies on (client disconnects cancel the handler, no access log, drain timeout), so use it (or pass
``handler_cancellation=True`` to aiohttp's ``TestServer``) when disconnect behaviour matters.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from pd_proxy.config import ProxyConfig
from pd_proxy.handlers import ProxyHandlers
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.pool import Backend, BackendPool, HealthChecker

HANDLERS_KEY = web.AppKey("pd_proxy_handlers", ProxyHandlers)
# Below uvicorn's 5 s keep-alive (vLLM's server), so we drop idle upstream connections before the
# backend does and never send a request onto a socket it is closing.
UPSTREAM_KEEPALIVE_S = 4.0
# Slack over the health-check timeout for the first round (checks run concurrently).
FIRST_ROUND_MARGIN_S = 1.0


def build_app(config: ProxyConfig) -> web.Application:
    """A ready-to-run proxy application; its metrics live in ``app[HANDLERS_KEY].metrics``."""
    prefill = BackendPool("prefill", config.prefill)
    decode = BackendPool("decode", config.decode)
    metrics = ProxyMetrics(config.prefill, config.decode)
    handlers = ProxyHandlers(config, metrics, prefill, decode)

    app = web.Application(client_max_size=config.max_body_bytes)
    app[HANDLERS_KEY] = handlers
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    if config.metrics:
        app.router.add_get("/metrics", handlers.metrics_page)
    app.router.add_route("*", "/{tail:.*}", handlers.not_found)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300
        )
        # No Accept-Encoding: backends answer uncompressed, so bytes relay unchanged. No cookie
        # jar: backends set none, and filtering cookies costs CPU on every leg.
        session = aiohttp.ClientSession(
            connector=connector,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        handlers.session = session

        def on_result(backend: Backend, ok: bool) -> None:
            metrics.set_health(backend.role, backend.url, ok)
            if not ok:
                metrics.backend_error("health", backend.url)

        checker = HealthChecker(
            [prefill, decode], session, config.health_interval, config.health_timeout, on_result
        )
        handlers.checker = checker
        task = asyncio.create_task(checker.run(), name="pd-proxy-health")
        try:
            await _first_round(checker, config.health_timeout)
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await session.close()

    async def on_shutdown(app: web.Application) -> None:
        handlers.draining = True  # /health turns 503 so load balancers stop sending

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    return app


async def _first_round(checker: HealthChecker, check_timeout: float) -> None:
    """Wait for the first health round, so ``/health`` is truthful from the first request.

    Backends start optimistic (healthy); without this wait a proxy whose backends are down would
    answer 200 until the first round ends. Refused connections end the round at once; a hung
    backend delays start-up by about the check timeout; the bound keeps a round that crashes
    (logged by the checker) from blocking start-up.
    """
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(checker.first_round.wait(), check_timeout + FIRST_ROUND_MARGIN_S)


def make_runner(app: web.Application, config: ProxyConfig) -> web.AppRunner:
    """The runner settings the proxy is meant to run with."""
    return web.AppRunner(
        app,
        access_log=None,  # one line per request comes from the handler, with timings
        handler_cancellation=True,  # a client that leaves cancels both upstream legs
        shutdown_timeout=config.drain_timeout,
        keepalive_timeout=75.0,
    )
