"""What each replica's prefix cache holds, kept in step with the pools: the KV-event indexes
(one per engine behind a replica's API server), the proxy's own record of what it sent where
(pending entries, and the approximate index for replicas without events), and the watch loop
that follows replicas joining, leaving, going down and coming back.

Event discovery: each replica's ``GET /kv_event_sources`` (vLLM 0.32's API server), looked up when
the replica is first seen healthy and again after it was down; a replica that answers none
(events off, an older vLLM) uses the approximate index when the mode allows it.

The event indexes of a role share one ``BlockHolders`` (pd_proxy.routing.cache.holders), bounded
by ``index_capacity`` block-replica pairs. Readiness (``not_ready``, read by ``/health``): with
events on, the proxy knows once every healthy replica's publishers were looked up and each was
replayed or sent a first batch, or once ``ready_timeout`` seconds have passed since it started
following (then it serves anyway, and says so in a log line and a metric). It is decided once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import aiohttp
import zmq.asyncio

from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.config.key_files import BackendKey
from pd_proxy.routing.cache.approx import ApproxIndex
from pd_proxy.routing.cache.events import Batch, Cleared
from pd_proxy.routing.cache.holders import BlockHolders
from pd_proxy.routing.cache.index import NEXT, Health, ReplicaIndex
from pd_proxy.routing.cache.loop_share import LoopShare
from pd_proxy.routing.cache.metrics import CacheMetrics
from pd_proxy.routing.cache.pending import PendingIndex
from pd_proxy.routing.cache.publishers import parse_sources
from pd_proxy.routing.cache.subscriber import Subscription

log = logging.getLogger("pd_proxy.cache")

WATCH_INTERVAL_S = 1.0  # pools, health and gauges are looked at this often
SOURCES_RETRY_S = 30.0  # a replica that answered no event source is asked again after this
REPLAY_TIMEOUT_S = 2.0  # a gap's replay must come back within this, else the entries go


class CacheFollower:
    """The proxy's knowledge of each replica's cache; ``run`` keeps it current."""

    def __init__(
        self,
        pools: tuple[BackendPool, ...],
        *,
        events_on: bool,
        approx_on: bool,
        approx_blocks: int,
        backend_key: BackendKey | None,
        health_timeout: float,
        metrics: CacheMetrics,
        index_capacity: int | None = None,
        ready_timeout: float = 0.0,
    ) -> None:
        self.pools = pools
        self.events_on = events_on
        self.approx_on = approx_on
        self.backend_key = backend_key
        self.health_timeout = health_timeout
        self.metrics = metrics
        self.indexes: dict[str, list[ReplicaIndex]] = {}
        self.subs: dict[str, list[Subscription]] = {}
        self.no_events: dict[str, float] = {}  # url -> monotonic time to ask again
        self.was_down: set[str] = set()
        self.approx = ApproxIndex(approx_blocks)
        self.pending = PendingIndex()
        self.share = LoopShare()  # the event loop's slice all subscriptions draw on
        self.ctx: zmq.asyncio.Context | None = None
        self.index_capacity = index_capacity
        self.holders: dict[str, BlockHolders] = {}  # role -> its event index
        self._evicted: dict[str, int] = {}  # role -> evictions exported
        self.ready_timeout = ready_timeout
        self.ready = not events_on or ready_timeout <= 0
        self._started: float | None = None  # monotonic time ``run`` began
        metrics.ready.set(1 if self.ready else 0)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Watch until cancelled; a failing round is logged, never fatal."""
        self._started = time.monotonic()
        try:
            while True:
                try:
                    await self.watch(session)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("cache-aware routing: watch round failed")
                await asyncio.sleep(WATCH_INTERVAL_S)
        finally:
            await self.close()

    async def watch(self, session: aiohttp.ClientSession) -> None:
        listed: set[str] = set()
        for pool in self.pools:
            for b in pool.backends:
                listed.add(b.url)
                await self._follow(session, b)
        for url in (
            set(self.indexes)
            | set(self.approx.replicas)
            | set(self.pending.replicas)
            | set(self.no_events)
        ):
            if url not in listed:
                log.info("cache-aware routing: %s left; its entries go", url)
                await self.forget(url)
                self.no_events.pop(url, None)
                self.was_down.discard(url)
                self.metrics.forget(url)
        for url, indexes in self.indexes.items():
            self.metrics.blocks.labels(url, "events").set(min(len(i) for i in indexes))
        for url in self.approx.replicas:
            self.metrics.blocks.labels(url, "approx").set(self.approx.size(url))
        for role, holders in self.holders.items():
            evicted = holders.evicted - self._evicted.get(role, 0)
            self._evicted[role] = holders.evicted
            self.metrics.index_size(role, holders.pairs, evicted)
        self.not_ready()

    def not_ready(self) -> str | None:
        """Why the proxy does not know the caches yet (``/health`` says not ready), or None."""
        if self.ready:
            return None
        waiting = self.waiting()
        if not waiting:
            self.ready = True
            self.metrics.ready.set(1)
            log.info("cache-aware routing: every KV-event publisher replayed or heard; ready")
            return None
        if self._started is not None and time.monotonic() - self._started >= self.ready_timeout:
            self.ready = True
            self.metrics.ready_timeouts.inc()
            log.warning(
                "cache-aware routing: no replay or batch from %s within %gs "
                "(--cache-ready-timeout); serving without knowing their caches",
                ", ".join(waiting),
                self.ready_timeout,
            )
            return None
        return "the cache index is not ready: waiting for KV events from " + ", ".join(waiting)

    def waiting(self) -> list[str]:
        """The healthy replicas whose publishers were not looked up, replayed or heard yet."""
        if self._started is None:
            return ["every replica (not started)"]
        out = []
        for pool in self.pools:
            for b in pool.backends:
                if not b.healthy or b.url in self.no_events:
                    continue
                subs = self.subs.get(b.url)
                if subs is None or not all(sub.caught_up for sub in subs):
                    out.append(b.url)
        return out

    async def _follow(self, session: aiohttp.ClientSession, b: Backend) -> None:
        url = b.url
        if not b.healthy:
            if url not in self.was_down:
                # It may come back restarted, with an empty cache: forget what it held.
                self.was_down.add(url)
                await self.forget(url)
                self.no_events.pop(url, None)
            return
        self.was_down.discard(url)
        if not self.events_on or url in self.subs:
            return
        if time.monotonic() < self.no_events.get(url, 0.0):
            return
        await self.subscribe(session, b)

    async def subscribe(self, session: aiohttp.ClientSession, b: Backend) -> None:
        """Look up ``b``'s event publishers and subscribe to each."""
        headers = {} if self.backend_key is None else {"Authorization": self.backend_key.header()}
        try:
            async with session.get(
                b.endpoint("/kv_event_sources"),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.health_timeout),
            ) as resp:
                answer = await resp.json(content_type=None) if resp.status == 200 else None
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.info("cache-aware routing: %s/kv_event_sources: %s", b.url, exc)
            return  # asked again next round
        host = b.base.raw_host or ""
        publishers, problems = parse_sources(answer, host) if answer is not None else ([], [])
        for problem in problems:
            log.warning("cache-aware routing: %s: %s", b.url, problem)
        if not publishers:
            self.no_events[b.url] = time.monotonic() + SOURCES_RETRY_S
            fallback = "the approximate index" if self.approx_on else "load alone"
            log.warning(
                "cache-aware routing: %s publishes no KV events (GET /kv_event_sources: %s); "
                "routing there by %s",
                b.url,
                status if answer is None else "none enabled",
                fallback,
            )
            return
        if self.ctx is None:
            self.ctx = zmq.asyncio.Context()
        holders = self.holders.get(b.role)
        if holders is None:
            holders = self.holders[b.role] = BlockHolders(self.index_capacity)
        # Blocks its events announce need no pending entry there any more.
        confirm = functools.partial(self.pending.confirm, b.url)
        indexes = [ReplicaIndex(holders, on_stored=confirm) for _ in publishers]
        subs = [
            Subscription(
                b.url,
                p,
                idx,
                self.ctx,
                replay_timeout=REPLAY_TIMEOUT_S,
                on_batch=self._on_batch,
                share=self.share,
            )  # fmt: skip
            for p, idx in zip(publishers, indexes, strict=True)
        ]
        self.approx.forget(b.url)
        self.indexes[b.url] = indexes
        self.subs[b.url] = subs
        for sub in subs:
            sub.start()
        log.info(
            "cache-aware routing: %s: following KV events at %s",
            b.url,
            ", ".join(p.endpoint for p in publishers),
        )

    def _on_batch(self, url: str, batch: Batch, verdict: str) -> None:
        if verdict != NEXT or any(isinstance(ev, Cleared) for ev in batch.events):
            # A restart or a reset emptied the replica, or a gap hid what it stored and
            # evicted: what was sent there is no longer a safe guess.
            self.pending.forget(url)
        indexes = self.indexes.get(url)
        if not indexes:
            return
        total = Health.total(i.health for i in indexes)  # one series per API server
        lag = max(0.0, time.time() - batch.ts)
        self.metrics.health(url, total, lag, min(len(i) for i in indexes))

    async def forget(self, url: str) -> None:
        """Drop what is known of ``url``'s cache (it left, or went down)."""
        for sub in self.subs.pop(url, []):
            await sub.close()
        for index in self.indexes.pop(url, []):
            index.close()
        self.approx.forget(url)
        self.pending.forget(url)

    async def close(self) -> None:
        for url in list(self.subs):
            await self.forget(url)
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
