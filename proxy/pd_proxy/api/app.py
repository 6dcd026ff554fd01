"""App factory and runner: wires config, pools, metrics, the routes (pd_proxy.pipeline for the two
completions endpoints, pd_proxy.api.side for the rest) and the shared client session (health
checks, ``/v1/models``) and upstream client (the two legs, pd_proxy.http.upstream).

The app is built in two steps, each once and in order. ``build_app`` builds what needs no event
loop (``Proxy``: config, metrics, pools, discovery, keys) and the routes. When the app starts,
``start`` builds the rest (``Running``: session, upstream client, the legs and the pipeline
from pd_proxy.api.assemble, side endpoints, health checker, canary), each from the parts before
it, and the app's one cleanup context (``_lifecycle``) then starts the background tasks;
stopping undoes all of it in reverse. No part is set on another after it was built: a new part
is one more field and one more line in ``start``.

``build_app`` is what in-process tests use; ``make_runner`` adds the server settings the proxy
relies on (client disconnects cancel the handler, no access log, drain timeout), so use it (or pass
``handler_cancellation=True`` to aiohttp's ``TestServer``) when disconnect behaviour matters.
With ``metrics_port`` set, ``build_metrics_app`` gives the app for that second listener.
With DNS names or an endpoints file configured, discovery (pd_proxy.discovery.watch) fills the pools
before the first health round and then keeps them current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pd_proxy.api.assemble import build_canary, build_flow
from pd_proxy.api.auth import ANONYMOUS, ClientKeys, unauthorized
from pd_proxy.api.canary import Canary
from pd_proxy.api.side import SideEndpoints, metrics_page, not_found
from pd_proxy.backends.breaker import Breaker
from pd_proxy.backends.health import HealthChecker
from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.config import ConfigError, ProxyConfig
from pd_proxy.config.key_files import BackendKey, KeyFileError
from pd_proxy.discovery.watch import Discovery, Resolver
from pd_proxy.http.upstream import Upstream
from pd_proxy.legs import Legs
from pd_proxy.metrics import SYNC_INTERVAL_S, ProxyMetrics
from pd_proxy.pipeline import Pipeline
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from pd_proxy.protocol.errors import error_response
from pd_proxy.tracing import Tracing, TracingError, settings_from

request_log = logging.getLogger("pd_proxy.request")
log = logging.getLogger("pd_proxy")


@dataclass(frozen=True, eq=False)
class Proxy:
    """The parts built with the app (no event loop needed), at ``app[PROXY_KEY]``: for the
    metrics listener and in-process tests."""

    config: ProxyConfig
    metrics: ProxyMetrics
    prefill_pool: BackendPool
    decode_pool: BackendPool
    client_keys: ClientKeys | None  # checked in front of the routes (_require_key)
    backend_key: BackendKey | None  # sent to the backends instead of the client's
    discovery: Discovery | None  # when backends are discovered
    canary_interval_s: float | None  # --canary-minutes; None: this app runs no canary


@dataclass(frozen=True, eq=False)
class Running:
    """The parts built when the app starts, at ``app[RUNNING_KEY]`` from then on: ``start``
    builds them once, in this order, each from the ones above it (the first two need a running
    event loop)."""

    session: aiohttp.ClientSession  # health checks and /v1/models
    upstream: Upstream  # the legs' keep-alive client
    legs: Legs  # the pipeline's modes and the canary run on them
    pipeline: Pipeline
    side: SideEndpoints
    checker: HealthChecker
    canary: Canary | None


PROXY_KEY = web.AppKey("pd_proxy", Proxy)
RUNNING_KEY = web.AppKey("pd_proxy_running", Running)

# Below uvicorn's 5 s keep-alive (vLLM's server), so we drop idle upstream connections before the
# backend does and never send a request onto a socket it is closing.
UPSTREAM_KEEPALIVE_S = 4.0
# Slack over the health-check timeout for the first round (checks run concurrently).
FIRST_ROUND_MARGIN_S = 1.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    config: ProxyConfig, resolver: Resolver | None = None, *, canary: bool = True
) -> web.Application:
    """A ready-to-run proxy application; its metrics live in ``app[PROXY_KEY].metrics``.

    ``resolver`` resolves the ``*_dns`` names (default: the event loop's ``getaddrinfo``).
    ``canary=False`` leaves the canary out even with ``--canary-minutes`` (workers 2..N).
    """
    prefill = BackendPool("prefill", config.prefill)
    decode = BackendPool("decode", config.decode)
    metrics = ProxyMetrics(config.prefill, config.decode, created=config.metrics_created)
    metrics.track_pools((prefill, decode))
    discovery = Discovery.from_config(
        config, {"prefill": prefill, "decode": decode}, metrics, resolver
    )
    client_keys = _key_file(ClientKeys, config.api_key_file, "--api-key-file")
    backend_key = _key_file(BackendKey, config.backend_api_key_file, "--backend-api-key-file")
    canary_s = config.canary_minutes * 60 if canary and config.canary_minutes else None
    proxy = Proxy(config, metrics, prefill, decode, client_keys, backend_key, discovery, canary_s)

    def guard(handler: Handler, endpoint: str | None = None) -> Handler:
        if client_keys is None:
            return handler  # no wrapper at all: nothing added to the request path
        return _require_key(client_keys, handler, metrics, endpoint)

    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY_KEY] = proxy
    # The completions endpoints check the key as their pipeline's first stage (_complete).
    app.router.add_post(COMPLETIONS, _completions)
    app.router.add_post(CHAT_COMPLETIONS, _chat_completions)
    app.router.add_get("/v1/models", guard(_models, "/v1/models"))
    app.router.add_get("/health", _health)  # always open: orchestrators probe it
    if config.metrics and config.metrics_port is None:
        app.router.add_get("/metrics", guard(metrics_page(metrics)))
    app.router.add_route("*", "/{tail:.*}", guard(not_found))
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    return app


# The routes that need the running parts. Each calls the part's handler directly: no frame more
# than a bound method would cost, one dict lookup.
async def _completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, COMPLETIONS)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, CHAT_COMPLETIONS)


async def _complete(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """The pipeline's first stage, authenticate: the client key before the body is read, so a
    caller without a key costs no parsing and no backend hears of it."""
    keys = request.app[PROXY_KEY].client_keys
    client = ANONYMOUS
    if keys is not None:
        found = keys.identify(request.headers.get("Authorization"))
        if isinstance(found, str):
            return unauthorized(request, found, request.app[PROXY_KEY].metrics, endpoint)
        client = found
    return await request.app[RUNNING_KEY].pipeline.handle(request, endpoint, client)


async def _models(request: web.Request) -> web.StreamResponse:
    return await request.app[RUNNING_KEY].side.models(request)


async def _health(request: web.Request) -> web.StreamResponse:
    return await request.app[RUNNING_KEY].side.health(request)


async def start(proxy: Proxy, stack: contextlib.AsyncExitStack) -> Running:
    """Build the running parts once, in order, each closed by ``stack`` (so in reverse).

    Needs a running event loop; starts no task (``_lifecycle`` does).
    """
    config, metrics = proxy.config, proxy.metrics
    pools = (proxy.prefill_pool, proxy.decode_pool)
    # No Accept-Encoding: backends answer uncompressed, so bytes relay unchanged. No cookie
    # jar: backends set none, and filtering cookies costs CPU on every leg.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300
        ),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    stack.push_async_callback(session.close)
    upstream = Upstream(config.connect_timeout, UPSTREAM_KEEPALIVE_S)
    stack.callback(upstream.close)
    tracing = _tracing()
    if tracing is not None:  # its last export must not hold the event loop
        stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
    flow = build_flow(  # pd_proxy.api.assemble: the completions path, from explicit parts
        config,
        metrics,
        pools=pools,
        upstream=upstream,
        backend_key=proxy.backend_key,
        tracing=tracing,
    )
    side = SideEndpoints(
        metrics,
        *pools,
        session,
        backend_key=proxy.backend_key,
        prefill_timeout=config.prefill_timeout,
        connect_timeout=config.connect_timeout,
        not_ready=flow.pipeline.planner.not_ready,
    )

    def on_result(backend: Backend, passed: bool) -> None:
        metrics.set_health(backend.role, backend.url, backend.healthy)
        if not passed:
            metrics.backend_error("health", backend.url)

    checker = HealthChecker(
        list(pools),
        session,
        config.health_interval,
        config.health_timeout,
        on_result,
        breaker=Breaker(config.health_failures, config.health_successes),
    )
    canary = None
    if proxy.canary_interval_s is not None:
        canary = build_canary(
            config,
            metrics.registry,
            flow,
            prefill=proxy.prefill_pool,
            backend_key=proxy.backend_key,
            interval_s=proxy.canary_interval_s,
        )
    return Running(session, upstream, flow.legs, flow.pipeline, side, checker, canary)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The app's one cleanup context: the running parts, then the background work, in order;
    everything stops in reverse."""
    proxy = app[PROXY_KEY]
    async with contextlib.AsyncExitStack() as stack:
        running = app[RUNNING_KEY] = await start(proxy, stack)
        checker, discovery = running.checker, proxy.discovery
        if discovery is not None:
            stack.callback(discovery.close)
            # Discovered backends join unhealthy; the first round below checks them.
            await discovery.refresh()
        _background(stack, checker.run(), "pd-proxy-health")
        await _first_round(checker, proxy.config.health_timeout)
        if discovery is not None:
            _background(stack, discovery.run(checker.check_some), "pd-proxy-discovery")
        if proxy.metrics.multiprocess_dir is not None:  # --workers: others read our gauges
            _background(stack, _sync_metrics(proxy.metrics), "pd-proxy-metrics")
        if running.canary is not None:
            running.canary.start()
            stack.push_async_callback(running.canary.stop)
        for name, job in running.pipeline.jobs():  # cache events, the tokenizer check
            _background(stack, job(running.session), name)
        yield


def _background(
    stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, None], name: str
) -> None:
    """Run ``work`` as a task until ``stack`` closes."""
    task = asyncio.create_task(work, name=name)

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stack.push_async_callback(stop)


async def _on_shutdown(app: web.Application) -> None:
    running = app.get(RUNNING_KEY)
    if running is None:  # it never started
        return
    running.side.draining = True  # /health turns 503 so load balancers stop sending
    if running.canary is not None:
        await running.canary.stop()  # no new canary legs while in-flight requests drain


def build_metrics_app(app: web.Application) -> web.Application | None:
    """The second listener's app (``GET /metrics``, no key) when ``metrics_port`` is set."""
    proxy = app[PROXY_KEY]
    if proxy.config.metrics_port is None:
        return None
    metrics_app = web.Application()
    metrics_app.router.add_get("/metrics", metrics_page(proxy.metrics))

    async def not_found(request: web.Request) -> web.Response:
        return error_response(404, f"no route for {request.method} {request.path}")

    metrics_app.router.add_route("*", "/{tail:.*}", not_found)
    return metrics_app


def _tracing() -> Tracing | None:
    """The tracer the ``OTEL_*`` variables ask for (pd_proxy.tracing), or None: no endpoint."""
    try:
        settings = settings_from(os.environ)
    except TracingError as exc:
        raise ConfigError(str(exc)) from None
    if settings is None:
        return None
    log.info("tracing: OTLP %s to %s", settings.protocol, settings.endpoint)
    return Tracing(settings)


def _key_file(kind, path: str | None, flag: str):
    """``kind(path)``, or None without a path; a file that went bad since the config check is a
    ``ConfigError`` too."""
    if path is None:
        return None
    try:
        return kind(path)
    except KeyFileError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _require_key(
    keys: ClientKeys, handler: Handler, metrics: ProxyMetrics, endpoint: str | None
) -> Handler:
    """``handler`` behind the client key check: a bad key gets a 401, and no backend is touched."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        problem = keys.check(request.headers.get("Authorization"))
        if problem is None:
            return await handler(request)
        return unauthorized(request, problem, metrics, endpoint)

    return guarded


async def _sync_metrics(metrics: ProxyMetrics) -> None:
    while True:
        metrics.sync()
        await asyncio.sleep(SYNC_INTERVAL_S)


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
