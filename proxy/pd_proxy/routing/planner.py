"""The plan stage: one ``Route`` for each P/D-eligible request.

Three settings shape it. With neither ``--local-prefill-max-tokens`` nor cache-aware routing,
every request goes P/D to the pools' choices and nothing is tokenized. With a local-prefill limit,
the prompt's token ids (pd_proxy.routing.token_count) decide the path (pd_proxy.routing.decider).
With cache-aware routing (``--prefix-cache-routing``), the scorer also picks the replicas and the
limit applies to the tokens the chosen decode does not hold (pd_proxy.routing.cache.router).

The libraries of the local tokenizer and of KV events (tokenizers, Jinja2, pyzmq) are imported
only when a setting needs them, so a proxy without them starts as fast as before.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp

from pd_proxy.backends.route import DEFAULT_PD, PD, Route
from pd_proxy.config.settings import CACHE_OFF, CACHE_WITH_APPROX, CACHE_WITH_EVENTS
from pd_proxy.routing import decider
from pd_proxy.routing.cache.extra import request_keys  # pure: no library of the cache's
from pd_proxy.routing.token_count import TokenCounter

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pd_proxy.backends.pool import BackendPool
    from pd_proxy.call import Call
    from pd_proxy.config import ProxyConfig
    from pd_proxy.config.key_files import BackendKey
    from pd_proxy.http.exchange import Exchange
    from pd_proxy.http.upstream import Upstream
    from pd_proxy.routing.block_size import BlockSizes
    from pd_proxy.routing.cache.follow import CacheFollower
    from pd_proxy.routing.cache.metrics import CacheMetrics
    from pd_proxy.routing.cache.router import CacheRouter
    from pd_proxy.tracing import Trace

Job = tuple[str, Callable[[aiohttp.ClientSession], Coroutine[Any, Any, None]]]


class Planner:
    def __init__(
        self,
        local_max: int,
        counter: TokenCounter | None = None,
        cache: CacheRouter | None = None,
        metrics: CacheMetrics | None = None,
        jobs: list[Job] | None = None,
    ) -> None:
        self.local_max = local_max
        self.counter = counter
        self.cache = cache
        self.metrics = metrics  # counts each decision when cache routing or a tokenizer is on
        self._jobs = jobs or []

    def jobs(self) -> list[Job]:
        return list(self._jobs)

    def not_ready(self) -> str | None:
        """Why ``/health`` should wait: cache-aware routing does not know the caches yet."""
        return None if self.cache is None else self.cache.known.not_ready()

    async def plan(self, call: Call, trace: Trace) -> Route:
        counter, cache, local_max = self.counter, self.cache, self.local_max
        if counter is None:
            return DEFAULT_PD
        if local_max <= 0 and cache is not None and not cache.has_choice():
            route = Route(PD, decider.NO_CHOICE)
        else:
            ids = await counter.ids(call, trace)
            if cache is not None:
                route = cache.route(ids, local_max, request_keys(call.client_body))
            else:
                path, reason = decider.decide(None if ids is None else len(ids), 0, local_max)
                route = Route(path, reason, prompt_tokens=None if ids is None else len(ids))
        if self.metrics is not None:
            self.metrics.decisions.labels(route.path, route.reason).inc()
        return route


def build_planner(
    config: ProxyConfig,
    registry: CollectorRegistry,
    *,
    pools: tuple[BackendPool, BackendPool],
    upstream: Upstream,
    exchange: Exchange,
    backend_key: BackendKey | None,
) -> Planner:
    """The planner the settings ask for, with the background jobs its parts need, built from
    explicit parts (``pools``: prefill, decode)."""
    routing = config.prefix_cache_routing != CACHE_OFF
    counts = config.local_prefill_max_tokens > 0
    if not routing and not counts:
        return Planner(0)
    prefill, decode = pools
    metrics = check = None
    jobs: list[Job] = []
    if routing or config.tokenizer is not None:
        from pd_proxy.routing.cache.metrics import CacheMetrics

        metrics = CacheMetrics(registry)
    if config.tokenizer is not None:
        from pd_proxy.routing.tokenizer_check import tokenizer_check

        assert metrics is not None
        check = tokenizer_check(config, decode, backend_key, metrics)
        if check is not None:
            jobs.append(("pd-proxy-tokenizer-check", check.run))
    counter = TokenCounter(exchange, decode, config.tokenize_timeout, check, metrics)
    cache = None
    if routing:
        assert metrics is not None
        follower = _follower(config, pools, backend_key, metrics)
        block_sizes = _block_sizes(upstream, backend_key, config.health_timeout)
        cache = _router(config, pools, follower, block_sizes, metrics)
        jobs.append(("pd-proxy-cache", follower.run))
    return Planner(config.local_prefill_max_tokens, counter, cache, metrics, jobs)


def _follower(
    config: ProxyConfig,
    pools: tuple[BackendPool, BackendPool],
    backend_key: BackendKey | None,
    metrics: CacheMetrics,
) -> CacheFollower:
    from pd_proxy.routing.cache.follow import CacheFollower

    mode = config.prefix_cache_routing
    return CacheFollower(
        pools,
        events_on=mode in CACHE_WITH_EVENTS,
        approx_on=mode in CACHE_WITH_APPROX,
        approx_blocks=config.cache_approx_blocks,
        backend_key=backend_key,
        health_timeout=config.health_timeout,
        metrics=metrics,
        index_capacity=config.cache_index_max_blocks,
        ready_timeout=config.cache_ready_timeout,
    )


def _block_sizes(upstream: Upstream, backend_key: BackendKey | None, timeout: float) -> BlockSizes:
    from pd_proxy.routing.block_size import BlockSizes

    return BlockSizes(upstream, backend_key, timeout)


def _router(
    config: ProxyConfig,
    pools: tuple[BackendPool, BackendPool],
    follower: CacheFollower,
    block_sizes: BlockSizes,
    metrics: CacheMetrics,
) -> CacheRouter:
    from pd_proxy.routing.cache.router import CacheRouter

    prefill, decode = pools
    return CacheRouter(
        prefill,
        decode,
        follower,
        block_sizes=block_sizes,
        metrics=metrics,
        weight=config.cache_overlap_weight,
        max_imbalance=config.cache_max_imbalance,
    )
