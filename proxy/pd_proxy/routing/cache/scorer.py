"""The choice of a replica by cost: the share of the prompt it would have to compute, weighted,
plus the requests it is already serving (as NVIDIA Dynamo's KV router: overlap-weighted prefill
blocks plus decode load).

``cost = weight * uncached_blocks / prompt_blocks + outstanding``: with weight 4 (the default),
a replica that holds the whole prompt wins over an idle one until it has 4 more requests in
flight; at equal cost, the one holding more of the prompt, then the one holding fewer blocks in
all.

The imbalance guard keeps a hot prefix from piling every request onto one replica: a replica
more than ``max_imbalance`` requests above the least busy one is not a candidate, whatever it
holds. The request the guard sends elsewhere computes the prefix there, and from then on both
replicas hold it and share its load. The guard is the same at any load: scaled down to the mean
load per replica, it sent a holder's fourth request elsewhere at 4 in flight over 2 replicas,
and the copies that made overfilled the caches (the shared-prefix bench: 0.67-0.80 of the ideal
hits against 0.84-1.00 with this rule, docs/bench.md).

Placement of a new prefix (cached nowhere): among the replicas at most ``PLACEMENT_SLACK``
requests above the least busy, the one holding the fewest blocks, so that prefixes spread over
the replicas' caches instead of evicting each other on one of them (a request in flight ends
soon; a prefix that does not fit misses on every later request).
Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Reasons a replica was chosen (pd_proxy_cache_choices_total's reason label).
CACHE = "cache"  # it holds more of the prompt than the others, at a fair load
LOAD = "load"  # nothing cached anywhere (or it is no better): by load, then by free room
GUARD = "guard"  # the replica holding the most was too busy: the imbalance guard overrode it
REASONS = (CACHE, LOAD, GUARD)
PLACEMENT_SLACK = 1  # requests above the least busy a new prefix's replica may have


@dataclass(frozen=True)
class Candidate:
    name: str
    cached_blocks: int  # leading blocks of the prompt it holds (or was just sent)
    outstanding: int
    held_blocks: int = 0  # blocks it holds in all (its cache's fill)


@dataclass(frozen=True)
class Choice:
    name: str
    cached_blocks: int
    reason: str


def place(candidates: Sequence[Candidate]) -> Candidate | None:
    """For a prompt cached nowhere: the least filled replica among the nearly least busy, or
    None when load and fill do not tell them apart (the caller's rotation then decides)."""
    if not candidates:
        return None
    least = min(c.outstanding for c in candidates)
    near = [c for c in candidates if c.outstanding <= least + PLACEMENT_SLACK]
    best = min(near, key=lambda c: (c.held_blocks, c.outstanding))
    ties = [
        c for c in near if (c.held_blocks, c.outstanding) == (best.held_blocks, best.outstanding)
    ]
    return best if len(ties) == 1 else None


def choose(
    candidates: Sequence[Candidate], prompt_blocks: int, weight: float, max_imbalance: int
) -> Choice | None:
    """The cheapest candidate, or None when nothing tells them apart (no candidate holds any of
    the prompt and ``place`` finds no better room: the caller picks by load alone, as the proxy
    always did). Ties keep the order given."""
    if not candidates:
        return None
    if not any(c.cached_blocks for c in candidates):
        placed = place(candidates)
        return None if placed is None else Choice(placed.name, 0, LOAD)
    least = min(c.outstanding for c in candidates)
    fair = [c for c in candidates if c.outstanding <= least + max_imbalance]
    blocks = max(prompt_blocks, 1)

    def cost(c: Candidate) -> tuple[float, int, int]:
        uncached = blocks - min(c.cached_blocks, blocks)
        return weight * uncached / blocks + c.outstanding, -c.cached_blocks, c.held_blocks

    best = min(fair, key=cost)
    most = max(c.cached_blocks for c in candidates)
    if best.cached_blocks < min(candidates, key=cost).cached_blocks:
        reason = GUARD  # by cost alone, a busier replica holding more would have won
    elif best.cached_blocks and best.cached_blocks == most:
        reason = CACHE
    else:
        reason = LOAD
    return Choice(best.name, best.cached_blocks, reason)
