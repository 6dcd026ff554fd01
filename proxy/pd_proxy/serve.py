"""Serve one ``ProxyConfig`` in this process until SIGTERM/SIGINT, then drain.

On a signal the listening socket closes at once, ``/health`` turns 503, and in-flight requests
(streams included) get up to ``--drain-timeout`` seconds to finish. The parts (pools, metrics, keys,
upstream client, discovery, flow, side endpoints, canary) are built once by pd_proxy.api.app; this
module opens the listeners, settles the garbage collector and waits for the signal. pd_proxy.cli
runs it for one process, pd_proxy.workers.child for each ``--workers`` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from pd_proxy.api.app import build_app, build_metrics_app, make_runner
from pd_proxy.config import ConfigError, ProxyConfig
from pd_proxy.logs import flush_periodically
from pd_proxy.port_reservation import ListenError

log = logging.getLogger("pd_proxy")

# Each request allocates a few hundred short-lived objects (aiohttp's request, response, payload
# and timer objects), so the default gen-0 threshold of 700 runs the cyclic collector every
# couple of requests. Acyclic garbage is freed by reference counting anyway; collecting less
# often frees the same cycles a little later for less CPU.
GC_THRESHOLDS = (20_000, 20, 20)


async def serve(
    config: ProxyConfig,
    log_handler: logging.Handler | None = None,
    *,
    reuse_port: bool = False,
    announce: bool = True,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain.

    ``reuse_port`` binds with SO_REUSEPORT (workers share the port); ``announce`` logs the
    listening address, the backends and the open-proxy warning, and runs the canary when one is
    configured (worker 1 only); ``on_ready`` runs once listening.
    """
    app = build_app(config, canary=announce)  # one canary per proxy: worker 1's
    runner = make_runner(app, config)
    metrics_app = build_metrics_app(app)
    metrics_runner = None if metrics_app is None else web.AppRunner(metrics_app, access_log=None)
    # Starts the client session and the health checker, and waits for its first round (app.py).
    await runner.setup()
    listening = False
    flusher = None
    try:  # from here on, any failure (a busy port included) still closes the session and task
        await _listen(runner, config, reuse_port, announce)
        if metrics_runner is not None:
            await metrics_runner.setup()
            await _listen_metrics(metrics_runner, config, reuse_port, announce)
        listening = True
        _settle_gc()
        if log_handler is not None:
            log_handler.flush()  # the "listening on" line must not wait for the first flush
            flusher = asyncio.create_task(flush_periodically(log_handler))
        if on_ready is not None:
            on_ready()
        await _wait_for_signal()
        log.info("shutting down: draining in-flight requests (up to %gs)", config.drain_timeout)
    finally:
        await runner.cleanup()  # drains; metrics stay scrapable meanwhile
        if metrics_runner is not None and metrics_runner.server is not None:
            await metrics_runner.cleanup()
        if listening:
            log.info("stopped")
        if flusher is not None:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher


async def _listen(
    runner: web.AppRunner, config: ProxyConfig, reuse_port: bool = False, announce: bool = True
) -> None:
    """Open the listening socket; an OSError becomes a ``ListenError`` naming the address."""
    site = web.TCPSite(
        runner,
        config.host,
        config.port,
        backlog=2048,
        reuse_address=True,
        reuse_port=reuse_port or None,
    )
    try:
        await site.start()
    except OSError as exc:
        raise ListenError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    if not announce:
        return
    for addr in runner.addresses:
        host, port = addr[0], addr[1]
        log.info("listening on http://%s:%d", host, port)
    log.info(
        "prefill: %s | decode: %s",
        " ".join(config.sources("prefill")),
        " ".join(config.sources("decode")),
    )
    if config.api_key_file is None:
        port = runner.addresses[0][1] if runner.addresses else config.port
        log.warning(
            "no client API key configured (PD_PROXY_API_KEY_FILE): anyone who can reach port %d "
            "can use the model",
            port,
        )


async def _listen_metrics(
    runner: web.AppRunner, config: ProxyConfig, reuse_port: bool = False, announce: bool = True
) -> None:
    """The second listener, for ``GET /metrics`` only (``--metrics-port``)."""
    assert config.metrics_port is not None
    site = web.TCPSite(
        runner, config.host, config.metrics_port, reuse_address=True, reuse_port=reuse_port or None
    )
    try:
        await site.start()
    except OSError as exc:
        raise ListenError(
            f"cannot listen on {config.host}:{config.metrics_port} (metrics port): {exc}"
        ) from None
    if not announce:
        return
    for addr in runner.addresses:
        log.info("metrics on http://%s:%d/metrics", addr[0], addr[1])


def _settle_gc() -> None:
    """Startup objects (modules, app, config) live for good: keep them out of every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _run(coro_factory) -> None:
    """Run on uvloop when it is installed; it roughly halves the proxy's per-request CPU."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro_factory())
        return
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro_factory())
    else:  # pragma: no cover - 3.10
        uvloop.install()
        asyncio.run(coro_factory())


def run(config: ProxyConfig, handler: logging.Handler, **serve_options) -> int:
    """Serve ``config`` in this process; the exit code (2: cannot listen, bad key file)."""
    try:
        _run(lambda: serve(config, handler, **serve_options))
    # ListenError, e.g. port in use; ConfigError, e.g. a key file deleted since validate
    # read it: one line like a bad flag, no traceback.
    except (ListenError, ConfigError) as exc:
        handler.flush()  # earlier log lines first: the error is the last line
        print(f"pd-proxy: error: {exc}", file=sys.stderr)
        return 2
    finally:
        handler.flush()
    return 0
