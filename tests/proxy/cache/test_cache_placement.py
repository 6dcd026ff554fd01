"""The routing rules that make shared prefixes fit: requests just sent count as held where they
went (pending, until events confirm or a TTL), new prefixes go where their first block hashes
(bent only by load), and the imbalance guard keeps a holder its prefix up to max_imbalance
above the others; the cost is the estimated time to the first token, in prompt tokens. Pure: no
proxy, no clock (but the last test, through the proxy)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pd_proxy.config import ProxyConfig
from pd_proxy.routing.cache.keys import chain, placement_key
from pd_proxy.routing.cache.pending import SWEEP_EVERY_S, PendingIndex
from pd_proxy.routing.cache.scorer import CACHE, GUARD, LOAD, Candidate, Choice, choose, cost

BLOCK = 4


def keys(n: int, start: int = 0) -> list[int]:
    return chain(list(range(start, start + n * BLOCK)), BLOCK)


def test_pending_counts_what_was_sent_until_its_ttl() -> None:
    pending = PendingIndex(ttl_s=5.0, capacity=100)
    prefix = keys(6)
    pending.record("a", prefix, now=100.0)
    assert pending.match("a", prefix + keys(2, 900), now=101.0) == 6
    assert pending.match("b", prefix, now=101.0) == 0
    assert pending.match("a", prefix, now=105.0) == 0  # lapsed: events never confirmed it
    assert "a" not in pending.replicas  # and its memory went with it


def test_pending_is_bounded_confirmed_and_forgotten() -> None:
    pending = PendingIndex(ttl_s=5.0, capacity=4)
    first, second = keys(3), keys(3, 500)
    pending.record("a", first, now=0.0)
    pending.record("a", second, now=1.0)  # 6 keys into 4: the oldest two go
    assert pending.size("a", now=1.0) == 4
    assert pending.match("a", first, now=1.0) == 0 and pending.match("a", second, now=1.0) == 3
    pending.confirm("a", second[:2])  # the events announced them: no pending entry needed
    assert pending.size("a", now=1.0) == 2
    pending.forget("a")  # the replica went down or restarted
    assert pending.match("a", second, now=1.0) == 0 and pending.size("a", now=1.0) == 0


def test_pending_continues_what_the_events_announced() -> None:
    pending = PendingIndex(ttl_s=5.0, capacity=100)
    prompt = keys(8)
    pending.record("a", prompt[5:], now=0.0)  # sent there; its events had announced 5
    assert pending.match("a", prompt, now=1.0, start=5) == 8
    assert pending.match("a", prompt, now=1.0, start=3) == 3  # 3 and 4 are neither
    assert pending.match("a", prompt, now=1.0) == 0
    assert pending.match("a", prompt, now=6.0, start=5) == 5  # lapsed: the events' alone


def test_pending_lapses_are_swept_when_due_and_at_most_one_sweep_interval_late() -> None:
    """Reading every replica's entries per request, the sweep for lapsed ones runs when one is
    due and at most every SWEEP_EVERY_S: an entry may count up to that long past its TTL."""
    pending = PendingIndex(ttl_s=5.0, capacity=100)
    a, b, c = keys(1), keys(1, 300), keys(1, 600)
    pending.record("r", a, now=0.0)
    pending.record("r", b, now=4.8)
    assert pending.match("r", a, now=5.0) == 0 and pending.match("r", b, now=5.0) == 1
    pending.record("r", c, now=5.1)  # lapses at 10.1
    assert pending.match("r", b, now=9.9) == 0  # swept at 9.9: the next not before 10.4
    assert pending.match("r", c, now=10.2) == 1  # lapsed 0.1 s ago: within the slack
    assert pending.match("r", c, now=9.9 + SWEEP_EVERY_S) == 0
    assert "r" not in pending.replicas


def test_pending_refreshed_by_a_later_request_lives_on() -> None:
    pending = PendingIndex(ttl_s=5.0, capacity=100)
    prefix = keys(2)
    pending.record("a", prefix, now=0.0)
    pending.record("a", prefix, now=4.0)
    assert pending.match("a", prefix, now=6.0) == 2


FULL = 40  # blocks each decode holds: full caches of 40 blocks
DECODES = ("http://d0:8200", "http://d1:8200")


def full(loads: tuple[int, int] = (0, 0)) -> list[Candidate]:
    """Two decodes whose caches are full (equal fills) of other prompts."""
    return [Candidate(n, 0, out, FULL) for n, out in zip(DECODES, loads, strict=True)]


def first_keys(prefixes: int) -> list[int]:
    return [placement_key(range(1000 * p, 1000 * p + BLOCK)) for p in range(prefixes)]


def test_new_prefixes_spread_over_full_caches_each_to_one_home() -> None:
    """24 new prefixes at equal loads: each goes where its first block hashes, again and again,
    and no decode gets more than 60% of them (the fill-based rule sent them all to one)."""
    homes = []
    for first in first_keys(24):
        choice = choose(full(), weight=4, max_imbalance=4, first_key=first)
        assert choice is not None and choice.reason == LOAD and choice.cached_blocks == 0
        assert all(choose(full(), 4, 4, first) == choice for _ in range(5))
        homes.append(choice.name)
    assert max(homes.count(d) for d in DECODES) <= 0.6 * 24, homes


def test_a_burst_of_new_prefixes_is_bent_by_load_only() -> None:
    """The same 24 prefixes sent together (each still in flight when the next comes): a home
    more than one request above the least busy is passed over, so the burst splits evenly."""
    loads = [0, 0]
    for first in first_keys(24):
        choice = choose(full((loads[0], loads[1])), 4, 4, first)
        assert choice is not None
        loads[DECODES.index(choice.name)] += 1
    assert max(loads) <= 13
    home = choose(full(), 4, 4, first_keys(1)[0])
    assert home is not None
    busy = (2, 0) if home.name == DECODES[0] else (0, 2)
    bent = choose(full(busy), 4, 4, first_keys(1)[0])
    assert bent is not None and bent.name != home.name


def test_nothing_known_or_no_key_leaves_the_choice_to_load() -> None:
    empty = [Candidate(n, 0, 0, 0) for n in DECODES]  # events not heard yet, or lost
    assert choose(empty, 4, 4, first_keys(1)[0]) is None
    assert choose(full(), 4, 4, None) is None  # a prompt shorter than a block, or unkeyable


# The shared-prefix bench's prompts: a 512-token prefix (32 blocks of 16) and a 64-token suffix.
PROMPT, SUFFIX = 576, 64


def holder(outstanding: int = 0, in_flight: int = 0, held: int = 0) -> Candidate:
    return Candidate("holder", 32, outstanding, held, SUFFIX, in_flight)


def other(outstanding: int = 0, in_flight: int = 0, cached: int = 0) -> Candidate:
    return Candidate("other", cached, outstanding, 0, PROMPT - 16 * cached, in_flight)


@pytest.mark.parametrize(
    ("case", "candidates", "max_imbalance", "expected"),
    [
        ("both idle: the holder", [other(), holder()], 4, Choice("holder", 32, CACHE)),
        # Four follow-ups in flight on the holder, each computing its 64 new tokens: computing
        # the prefix on the idle replica takes longer than the work queued on the holder.
        ("short work queued", [holder(4, 4 * SUFFIX), other()], 4, Choice("holder", 32, CACHE)),
        # The same four requests, each a whole prompt still to compute: the idle one is sooner.
        ("long work queued", [holder(4, 4 * PROMPT), other()], 4, Choice("other", 0, LOAD)),
        ("three long prompts", [holder(3, 3 * PROMPT), other()], 4, Choice("holder", 32, CACHE)),
        # The guard counts requests at any load: 5 above the least busy is out, whatever it holds.
        ("guard", [holder(5, 5 * SUFFIX), other()], 4, Choice("other", 0, GUARD)),
        ("guard at load", [holder(34, 0), other(30)], 4, Choice("holder", 32, CACHE)),
        ("guard at load, 5 above", [holder(35, 0), other(30)], 4, Choice("other", 0, GUARD)),
        ("a wider guard", [holder(5, 5 * SUFFIX), other()], 8, Choice("holder", 32, CACHE)),
        # Both hold part of it: the cheaper in tokens, not the one holding more.
        (
            "partial holders",
            [holder(2, 2 * PROMPT), other(0, 0, cached=16)],
            4,
            Choice("other", 16, LOAD),
        ),
    ],
)
def test_the_cost_is_time_in_tokens(case, candidates, max_imbalance, expected) -> None:
    assert choose(candidates, weight=4, max_imbalance=max_imbalance) == expected, case


def test_equal_cost_goes_to_the_emptier_replica() -> None:
    a = Candidate("a", cached_blocks=10, outstanding=1, held_blocks=190, uncached_tokens=8)
    b = Candidate("b", cached_blocks=10, outstanding=1, held_blocks=50, uncached_tokens=8)
    assert choose([a, b], weight=4, max_imbalance=4) == Choice("b", 10, CACHE)


def test_the_weight_is_what_a_token_to_compute_costs_against_one_in_flight() -> None:
    """The proxy's default weight: a prompt computed again costs 4 times its tokens queued."""
    weight = next(f.default for f in fields(ProxyConfig) if f.name == "cache_overlap_weight")
    assert isinstance(weight, float)
    assert cost(holder(3, 3 * PROMPT), weight) == weight * SUFFIX + 3 * PROMPT + 3
    assert choose([holder(3, 3 * PROMPT), other()], 1.0, 4) == Choice("other", 0, LOAD)
    assert choose([holder(3, 3 * PROMPT), other()], weight, 4) == Choice("holder", 32, CACHE)


async def test_legs_count_their_planned_tokens_on_their_replica_while_they_run() -> None:
    """Through the real proxy on fakes: a long prompt's prefill leg adds its uncached tokens to
    the prefill's tokens_in_flight while it runs and takes them back when it ends; the scorer
    reads them, so a holder with enough work queued loses the next request to an idle replica."""
    import asyncio

    from pd_proxy.protocol.endpoints import COMPLETIONS
    from pd_proxy.testing.fake_model import tokenize
    from tests.proxy.proxy_harness import pd_stack
    from tests.support.waits import until

    from .test_cache_routing import hold, served, text

    async with pd_stack(decodes=2, prefix_cache_routing="events") as s:
        prompt = text(60)
        s.prefill.knobs.delay = 1.0
        prefill = s.proxy.prefill_pool.backends[0]
        sent = asyncio.create_task(s.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 2}))
        await until(lambda: prefill.tokens_in_flight > 0, "the prefill leg running", timeout=10)
        assert prefill.tokens_in_flight == len(tokenize(prompt))  # nothing cached: all of it
        status, _, raw = await sent
        assert status == 200, raw
        assert prefill.tokens_in_flight == 0 and prefill.outstanding == 0

        shared = text(40, start=300)
        hold(s, 1, shared)
        holder = s.proxy.decode_pool.backends[1]
        before = served(s)
        await s.post(COMPLETIONS, {"prompt": f"{shared} q0", "max_tokens": 2})
        assert served(s) == [before[0], before[1] + 1]  # the holder, idle
        before = served(s)
        holder.tokens_in_flight = 10 * len(tokenize(shared))  # work queued there: much longer
        await s.post(COMPLETIONS, {"prompt": f"{shared} q1", "max_tokens": 2})
        holder.tokens_in_flight = 0
        after = served(s)
        assert after[0] == before[0] + 1 and after[1] == before[1]


async def test_full_caches_through_the_proxy_spread_new_prefixes_to_stable_homes() -> None:
    """The full-cache collapse, on fakes: both decodes' indexes full of other prompts, 24 new
    prefixes one at a time; each lands where its first block hashes (not on the emptier cache),
    and lands there again once what the proxy sent is forgotten (no pending entry steering it)."""
    from pd_proxy.protocol.endpoints import COMPLETIONS
    from pd_proxy.routing.cache.scorer import rank
    from pd_proxy.testing.fake_model import tokenize
    from tests.proxy.proxy_harness import pd_stack

    from .test_cache_routing import hold, served, text

    async with pd_stack(decodes=2, prefix_cache_routing="events") as s:
        hold(s, 0, text(160, start=50_000))
        hold(s, 1, text(160, start=60_000))
        known = s.running.pipeline.planner.cache.known
        rounds = []
        for _ in range(2):
            homes = []
            for p in range(24):
                before = served(s)
                body = {"prompt": f"{text(40, start=1000 * p)} q", "max_tokens": 2}
                status, _, raw = await s.post(COMPLETIONS, body)
                assert status == 200, raw
                homes.append([a - b for a, b in zip(served(s), before, strict=True)].index(1))
            rounds.append(homes)
            for d in s.decodes:
                known.pending.forget(d.url)
        assert rounds[0] == rounds[1]
        urls = [d.url for d in s.decodes]  # random ports: the spread itself is tested above
        hashed = [
            urls.index(max(urls, key=lambda u: rank(placement_key(tokenize(t)[:BLOCK]), u)))
            for t in (f"{text(40, start=1000 * p)} q" for p in range(24))
        ]
        assert rounds[0] == hashed
