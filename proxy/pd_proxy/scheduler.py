"""The one place a replica is chosen: filter, then score, then pick.

- filter: the pool's healthy backends (a draining one has left ``backends`` already), not the
  one a failover leaves (``exclude``), only those with room when admission says which
  (``among``); a probing backend with a request in flight is the last resort (half-open: one
  request at a time until it proves itself);
- score: the caller's estimate when it has one (the cache scorer's estimated time over
  ``healthy``, pd_proxy.routing.cache.scorer: ``scored`` is the backend it rates best, None when
  nothing tells the candidates apart); else the fewest outstanding requests;
- pick: the lowest score, ties to the first in rotation order. The rotation starts just after
  the pool's last least-outstanding choice, so a dead backend's turn does not fall to its
  neighbour every time.

``choose`` is pure: it reads a ``Snapshot`` of a pool and returns the backend and the rotation
point after it. ``pick``, ``place`` and ``least_busy`` are what the planner, admission's
placement, the failover after a refused connection and the ``/tokenize`` target call; they take
the snapshot and store the new rotation point, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pd_proxy.backends.pool import Backend, BackendPool


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a choice reads of one pool: its serving backends and where the rotation starts."""

    backends: tuple[Backend, ...]
    rotation: int = 0

    @classmethod
    def of(cls, pool: BackendPool) -> Snapshot:
        return cls(tuple(pool.backends), pool.rotation)


@dataclass(frozen=True, slots=True)
class Choice:
    """The backend chosen, and the rotation point after it (None: the rotation stays)."""

    backend: Backend
    rotation: int | None


def eligible(
    snapshot: Snapshot,
    exclude: Backend | None = None,
    among: Collection[Backend] | None = None,
) -> list[Backend]:
    """The filter: healthy, not ``exclude``, in ``among`` when given, in rotation order; the busy
    probing ones only when nothing else is left."""
    backends = snapshot.backends
    n = len(backends)
    candidates: list[Backend] = []
    spare: list[Backend] = []  # busy probing backends: the last resort
    for i in range(snapshot.rotation, snapshot.rotation + n):
        b = backends[i % n]
        if b.healthy and b is not exclude and (among is None or b in among):
            (spare if b.probing and b.outstanding else candidates).append(b)
    return candidates or spare


def least_outstanding(candidates: Sequence[Backend]) -> Backend:
    """The default score: the fewest requests in flight, ties to the first given."""
    best = candidates[0]
    for b in candidates[1:]:
        if b.outstanding < best.outstanding:
            best = b
    return best


def choose(
    snapshot: Snapshot,
    *,
    exclude: Backend | None = None,
    among: Collection[Backend] | None = None,
    scored: Backend | None = None,
) -> Choice | None:
    """Filter, score, pick, on ``snapshot``; None when no backend passes the filter. A choice by
    the caller's estimate (``scored``, the cache's) leaves the rotation where it was; a choice by
    load moves it on."""
    if scored is not None:
        return Choice(scored, None)
    candidates = eligible(snapshot, exclude, among)
    if not candidates:
        return None
    chosen = least_outstanding(candidates)
    return Choice(chosen, (snapshot.backends.index(chosen) + 1) % len(snapshot.backends))


def pick(
    pool: BackendPool,
    *,
    exclude: Backend | None = None,
    among: Collection[Backend] | None = None,
    scored: Backend | None = None,
) -> Backend | None:
    """The backend for a leg of ``pool`` (see ``choose``), the pool's rotation moved on."""
    choice = choose(Snapshot.of(pool), exclude=exclude, among=among, scored=scored)
    if choice is None:
        return None
    if choice.rotation is not None:
        pool.rotation = choice.rotation
    return choice.backend


def healthy(pool: BackendPool) -> list[Backend]:
    """The candidates a caller's estimate scores (``scored``): the pool's healthy backends."""
    return [b for b in pool.backends if b.healthy]


def usable(backend: Backend | None) -> bool:
    """Whether a replica chosen ahead (by the plan) may still take the leg."""
    return backend is not None and backend.healthy and not backend.draining


def place(
    pool: BackendPool, chosen: Backend | None, fits: Callable[[Backend], bool]
) -> Backend | None:
    """Admission's placement: the plan's replica while it is usable (it holds the prompt's
    cache: the request waits for its room, None), else the pool's choice among the replicas
    where the request ``fits`` (all of them when every one has room)."""
    if chosen is not None and usable(chosen):
        return chosen if fits(chosen) else None
    healthy = [b for b in pool.backends if b.healthy and not b.draining]
    room = [b for b in healthy if fits(b)]
    if len(room) == len(healthy):  # room everywhere: the pool's own choice, as without
        return pick(pool)
    return pick(pool, among=room) if room else None


def least_busy(pool: BackendPool) -> Backend | None:
    """The target of a side request (``/tokenize``): the least busy healthy backend, without
    moving the rotation (the count and the request would otherwise alternate in step and every
    request land on the same backend)."""
    candidates = healthy(pool)
    return least_outstanding(candidates) if candidates else None
