"""The routing rules that make shared prefixes fit: requests just sent count as held where they
went (pending, until events confirm or a TTL), new prefixes go where there is room, and the
imbalance guard keeps a holder its prefix up to max_imbalance above the others. Pure: no proxy,
no clock."""

from __future__ import annotations

from dataclasses import fields

from pd_proxy.config import ProxyConfig
from pd_proxy.routing.cache.keys import chain
from pd_proxy.routing.cache.pending import PendingIndex
from pd_proxy.routing.cache.scorer import CACHE, GUARD, LOAD, Candidate, Choice, choose

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


def test_pending_refreshed_by_a_later_request_lives_on() -> None:
    pending = PendingIndex(ttl_s=5.0, capacity=100)
    prefix = keys(2)
    pending.record("a", prefix, now=0.0)
    pending.record("a", prefix, now=4.0)
    assert pending.match("a", prefix, now=6.0) == 2


def test_a_new_prefix_goes_to_the_replica_with_room() -> None:
    full = Candidate("full", cached_blocks=0, outstanding=0, held_blocks=180)
    roomy = Candidate("roomy", cached_blocks=0, outstanding=1, held_blocks=40)
    # Nothing cached anywhere: one request more in flight is worth the room.
    assert choose([full, roomy], 36, weight=2, max_imbalance=4) == Choice("roomy", 0, LOAD)
    busy = Candidate("roomy", cached_blocks=0, outstanding=2, held_blocks=40)
    assert choose([full, busy], 36, weight=2, max_imbalance=4) == Choice("full", 0, LOAD)
    # Load and fill alike: nothing tells them apart, the pool's rotation decides.
    twin = Candidate("twin", cached_blocks=0, outstanding=0, held_blocks=180)
    assert choose([full, twin], 36, weight=2, max_imbalance=4) is None


def test_equal_cost_goes_to_the_emptier_replica() -> None:
    a = Candidate("a", cached_blocks=10, outstanding=1, held_blocks=190)
    b = Candidate("b", cached_blocks=10, outstanding=1, held_blocks=50)
    assert choose([a, b], 10, weight=2, max_imbalance=4) == Choice("b", 10, CACHE)


def test_the_guard_is_the_same_at_any_load() -> None:
    """Four requests over two replicas (the shared-prefix bench's c=4): the holder keeps its
    prefix up to max_imbalance above the other, so the prefix is not copied onto both caches;
    one more and the guard sends the request elsewhere."""
    hot = Candidate("hot", cached_blocks=10, outstanding=4)
    cold = Candidate("cold", cached_blocks=0, outstanding=0)
    assert choose([hot, cold], 10, weight=100, max_imbalance=4) == Choice("hot", 10, CACHE)
    hotter = Candidate("hot", cached_blocks=10, outstanding=5)
    assert choose([hotter, cold], 10, weight=100, max_imbalance=4) == Choice("cold", 0, GUARD)
    many = Candidate("hot", cached_blocks=10, outstanding=34)
    assert choose([many, Candidate("cold", 0, 30)], 10, 100, 4).name == "hot"
    assert choose([many, Candidate("cold", 0, 29)], 10, 100, 4).reason == GUARD


def test_the_default_weight_keeps_a_prefix_on_its_holder_at_three_above() -> None:
    """With the proxy's default weight, a holder 3 requests above an idle replica still wins
    (computing the whole prompt costs more than 3 requests' wait); 5 above, it does not."""
    weight = next(f.default for f in fields(ProxyConfig) if f.name == "cache_overlap_weight")
    assert isinstance(weight, float)
    cold = Candidate("cold", cached_blocks=0, outstanding=0)
    held = Candidate("hot", cached_blocks=10, outstanding=3)
    assert choose([held, cold], 10, weight, max_imbalance=8) == Choice("hot", 10, CACHE)
    busy = Candidate("hot", cached_blocks=10, outstanding=5)
    assert choose([busy, cold], 10, weight, max_imbalance=8) == Choice("cold", 0, LOAD)
