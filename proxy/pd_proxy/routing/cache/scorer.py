"""The choice of a replica by estimated time, counted in prompt tokens (as NVIDIA Dynamo's KV
router counts load in blocks): the tokens of this prompt it would compute, plus the work already
queued or running there.

``cost = weight * uncached_tokens + tokens_in_flight + outstanding``:

- ``uncached_tokens``: the prompt tokens it does not hold (its prefill for this request);
- ``tokens_in_flight``: the uncached prompt tokens of the proxy's legs running there (each leg
  counts its route's, pd_proxy.legs): prefills queued or running ahead of this one;
- ``outstanding``: its requests in flight, one token each: every running decode takes a token
  of every step this request's prefill shares.

``weight`` (``--cache-overlap-weight``, 4) is what a token this request would compute costs
against a token already in flight. The in-flight tokens of a leg count until it ends, while its
prefill ends at its first token, so they over-state the queue; computing the prompt again is
certain. With a 512-token prefix and 64-token suffixes, the holder of an idle replica's missing
prefix keeps it until the work there outweighs computing the prefix elsewhere: 3 whole prompts
in flight, or about 30 follow-ups of 64 new tokens (the guard stops it sooner), where a full miss
used to be worth 4 requests whatever their length.

The imbalance guard keeps a hot prefix from piling every request onto one replica: a replica
more than ``max_imbalance`` requests above the least busy one is not a candidate, whatever it
holds (a fixed count at any load: scaled down to the mean load, it sent a holder's fourth
request elsewhere at 4 in flight over 2 replicas, and the copies that made overfilled the caches,
docs/bench.md). The request it sends elsewhere computes the prefix there, and from then on both
replicas hold it and share its load. At equal cost, the one holding more of the prompt, then the
one holding fewer blocks in all.

Placement of a new prefix (cached nowhere): rendezvous hashing of its first block's key over the
replicas at most ``PLACEMENT_SLACK`` requests above the least busy, so that each prefix has one
stable home and prefixes spread over the replicas' caches as a client pinning each prefix spreads
them. The replica holding the fewest blocks spread nothing once the caches were full (their
fills equal or stale: 120 of 144 requests on one of two decodes, in a full-cache run). With
nothing known of any candidate's cache (no block held or pending anywhere: events lost, not yet
heard), the choice is by load alone, as without cache-aware routing. Pure.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

# Reasons a replica was chosen (pd_proxy_cache_choices_total's reason label).
CACHE = "cache"  # it holds more of the prompt than the others, at a fair load
LOAD = "load"  # nothing cached anywhere (or it is no better): by load, then by free room
GUARD = "guard"  # the replica holding the most was too busy: the imbalance guard overrode it
REASONS = (CACHE, LOAD, GUARD)
PLACEMENT_SLACK = 1  # requests above the least busy a new prefix's replica may have


class Candidate(NamedTuple):
    """One replica as the scorer sees it (a tuple: the router makes one per replica per role
    for every request, 64 at 32 replicas, where a frozen dataclass's ``__init__`` cost 2.7x)."""

    name: str
    cached_blocks: int  # leading blocks of the prompt it holds (or was just sent)
    outstanding: int  # requests in flight there
    held_blocks: int = 0  # blocks it holds in all (its cache's fill)
    uncached_tokens: int = 0  # prompt tokens it would compute for this request
    tokens_in_flight: int = 0  # prompt tokens its legs in flight compute


@dataclass(frozen=True)
class Choice:
    name: str
    cached_blocks: int
    reason: str


def cost(c: Candidate, weight: float) -> float:
    """The estimated time to this request's first token at ``c``, in prompt tokens (the same
    estimate admission can read)."""
    return weight * c.uncached_tokens + c.tokens_in_flight + c.outstanding


def place(candidates: Sequence[Candidate], first_key: int | None) -> Candidate | None:
    """For a prompt cached nowhere: the replica its first block's key ranks highest among the
    nearly least busy (rendezvous hashing), or None without a key or with nothing known of any
    candidate's cache (the caller's rotation then decides)."""
    if not candidates or first_key is None or not any(c.held_blocks for c in candidates):
        return None
    least = min(c.outstanding for c in candidates)
    near = [c for c in candidates if c.outstanding <= least + PLACEMENT_SLACK]
    return max(near, key=lambda c: rank(first_key, c.name))


def rank(key: int, name: str) -> int:
    """Rendezvous weight of replica ``name`` for block ``key``: splitmix64's finaliser over the
    two, the same in every process (the name by CRC-32, not Python's seeded str hash)."""
    z = (key ^ _seed(name)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


_M64 = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _seed(name: str) -> int:
    return (zlib.crc32(name.encode()) * 0x9E3779B97F4A7C15) & _M64


def choose(
    candidates: Sequence[Candidate],
    weight: float,
    max_imbalance: int,
    first_key: int | None = None,
) -> Choice | None:
    """The cheapest candidate, or None when nothing tells them apart (no candidate holds any of
    the prompt and ``place`` has no key or knows nothing: the caller picks by load alone, as the
    proxy always did). ``first_key``: the prompt's first block key. Ties keep the order given."""
    if not candidates:
        return None
    if not any(c.cached_blocks for c in candidates):
        placed = place(candidates, first_key)
        return None if placed is None else Choice(placed.name, 0, LOAD)
    limit = min(c.outstanding for c in candidates) + max_imbalance
    # One pass: the cheapest of all and of the fair ones (at equal cost, the one holding more of
    # the prompt, then the one holding fewer blocks in all; ties keep the order given).
    best = cheapest = candidates[0]
    best_key = cheapest_key = None
    most = 0
    for c in candidates:  # cost() inline: 64 candidates per request at 32 replicas
        _, cached, outstanding, held, uncached, in_flight = c
        key = (weight * uncached + in_flight + outstanding, -cached, held)
        if cheapest_key is None or key < cheapest_key:
            cheapest, cheapest_key = c, key
        if outstanding <= limit and (best_key is None or key < best_key):
            best, best_key = c, key
        if cached > most:
            most = cached
    if best.cached_blocks < cheapest.cached_blocks:
        reason = GUARD  # by cost alone, a busier replica holding more would have won
    elif best.cached_blocks and best.cached_blocks == most:
        reason = CACHE
    else:
        reason = LOAD
    return Choice(best.name, best.cached_blocks, reason)
