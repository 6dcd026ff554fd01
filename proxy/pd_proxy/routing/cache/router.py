"""Cache-aware routing on the request path: for a prompt's token ids, the decode (and, for P/D,
the prefill) each role's scorer picks, the cache hit predicted there, and the path under
``--local-prefill-max-tokens`` (pd_proxy.routing.decider), as one ``Route``.

What the replicas hold comes from pd_proxy.routing.cache.follow: one index per role, whose walk of
a prompt's chain counts every replica's cached blocks at once. Without token ids, or with nothing
known anywhere, the choice is by load alone (pd_proxy.scheduler); a prefix cached nowhere goes
where its first block hashes (pd_proxy.routing.cache.scorer). A prompt's
blocks are keyed with the request's extra keys (pd_proxy.routing.cache.extra): a salted request
is predicted only from blocks stored under its own salt, in the events index, the pending
entries and the approximate index alike; one that cannot be keyed is never predicted a hit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from pd_proxy import scheduler
from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.backends.route import PD, Route
from pd_proxy.routing import decider
from pd_proxy.routing.block_size import BlockSizes
from pd_proxy.routing.cache import pending, scorer
from pd_proxy.routing.cache.extra import PLAIN, RequestKeys
from pd_proxy.routing.cache.follow import CacheFollower
from pd_proxy.routing.cache.holders import BlockHolders
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.keys import Key, chain, hit_tokens, placement_key
from pd_proxy.routing.cache.metrics import CacheMetrics

DEFAULT_BLOCK_SIZE = 16  # the prompt's block count when no replica has told its block size


class _Keys:
    """A prompt's block-key chains with its extra keys, computed once per block size, and each
    role index's walk of them (one pass for all of its replicas)."""

    __slots__ = ("ids", "extra", "keys", "walks", "_last")

    def __init__(self, ids: Sequence[int], extra: RequestKeys) -> None:
        self.ids = ids
        self.extra = extra
        self.keys: dict[int, list[Key]] = {}
        # (role index, chain) by identity -> that index's walk of that chain; the entry keeps
        # the index alive and the plan its chains, so neither identity is reused meanwhile.
        self.walks: dict[tuple[int, int], tuple[BlockHolders, list[int]]] = {}
        self._last: tuple[BlockHolders, list[Key], list[int]] | None = None

    def walk(self, holders: BlockHolders, keys: list[Key]) -> list[int]:
        """``holders``' walk of ``keys`` (one of these chains), walked once: every replica of a
        role reads the same walk, so the last one is kept at hand."""
        last = self._last
        if last is not None and last[0] is holders and last[1] is keys:
            return last[2]
        found = self.walks.get((id(holders), id(keys)))
        if found is None:
            found = self.walks[id(holders), id(keys)] = (holders, holders.walk(keys))
        self._last = (holders, keys, found[1])
        return found[1]


class CacheRouter:
    def __init__(
        self,
        prefill: BackendPool,
        decode: BackendPool,
        known: CacheFollower,
        *,
        block_sizes: BlockSizes,
        metrics: CacheMetrics,
        weight: float,
        max_imbalance: int,
    ) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.known = known
        self.block_sizes = block_sizes
        self.metrics = metrics
        self.weight = weight
        self.max_imbalance = max_imbalance
        # Each role's series, looked up once: ``labels()`` took 2 us a call, 6 calls a request.
        roles = (prefill.role, decode.role)
        self._tokens = {r: metrics.prompt_tokens.labels(r) for r in roles}
        self._predicted = {r: metrics.predicted.labels(r) for r in roles}
        reasons = scorer.REASONS
        self._choices = {(r, w): metrics.choices.labels(r, w) for r in roles for w in reasons}

    def has_choice(self) -> bool:
        """Whether a pool has two healthy replicas to choose between. Without one, and with no
        ``--local-prefill-max-tokens``, every request goes P/D to the only replicas: the token
        ids would change nothing, so the hot path pays for no tokenizer."""
        pools = (self.prefill_pool, self.decode_pool)
        return any(sum(b.healthy for b in pool.backends) > 1 for pool in pools)

    def route(self, ids: Sequence[int] | None, local_max: int, extra: RequestKeys = PLAIN) -> Route:
        """The route for a prompt of ``ids`` (None: unknown) with ``extra`` keys (its
        ``cache_salt``, its model): the decode first, the path on the tokens it does not hold,
        then (P/D) the prefill; the chosen replicas' records learn what they will hold. The legs
        read the tokens they compute from the route (``Route.uncached_tokens``)."""
        if ids is None:
            path, reason = decider.decide(None, 0, local_max)
            return Route(path, reason)
        plan = _Keys(ids, extra)
        decode, decode_hit = self.choose(self.decode_pool, ids, plan)
        path, reason = decider.decide(len(ids), decode_hit, local_max)
        prefill, prefill_hit = None, 0
        roles = [("decode", decode, decode_hit)]
        if path == PD:
            prefill, prefill_hit = self.choose(self.prefill_pool, ids, plan)
            roles.append(("prefill", prefill, prefill_hit))
        for role, backend, hit in roles:
            self._tokens[role].inc(len(ids))
            self._predicted[role].inc(hit)
            if backend is not None and extra.keyable:
                self._routed(backend, plan)
        return Route(path, reason, decode, prefill, len(ids), decode_hit, prefill_hit)

    def choose(
        self, pool: BackendPool, ids: Sequence[int], plan: _Keys
    ) -> tuple[Backend | None, int]:
        """The backend of ``pool`` for ``ids`` (pd_proxy.scheduler, scored by this prompt's
        estimated time there) and its predicted hit tokens (what its events or the approximate
        index say it holds: not what is only pending there)."""
        score = _PromptScore(self, ids, plan)
        backend = scheduler.pick(pool, scored=score.best(scheduler.healthy(pool)))
        if backend is None:
            return None, 0
        if score.choice is None:
            self._choices[pool.role, scorer.LOAD].inc()
            return backend, 0
        self._choices[pool.role, score.choice.reason].inc()
        i = score.backends.index(backend)  # the scorer's rows are in the order of its backends
        return backend, hit_tokens(score.confirmed[i], score.sizes[i] or score.size, len(ids))

    def _routed(self, backend: Backend, plan: _Keys) -> None:
        """``backend`` will hold ``plan``'s blocks: the approximate index learns them (no
        events there), or they count as pending until its events announce them."""
        indexes = self.known.indexes.get(backend.url)
        if indexes is not None:
            size = self._block_size(backend)
            if size is not None:
                # Only what its events have not announced: a held block is no pending entry.
                keys = self._keys(plan, size)
                known = min(_held(i, plan, keys) for i in indexes)
                self.known.pending.record(backend.url, keys[known:], time.monotonic())
        elif self.known.approx_on:
            size = self.block_sizes.known(backend)
            if size is not None:
                self.known.approx.record(backend.url, self._keys(plan, size))

    def _keys(self, plan: _Keys, size: int) -> list[Key]:
        keys = plan.keys.get(size)
        if keys is None:
            extras = plan.extra.extras(len(plan.ids) // size, self._is_adapter)
            keys = plan.keys[size] = chain(plan.ids, size, extras=extras)
        return keys

    def _is_adapter(self, model: str) -> bool:
        """Whether a replica's events named ``model`` as the LoRA adapter of stored blocks (of a
        replica of either role, now or before: its role index keeps every name it was told)."""
        return any(model in h.adapters for h in self.known.holders.values())

    def _block_size(self, backend: Backend) -> int | None:
        indexes = self.known.indexes.get(backend.url)
        if indexes is not None:
            told = indexes[0].block_size  # one engine behind the server: the common case
            if told is None and len(indexes) > 1:
                told = next((i.block_size for i in indexes if i.block_size), None)
            if told is not None:
                return told
            # No block stored since the proxy subscribed: its /metrics tell the size, so the
            # first requests of a new prefix can already count as pending there.
        if indexes is not None or self.known.approx_on:
            size = self.block_sizes.known(backend)
            if size is None:
                self.block_sizes.prefetch([backend])
            return size
        return None

    def _counts(
        self,
        backend: Backend,
        plan: _Keys,
        keys: list[Key] | None,
        entries: Mapping[Key, float],
    ) -> tuple[int, int, int]:
        """What ``backend`` holds, as far as known: the leading blocks of the prompt's ``keys``
        (None: not keyable; confirmed, for the path, and for routing with its pending
        ``entries``: what the proxy sent there that its events have not announced yet) and its
        blocks in all (pending ones included). ``_PromptScore.best`` inlines the common case
        (one engine, keys known) and calls this for the rest: several engines, no keys, approx."""
        known = self.known
        url = backend.url
        indexes = known.indexes.get(url)
        if indexes is not None:
            if len(indexes) == 1:
                fill = len(indexes[0].by_hash)
                held = 0 if keys is None else _held(indexes[0], plan, keys)
            else:
                # Several engines behind one API server (DP): it picks one, so count the least.
                fill = min(len(i) for i in indexes)
                held = 0 if keys is None else min(_held(i, plan, keys) for i in indexes)
            if keys is None:
                return 0, 0, fill + len(entries)
            return held, pending.run(entries, keys, held), fill + len(entries)
        if known.approx_on:
            n = 0 if keys is None else known.approx.match(url, keys)
            return n, n, known.approx.size(url)
        return 0, 0, 0


def _held(index: ReplicaIndex, plan: _Keys, keys: list[Key]) -> int:
    """Leading blocks of ``keys`` (one of ``plan``'s chains) ``index`` holds, from its role
    index's one walk of them."""
    walk = plan.walk(index.holders, keys)
    return walk[index.slot] if index.slot < len(walk) else 0


class _PromptScore:
    """The scheduler's score for one prompt: the cache scorer's choice among the healthy
    replicas (None: nothing tells them apart, the scheduler goes by load), kept for the hit:
    each backend's block size and confirmed blocks, in the order of ``backends``."""

    __slots__ = ("router", "ids", "plan", "choice", "backends", "sizes", "size", "confirmed")

    def __init__(self, router: CacheRouter, ids: Sequence[int], plan: _Keys) -> None:
        self.router = router
        self.ids = ids
        self.plan = plan
        self.choice: scorer.Choice | None = None
        self.backends: Sequence[Backend] = ()
        self.sizes: list[int | None] = []
        self.size = DEFAULT_BLOCK_SIZE
        self.confirmed: list[int] = []

    def best(self, backends: Sequence[Backend]) -> Backend | None:
        if not backends:
            return None
        router, ids, plan = self.router, self.ids, self.plan
        self.backends = backends
        total = len(ids)
        # The block size of a replica that has not told one: the first that has (usually the
        # first replica's; sizes differ only in a mixed fleet).
        size = self.size = next(
            (s for s in map(router._block_size, backends) if s), DEFAULT_BLOCK_SIZE
        )
        cap = hit_tokens(total, size, total)  # the most a replica of ``size`` can hit
        sizes, confirmed_of = self.sizes, self.confirmed
        keyable = plan.extra.keyable
        live = router.known.pending.swept(time.monotonic())
        indexes_of = router.known.indexes
        candidates = []
        new = tuple.__new__  # a Candidate without its Python-level __new__: 64 per request
        keys: list[Key] | None = None
        keys_size = walk_keys = walk_holders = None
        walk: list[int] = []
        # One pass, one index read per replica and few calls (64 replicas per request at 32):
        # the common case (one engine, a known block size) inline, the rest by ``_counts``.
        for b in backends:
            url = b.url
            indexes = indexes_of.get(url)
            index = indexes[0] if indexes is not None and len(indexes) == 1 else None
            bs = index.block_size if index is not None else None
            if bs is None:
                bs = router._block_size(b)
            sizes.append(bs)
            if bs is None or not keyable:
                keys = None
            elif bs != keys_size:
                keys, keys_size = router._keys(plan, bs), bs
            entries = live.get(url)
            if keys is not None and index is not None:
                holders = index.holders
                if holders is not walk_holders or keys is not walk_keys:
                    walk, walk_holders, walk_keys = plan.walk(holders, keys), holders, keys
                confirmed = walk[index.slot] if index.slot < len(walk) else 0
                if entries:  # a run only where the block after the held ones is pending
                    routed = confirmed
                    if confirmed < len(keys) and keys[confirmed] in entries:
                        routed = pending.run(entries, keys, confirmed)
                    fill = len(index.by_hash) + len(entries)
                else:
                    routed, fill = confirmed, len(index.by_hash)
            else:
                confirmed, routed, fill = router._counts(b, plan, keys, entries or pending.NONE)
            confirmed_of.append(confirmed)
            if bs is None or bs == size:
                hit = routed * size
                if hit > cap:
                    hit = cap
            else:
                hit = hit_tokens(routed, bs, total)
            candidates.append(
                new(
                    scorer.Candidate,
                    (url, routed, b.outstanding, fill, total - hit, b.tokens_in_flight),
                )
            )
        first = None  # the prompt's first block: where a prefix cached nowhere goes (the
        # scorer reads it only then: a hash of the block per request and role otherwise)
        if keyable and total >= size and not any(c.cached_blocks for c in candidates):
            first = placement_key(ids[:size])
        self.choice = choice = scorer.choose(candidates, router.weight, router.max_imbalance, first)
        if choice is None:
            return None
        return next(b for b in backends if b.url == choice.name)
