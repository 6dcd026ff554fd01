"""The glue of cache-aware routing: token ids for a request, the replica of each role it goes to,
and the cache hit predicted there; plus the watch loop that keeps the indexes in step with the
pools (replicas joining, leaving, going down) and checks the local tokenizer.

``ByShapeMode`` asks ``plan`` once per P/D-eligible request and puts the chosen backends on the
request's ``Trace``, so the decode that was scored is the decode the request goes to. Without
token ids, or with nothing cached anywhere, the choice is the pool's own (least outstanding,
round-robin ties): the routing the proxy always had.

Event discovery: each replica's ``GET /kv_event_sources`` (vLLM 0.32's API server), looked up when
the replica is first seen healthy and again after it was down; a replica that answers none
(events off, an older vLLM) uses the approximate index when the mode allows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import zmq.asyncio

from pd_proxy import local_prefill
from pd_proxy.auth import BackendKey
from pd_proxy.block_size import BlockSizes
from pd_proxy.cache import decider, scorer
from pd_proxy.cache.approx import ApproxIndex
from pd_proxy.cache.events import Batch, Cleared
from pd_proxy.cache.index import NEXT, Health, ReplicaIndex
from pd_proxy.cache.keys import Key, chain, hit_tokens
from pd_proxy.cache.metrics import NO_CHOICE, CacheMetrics
from pd_proxy.cache.pending import PendingIndex
from pd_proxy.cache.publishers import parse_sources
from pd_proxy.cache.subscriber import Subscription
from pd_proxy.cache.tokens import CANARY, SHAPES, LocalTokenizer
from pd_proxy.errors import ProxyError
from pd_proxy.legs import Legs, Trace
from pd_proxy.pool import Backend, BackendPool
from pd_proxy.rewrite import COMPLETIONS, dumps, loads
from pd_proxy.upstream import Fields, Reply

log = logging.getLogger("pd_proxy.cache")

OFF, EVENTS, APPROX, AUTO = "off", "events", "approx", "auto"
ROUTING_MODES = (OFF, EVENTS, APPROX, AUTO)
WATCH_INTERVAL_S = 1.0  # pools, health and gauges are looked at this often
SOURCES_RETRY_S = 30.0  # a replica that answered no event source is asked again after this
REPLAY_TIMEOUT_S = 2.0  # a gap's replay must come back within this, else the entries go
DEFAULT_BLOCK_SIZE = 16  # the prompt's block count when no replica has told its block size


@dataclass
class Plan:
    """Where one request goes. ``ids`` None: its tokens are unknown (P/D, pool's choices)."""

    ids: list[int] | None
    no_choice: bool = False  # nothing to decide: the prompt was not tokenized
    decode: Backend | None = None
    prefill: Backend | None = None
    decode_hit: int = 0  # prompt tokens predicted to be in the decode's cache
    prefill_hit: int = 0
    keys: dict[int, list[Key]] = field(default_factory=dict)  # block size -> chain


def direct_ids(body: Mapping[str, Any], endpoint: str) -> list[int] | None:
    """The prompt's ids when the request gives them (completions with token ids)."""
    prompt = body.get("prompt")
    if endpoint != COMPLETIONS or not isinstance(prompt, list) or not prompt:
        return None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return list(prompt)
    return None


def ids_from_answer(data: bytes) -> list[int]:
    """The ``tokens`` of a ``/tokenize`` answer; ``ValueError`` when it has none."""
    obj = loads(data)
    tokens = obj.get("tokens") if isinstance(obj, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError("/tokenize answer without token ids")
    return tokens


class CacheRouter:
    def __init__(
        self,
        legs: Legs,
        mode: str,
        tokenizer: LocalTokenizer | None,
        backend_key: BackendKey | None,
        tokenizer_later: Callable[[], LocalTokenizer | None] | None = None,
    ) -> None:
        config = legs.config
        self.legs = legs
        self.mode = mode
        self.routes = mode != OFF
        self.events_on = mode in (EVENTS, AUTO)
        self.approx_on = mode in (APPROX, AUTO)
        self.tokenizer = tokenizer
        # A tokenizer whose files are not there yet (a model id vLLM is still downloading):
        # tried each round until it loads, then checked like one given at start.
        self.tokenizer_later = tokenizer_later
        self.trusted: set[str] = set()
        self.validated = tokenizer is None
        self.backend_key = backend_key
        self.weight = config.cache_overlap_weight
        self.max_imbalance = config.cache_max_imbalance
        self.tokenize_timeout = config.tokenize_timeout
        self.local_max = config.local_prefill_max_tokens
        self.pools = (legs.prefill_pool, legs.decode_pool)
        self.indexes: dict[str, list[ReplicaIndex]] = {}
        self.subs: dict[str, list[Subscription]] = {}
        self.no_events: dict[str, float] = {}  # url -> monotonic time to ask again
        self.was_down: set[str] = set()
        self.approx = ApproxIndex(config.cache_approx_blocks)
        self.pending = PendingIndex()
        self.block_sizes = BlockSizes(legs.upstream, backend_key, config.health_timeout)
        self.metrics = CacheMetrics(legs.metrics.registry)
        self.ctx: zmq.asyncio.Context | None = None
        if tokenizer is not None:
            for shape in SHAPES:
                self.metrics.trusted.labels(shape).set(0)

    # --- the request path ----------------------------------------------------------------

    async def plan(
        self, endpoint: str, body: Mapping[str, Any], headers: Fields, trace: Trace
    ) -> Plan:
        if self.local_max <= 0 and not self.has_choice():
            return Plan(None, no_choice=True)
        ids = await self.token_ids(endpoint, body, headers, trace)
        plan = Plan(ids)
        if ids is None:
            return plan
        plan.decode, plan.decode_hit = self.choose(self.legs.decode_pool, ids, plan)
        return plan

    def has_choice(self) -> bool:
        """Whether a pool has two healthy replicas to choose between. Without one, and with no
        ``--local-prefill-max-tokens``, every request goes P/D to the only replicas: the token
        ids would change nothing, so the hot path pays for no tokenizer."""
        return any(sum(b.healthy for b in pool.backends) > 1 for pool in self.pools)

    def decide(self, plan: Plan, local_max: int) -> tuple[str, str]:
        """The path for ``plan`` under ``--local-prefill-max-tokens`` (for P/D, the prefill is
        chosen now), counted in the metrics; the approximate index learns what the chosen
        replicas will hold."""
        prompt = None if plan.ids is None else len(plan.ids)
        if plan.no_choice:
            path, reason = decider.PD, NO_CHOICE
        else:
            path, reason = decider.decide(prompt, plan.decode_hit, local_max)
        if path == decider.PD and plan.ids is not None:
            plan.prefill, plan.prefill_hit = self.choose(self.legs.prefill_pool, plan.ids, plan)
        self.metrics.decisions.labels(path, reason).inc()
        if plan.ids is not None and self.routes:
            roles = [("decode", plan.decode, plan.decode_hit)]
            if path == decider.PD:
                roles.append(("prefill", plan.prefill, plan.prefill_hit))
            for role, backend, hit in roles:
                self.metrics.prompt_tokens.labels(role).inc(len(plan.ids))
                self.metrics.predicted.labels(role).inc(hit)
                if backend is not None:
                    self._routed(backend, plan)
        return path, reason

    async def token_ids(
        self, endpoint: str, body: Mapping[str, Any], headers: Fields, trace: Trace
    ) -> list[int] | None:
        m = self.metrics
        ids = direct_ids(body, endpoint)
        if ids is not None:
            m.tokenizer.labels("ids").inc()
            return ids
        tok = self.tokenizer
        if tok is not None and tok.shape_of(body, endpoint) in self.trusted:
            start = time.perf_counter()
            ids = tok.ids(body, endpoint)
            if ids is not None:
                m.tokenizer_seconds.labels("local").observe(time.perf_counter() - start)
                m.tokenizer.labels("local").inc()
                return ids
        start = time.perf_counter()
        ids = await self.server_ids(endpoint, body, headers, trace)
        if ids is None:
            m.tokenizer.labels("none").inc()
            return None
        m.tokenizer_seconds.labels("server").observe(time.perf_counter() - start)
        m.tokenizer.labels("server").inc()
        return ids

    async def server_ids(
        self, endpoint: str, body: Mapping[str, Any], headers: Fields, trace: Trace
    ) -> list[int] | None:
        """A decode's ``/tokenize`` ids, bounded by ``--tokenize-timeout``; None on any failure."""
        request = local_prefill.tokenize_body(body, endpoint)
        if request is None:
            return None

        async def read(backend: Backend, resp: Reply) -> tuple[int, bytes]:
            return resp.status, await resp.read()

        # The least busy decode, without moving the pool's round-robin: otherwise the count and
        # the request would alternate in step and every request land on the same decode.
        healthy = [b for b in self.legs.decode_pool.backends if b.healthy]
        if healthy:
            trace.want = {"decode": min(healthy, key=lambda b: b.outstanding)}
        try:
            status, data = await self.legs.exchange(
                self.legs.decode_pool,
                "/tokenize",
                dumps(request),
                headers,
                self.tokenize_timeout,
                None,
                trace,
                read,
            )
            return ids_from_answer(data) if status == 200 else None
        except ProxyError as exc:
            log.warning("rid=%s tokenizing the prompt failed: %s", trace.rid, exc.message)
        except (ValueError, UnicodeDecodeError):
            log.warning("rid=%s /tokenize answered without token ids", trace.rid)
        finally:
            trace.want = None
        return None

    def choose(
        self, pool: BackendPool, ids: Sequence[int], plan: Plan
    ) -> tuple[Backend | None, int]:
        """The backend of ``pool`` for ``ids`` and its predicted hit tokens (what its events or
        the approximate index say it holds: not what is only pending there)."""
        if not self.routes:
            return None, 0
        backends = [b for b in pool.backends if b.healthy]
        if not backends:
            return None, 0
        sizes = {b.url: self._block_size(b) for b in backends}
        size = next((s for s in sizes.values() if s), DEFAULT_BLOCK_SIZE)
        now = time.monotonic()
        held = {b.url: self._cached_blocks(b, plan, sizes[b.url], now) for b in backends}
        candidates = [
            scorer.Candidate(b.url, held[b.url][1], b.outstanding, self._fill(b, now))
            for b in backends
        ]
        choice = scorer.choose(candidates, len(ids) // size, self.weight, self.max_imbalance)
        if choice is None:
            backend = pool.pick()
            if backend is not None:
                self.metrics.choices.labels(pool.role, scorer.LOAD).inc()
            return backend, 0
        self.metrics.choices.labels(pool.role, choice.reason).inc()
        backend = next(b for b in backends if b.url == choice.name)
        bs = sizes[backend.url] or size
        return backend, hit_tokens(held[backend.url][0], bs, len(ids))

    def _routed(self, backend: Backend, plan: Plan) -> None:
        """``backend`` will hold ``plan``'s blocks: the approximate index learns them (no
        events there), or they count as pending until its events announce them."""
        if backend.url in self.indexes:
            size = self._block_size(backend)
            if size is not None:
                self.pending.record(backend.url, self._keys(plan, size), time.monotonic())
        elif self.approx_on:
            size = self.block_sizes.known(backend)
            if size is not None:
                self.approx.record(backend.url, self._keys(plan, size))

    def _fill(self, backend: Backend, now: float) -> int:
        """The blocks ``backend`` holds in all (pending ones included), as far as known."""
        indexes = self.indexes.get(backend.url)
        if indexes is not None:
            return min(len(i) for i in indexes) + self.pending.size(backend.url, now)
        return self.approx.size(backend.url) if self.approx_on else 0

    def _keys(self, plan: Plan, size: int) -> list[Key]:
        keys = plan.keys.get(size)
        if keys is None:
            assert plan.ids is not None
            keys = plan.keys[size] = chain(plan.ids, size)
        return keys

    def _block_size(self, backend: Backend) -> int | None:
        indexes = self.indexes.get(backend.url)
        if indexes is not None:
            told = next((i.block_size for i in indexes if i.block_size), None)
            if told is not None:
                return told
            # No block stored since the proxy subscribed: its /metrics tell the size, so the
            # first requests of a new prefix can already count as pending there.
        if indexes is not None or self.approx_on:
            size = self.block_sizes.known(backend)
            if size is None:
                self.block_sizes.prefetch([backend])
            return size
        return None

    def _cached_blocks(
        self, backend: Backend, plan: Plan, size: int | None, now: float
    ) -> tuple[int, int]:
        """Leading blocks of the prompt ``backend`` holds: (confirmed, for routing), where
        routing also counts what the proxy sent there and its events have not announced yet."""
        if size is None:
            return 0, 0
        keys = self._keys(plan, size)
        indexes = self.indexes.get(backend.url)
        if indexes is not None:
            # Several engines behind one API server (DP): it picks one, so count the least.
            known = min(i.match(keys) for i in indexes)
            if known:
                self.pending.confirm(backend.url, keys[:known])
            return known, max(known, self.pending.match(backend.url, keys, now))
        if self.approx_on:
            n = self.approx.match(backend.url, keys)
            return n, n
        return 0, 0

    # --- the watch loop --------------------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Watch until cancelled; a failing round is logged, never fatal."""
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
        if self.tokenizer_later is not None and self.tokenizer is None:
            self.tokenizer = self.tokenizer_later()
            if self.tokenizer is not None:
                log.info("local tokenizer: its files arrived; checking it against /tokenize")
                self.tokenizer_later, self.validated = None, False
                for shape in SHAPES:
                    self.metrics.trusted.labels(shape).set(0)
        if not self.validated:
            await self.validate(session)
        if not self.routes:
            return
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
                timeout=aiohttp.ClientTimeout(total=self.legs.config.health_timeout),
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
        indexes = [ReplicaIndex() for _ in publishers]
        subs = [
            Subscription(b.url, p, idx, self.ctx, REPLAY_TIMEOUT_S, self._on_batch)
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
        self.indexes.pop(url, None)
        self.approx.forget(url)
        self.pending.forget(url)

    async def close(self) -> None:
        for url in list(self.subs):
            await self.forget(url)
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    # --- the tokenizer check ---------------------------------------------------------------

    async def validate(self, session: aiohttp.ClientSession) -> None:
        """Compare the local tokenizer with a healthy decode's ``/tokenize`` on the canary set;
        trust each shape whose every canary matched. Retried each round until a decode answers."""
        tok = self.tokenizer
        backend = self.legs.decode_pool.pick()
        if tok is None or backend is None:
            return
        headers = {} if self.backend_key is None else {"Authorization": self.backend_key.header()}
        failed: dict[str, str] = {}
        for shape, endpoint, body in CANARY:
            request = local_prefill.tokenize_body(body, endpoint)
            try:
                async with session.post(
                    backend.endpoint("/tokenize"),
                    data=dumps(request),
                    headers={**headers, "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=self.legs.config.health_timeout * 2),
                ) as resp:
                    if resp.status != 200:
                        if shape not in failed:
                            failed[shape] = f"/tokenize answered {resp.status}"
                        continue
                    server = ids_from_answer(await resp.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                log.info("tokenizer check: %s/tokenize: %s (retrying)", backend.url, exc)
                return
            local = tok.ids(body, endpoint)
            if local != server and shape not in failed:
                failed[shape] = f"{body!r}: local {local} != server {server}"
        self.validated = True
        self.trusted = {s for s in SHAPES if s not in failed}
        for shape in SHAPES:
            self.metrics.trusted.labels(shape).set(1 if shape in self.trusted else 0)
            if shape in failed:
                log.warning(
                    "local tokenizer: %s requests go to /tokenize, the canary differed: %s",
                    shape,
                    failed[shape][:300],
                )
            else:
                log.info("local tokenizer: %s requests tokenized in the proxy", shape)
