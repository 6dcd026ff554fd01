"""The choice of a replica by cost: the share of the prompt it would have to compute, weighted,
plus the requests it is already serving (as NVIDIA Dynamo's KV router: overlap-weighted prefill
blocks plus decode load).

``cost = weight * uncached_blocks / prompt_blocks + outstanding``: with weight 2, a replica that
holds the whole prompt wins over an idle one until it has 2 more requests in flight. The
imbalance guard keeps a hot prefix from piling every request onto one replica: a replica more
than ``max_imbalance`` requests above the least busy one is not a candidate, whatever it holds.
Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Reasons a replica was chosen (pd_proxy_cache_choices_total's reason label).
CACHE = "cache"  # it holds more of the prompt than the others, at a fair load
LOAD = "load"  # nothing cached anywhere (or it is no better): least outstanding, as without cache
GUARD = "guard"  # the replica holding the most was too busy: the imbalance guard overrode it
REASONS = (CACHE, LOAD, GUARD)


@dataclass(frozen=True)
class Candidate:
    name: str
    cached_blocks: int
    outstanding: int


@dataclass(frozen=True)
class Choice:
    name: str
    cached_blocks: int
    reason: str


def choose(
    candidates: Sequence[Candidate], prompt_blocks: int, weight: float, max_imbalance: int
) -> Choice | None:
    """The cheapest candidate, or None when no candidate holds any block (the caller then picks
    by load alone, as the proxy always did). Ties keep the order given."""
    if not candidates or not any(c.cached_blocks for c in candidates):
        return None
    least = min(c.outstanding for c in candidates)
    fair = [c for c in candidates if c.outstanding <= least + max_imbalance]
    blocks = max(prompt_blocks, 1)

    def cost(c: Candidate) -> tuple[float, int]:
        return weight * (blocks - min(c.cached_blocks, blocks)) / blocks + c.outstanding, -(
            c.cached_blocks
        )

    best = min(fair, key=cost)
    most = max(c.cached_blocks for c in candidates)
    if best.cached_blocks < most and max(c.cached_blocks for c in fair) < most:
        reason = GUARD
    elif best.cached_blocks and best.cached_blocks == most:
        reason = CACHE
    else:
        reason = LOAD
    return Choice(best.name, best.cached_blocks, reason)
