"""Cache-aware routing through the real proxy on fake backends: the index (filled with
real-format vLLM events) decides the decode, the decode that was scored serves the request, the
limit counts uncached tokens, and a down replica, lost events or a stale index never route on
what is no longer there."""

from __future__ import annotations

import aiohttp
import pytest

from pd_proxy.protocol.endpoints import COMPLETIONS
from pd_proxy.routing.cache.events import decode as decode_frames
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.keys import placement_key
from pd_proxy.routing.cache.scorer import rank
from pd_proxy.testing.fake_model import tokenize
from tests.support.waits import until

from .vllm_events import frames, stored

pytestmark = pytest.mark.vllm  # the events are encoded by vLLM's own classes

BLOCK = 4


def text(words: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + words))


def hold(stack, decode_index: int, prompt: str, role: str = "decode") -> ReplicaIndex:
    """The replica's index now holds ``prompt``'s whole blocks, as its KV events would say."""
    ids = tokenize(prompt)
    n = len(ids) // BLOCK
    event = stored([f"h{i}".encode() for i in range(n)], None, ids[: n * BLOCK], BLOCK)
    index = ReplicaIndex()
    index.apply(decode_frames(frames(0, event)))
    replicas = stack.decodes if role == "decode" else stack.prefills
    stack.running.pipeline.planner.cache.known.indexes[replicas[decode_index].url] = [index]
    return index


def served(stack) -> list[int]:
    return [len(d.seen) for d in stack.decodes]


def decisions(stack, path: str, reason: str) -> float:
    labels = {"path": path, "reason": reason}
    return stack.sample("pd_proxy_path_decisions_total", labels) or 0.0


async def test_same_prefix_requests_land_where_the_prefix_is() -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(decodes=2, prefix_cache_routing="events") as s:
        shared = text(40)
        hold(s, 1, shared)
        for i in range(4):
            body = {"prompt": f"{shared} q{i}", "max_tokens": 2}
            status, _, raw = await s.post(COMPLETIONS, body)
            assert status == 200, raw
        assert served(s) == [0, 4]
        labels = {"role": "decode", "reason": "cache"}
        assert s.sample("pd_proxy_cache_choices_total", labels) == 4
        urls = [d.url for d in s.decodes]
        for i in range(2):  # cached nowhere: where its first block hashes, loads being equal
            prompt = text(40, start=100 + 50 * i)
            first = placement_key(tokenize(prompt)[:BLOCK])
            home = urls.index(max(urls, key=lambda url: rank(first, url)))
            before = served(s)
            await s.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 2})
            assert served(s)[home] == before[home] + 1 and sum(served(s)) == sum(before) + 1


async def test_follow_up_turn_goes_to_decode_alone_and_a_new_prompt_goes_pd() -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(prefix_cache_routing="events", local_prefill_max_tokens=8) as s:
        s.decode.knobs.plain_requests = True
        history = text(60)
        status, _, raw = await s.post(COMPLETIONS, {"prompt": history, "max_tokens": 2})
        assert status == 200 and len(s.prefill.seen) == 1  # long, nothing cached: P/D
        hold(s, 0, history)  # decode announced the history's blocks
        follow_up = {"prompt": f"{history} and three more", "max_tokens": 2}
        status, _, raw = await s.post(COMPLETIONS, follow_up)
        assert status == 200, raw
        assert len(s.prefill.seen) == 1  # decode alone: only the uncached tail to compute
        assert "kv_transfer_params" not in s.decode.seen[-1].body
        assert decisions(s, "local", "cached") == 1
        predicted = s.sample("pd_proxy_cache_predicted_hit_tokens_total", {"role": "decode"})
        assert predicted == len(tokenize(history)) // BLOCK * BLOCK
        await s.post(COMPLETIONS, {"prompt": text(60, start=500), "max_tokens": 2})
        assert len(s.prefill.seen) == 2 and decisions(s, "pd", "long") == 2


async def test_a_replica_seen_down_forgets_its_cache() -> None:
    """A stale index: the decode restarted (empty cache) between two health checks' view. Once
    the proxy sees it down, its entries go, so the follow-up is not sent alone on a stale claim."""
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(prefix_cache_routing="events", local_prefill_max_tokens=8) as s:
        s.decode.knobs.plain_requests = True
        history = text(60)
        hold(s, 0, history)
        router = s.running.pipeline.planner.cache.known
        backend = s.proxy.decode_pool.backends[0]
        async with aiohttp.ClientSession() as session:
            backend.healthy = False
            await router.watch(session)
            backend.healthy = True
            await router.watch(session)
        assert s.decode.url not in router.indexes
        status, _, raw = await s.post(COMPLETIONS, {"prompt": f"{history} more", "max_tokens": 2})
        assert status == 200, raw
        assert len(s.prefill.seen) == 1 and decisions(s, "pd", "long") == 1


async def test_lost_events_degrade_to_todays_routing() -> None:
    """A gap nothing could replay drops the replica's entries: the request goes P/D and by load,
    as without cache-aware routing."""
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(decodes=2, prefix_cache_routing="events", local_prefill_max_tokens=8) as s:
        history = text(60)
        index = hold(s, 1, history)
        index.drop(None)  # what the subscriber does when a gap's replay fails
        for _ in range(2):
            status, _, raw = await s.post(COMPLETIONS, {"prompt": history + " x", "max_tokens": 2})
            assert status == 200, raw
        assert served(s) == [1, 1] and len(s.prefill.seen) == 2
        assert s.sample("pd_proxy_cache_choices_total", {"role": "decode", "reason": "load"}) == 2


async def test_approximate_index_learns_from_the_proxys_own_routing() -> None:
    """Backends without KV events (the fakes answer 404 at /kv_event_sources): the proxy
    remembers where it sent each prompt and sends the same prefix there again."""

    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(decodes=2, prefix_cache_routing="auto") as s:
        router = s.running.pipeline.planner.cache
        shared = text(300)  # a few of the fakes' 128-token blocks
        await s.post(COMPLETIONS, {"prompt": text(300, start=1000), "max_tokens": 2})
        await until(  # the block sizes come from each decode's /metrics
            lambda: all(router.block_sizes.known(b) for b in s.proxy.decode_pool.backends),
            "the decodes' block sizes",
            timeout=30,
        )
        await s.post(COMPLETIONS, {"prompt": shared, "max_tokens": 2})
        first = served(s)
        target = 0 if first[0] > first[1] else 1
        for i in range(3):
            await s.post(COMPLETIONS, {"prompt": f"{shared} q{i}", "max_tokens": 2})
        after = served(s)
        assert after[target] - first[target] == 3 and after[1 - target] == first[1 - target]


async def test_the_prefill_holding_the_prefix_computes_the_rest() -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(prefills=2, prefix_cache_routing="events") as s:
        shared = text(40)
        hold(s, 1, shared, role="prefill")
        for i in range(3):
            status, _, raw = await s.post(
                COMPLETIONS, {"prompt": f"{shared} q{i}", "max_tokens": 2}
            )
            assert status == 200, raw
        assert [len(p.seen) for p in s.prefills] == [0, 3]
        labels = {"role": "prefill", "reason": "cache"}
        assert s.sample("pd_proxy_cache_choices_total", labels) == 3


def subscribed(stack) -> None:
    """Both decodes follow KV events (indexes known to hold nothing yet), as after subscribing."""
    router = stack.running.pipeline.planner.cache.known
    for d in stack.decodes:
        index = ReplicaIndex()
        index.block_size = BLOCK
        router.indexes[d.url] = [index]


async def test_a_new_prefix_arriving_together_follows_the_first_before_events_tell() -> None:
    """No event has announced the prefix yet (its prefill is still running): the requests sent
    with it go where the first went, as pending blocks there, and the path decision still counts
    only what events confirm (P/D, not decode alone)."""
    import asyncio

    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(decodes=2, prefix_cache_routing="events", local_prefill_max_tokens=8) as s:
        subscribed(s)
        shared = text(40)
        bodies = [{"prompt": f"{shared} q{i}", "max_tokens": 2} for i in range(4)]
        replies = await asyncio.gather(*(s.post(COMPLETIONS, b) for b in bodies))
        assert all(status == 200 for status, _, _ in replies)
        assert sorted(served(s)) == [0, 4]
        assert decisions(s, "pd", "long") == 4 and len(s.prefill.seen) == 4
        predicted = s.sample("pd_proxy_cache_predicted_hit_tokens_total", {"role": "decode"})
        assert predicted == 0


async def test_pending_blocks_lapse_and_a_restart_clears_them() -> None:
    """Events that never confirm what was sent (lost, or the request failed): after the TTL the
    prefix counts nowhere again; a replica whose event stream restarted holds nothing pending."""
    from pd_proxy.routing.cache.events import Batch, Cleared
    from pd_proxy.routing.cache.index import NEXT, RESET
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(decodes=2, prefix_cache_routing="events") as s:
        subscribed(s)
        router = s.running.pipeline.planner.cache.known
        router.pending.ttl_s = 0.0  # every entry lapses at once
        shared = text(40)
        for i in range(4):
            await s.post(COMPLETIONS, {"prompt": f"{shared} q{i}", "max_tokens": 2})
        assert served(s) == [2, 2]  # cached and pending nowhere: the pool's rotation
        router.pending.ttl_s = 60.0
        await s.post(COMPLETIONS, {"prompt": f"{shared} again", "max_tokens": 2})
        target = next(d.url for d in s.decodes if d.url in router.pending.replicas)
        router._on_batch(target, Batch(seq=0, ts=0.0, events=(), dp_rank=0), RESET)
        assert target not in router.pending.replicas
        # The same after the replica's cache was reset (AllBlocksCleared), in order.
        await s.post(COMPLETIONS, {"prompt": f"{shared} once more", "max_tokens": 2})
        target = next(d.url for d in s.decodes if d.url in router.pending.replicas)
        router._on_batch(target, Batch(seq=1, ts=0.0, events=(Cleared(),), dp_rank=0), NEXT)
        assert target not in router.pending.replicas
