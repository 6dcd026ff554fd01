"""The routing rules that make shared prefixes fit: requests just sent count as held where they
went (pending, until events confirm or a TTL), new prefixes go where there is room, and the
imbalance guard scales with the load in flight. Pure: no proxy, no clock."""

from __future__ import annotations

from pd_proxy.cache.keys import chain
from pd_proxy.cache.pending import PendingIndex
from pd_proxy.cache.scorer import CACHE, GUARD, LOAD, Candidate, Choice, choose, guard_slack

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


def test_the_guard_scales_with_the_load_in_flight() -> None:
    # Four requests over two replicas: the hot one may be 2 above the other, not 4.
    hot = Candidate("hot", cached_blocks=10, outstanding=4)
    cold = Candidate("cold", cached_blocks=0, outstanding=0)
    assert guard_slack([hot, cold], max_imbalance=4) == 2
    assert choose([hot, cold], 10, weight=100, max_imbalance=4) == Choice("cold", 0, GUARD)
    warm = Candidate("hot", cached_blocks=10, outstanding=3)
    assert choose([warm, Candidate("cold", 0, 1)], 10, weight=100, max_imbalance=4).name == "hot"
    # Many in flight: max_imbalance caps the slack; one request alone still has 1.
    assert guard_slack([Candidate("x", 0, 30), Candidate("y", 0, 10)], max_imbalance=4) == 4
    assert guard_slack([Candidate("x", 0, 1), Candidate("y", 0, 0)], max_imbalance=4) == 1
