"""Blocks the proxy has just sent to a replica and that its KV events have not announced yet.

A replica announces a prompt's blocks only after their prefill, so requests for a new prefix that
arrive together would all see it cached nowhere and scatter (each computing it again). As NVIDIA
Dynamo's KV router tracks the blocks of the requests it routed until events confirm them, the
router counts a routed prompt's keys as held where it sent them, for ``ttl_s`` seconds (and at
most ``SWEEP_EVERY_S`` more): its events then say the truth (the entries are dropped once the
index holds them), or the replica never stored them (lost events, a failed request, an
eviction) and the entries lapse.
At most ``capacity`` keys per replica, oldest out first; a replica down or gone forgets its own.

Only the routing choice reads these: the path decision (decode alone or P/D) counts what the
events confirm, since a pending prefix may still be computing. Pure: the caller passes times.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pd_proxy.routing.cache.keys import Key

PENDING_TTL_S = 10.0  # a prefill and its events' arrival take far less, even queued on a CPU
PENDING_CAPACITY = 4096  # keys per replica: many prompts in flight, bounded memory
# Lapsed entries are swept at most this often (so an entry may outlive its TTL by this much):
# under steady traffic entries lapse all the time, and a sweep of every replica per request
# was 3% of pd-proxy's time at 32 replicas (py-spy).
SWEEP_EVERY_S = 0.5


class PendingIndex:
    """Per replica, keys routed there and their expiry times, in order of routing."""

    def __init__(self, ttl_s: float = PENDING_TTL_S, capacity: int = PENDING_CAPACITY) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.replicas: dict[str, OrderedDict[Key, float]] = {}
        # No read sweeps before this time (the router reads every replica's entries per request;
        # looking for lapsed ones at each cost more than the match at 32 replicas).
        self.next_expiry = math.inf

    def record(self, replica: str, keys: Sequence[Key], now: float) -> None:
        """The proxy sent a prompt of these keys to ``replica`` at ``now``."""
        if not keys:
            return
        entries = self.replicas.setdefault(replica, OrderedDict())
        expiry = now + self.ttl_s
        self.next_expiry = min(self.next_expiry, expiry)
        for key in keys:
            entries[key] = expiry
            entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def match(self, replica: str, keys: Sequence[Key], now: float, start: int = 0) -> int:
        """How many of ``keys`` lead what was routed to ``replica`` and has not lapsed, where
        the first ``start`` are known held (its events announced them): ``start`` plus the
        pending run after them."""
        return run(self.live(replica, now), keys, start)

    def confirm(self, replica: str, keys: Sequence[Key]) -> None:
        """The replica's events announced these keys: they need no pending entry. Called per
        Stored event (a few keys), not per request: confirming at each replica while routing
        walked a long prompt's keys at every one of them (most of routing's cost at 32
        replicas, py-spy)."""
        entries = self.replicas.get(replica)
        if entries is None:
            return
        for key in keys:
            entries.pop(key, None)
        if not entries:
            del self.replicas[replica]

    def size(self, replica: str, now: float) -> int:
        return len(self.live(replica, now))

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def live(self, replica: str, now: float) -> Mapping[Key, float]:
        """``replica``'s entries that have not lapsed (empty: none); read them, never write."""
        return self.swept(now).get(replica, NONE)

    def swept(self, now: float) -> Mapping[str, Mapping[Key, float]]:
        """Every replica's entries that have not lapsed (read them, never write): one lookup
        per replica for a caller that reads them all."""
        if now >= self.next_expiry:
            self._sweep(now)
        return self.replicas

    def _sweep(self, now: float) -> None:
        """Drop every replica's lapsed entries (recorded in order, so from the front: a key
        recorded again moves to the back with its new expiry)."""
        soonest = math.inf
        for replica, entries in list(self.replicas.items()):
            lapsed = 0  # counted in one pass, then popped: an iterator per entry cost 1.5x
            for expiry in entries.values():
                if expiry > now:
                    soonest = min(soonest, expiry)
                    break
                lapsed += 1
            if lapsed == len(entries):
                del self.replicas[replica]
                continue
            popitem = entries.popitem
            for _ in range(lapsed):
                popitem(last=False)
        self.next_expiry = max(soonest, now + SWEEP_EVERY_S)


def run(entries: Mapping[Key, float], keys: Sequence[Key], start: int) -> int:
    """``start`` plus how many of ``keys`` after the first ``start`` are in ``entries``."""
    n = start
    if entries:
        for i in range(start, len(keys)):
            if keys[i] not in entries:
                break
            n += 1
    return n


NONE: Mapping[Key, float] = {}  # a replica without entries (never written)
