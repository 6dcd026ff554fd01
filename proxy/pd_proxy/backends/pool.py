"""Backends and their pools: the worker registry (health checks: pd_proxy.backends.health).

Health is both active (``GET {backend}/health`` every interval, judged by the circuit breaker of
pd_proxy.backends.breaker, which tells a hung backend from a busy one by what the proxy sees) and
passive (a refused connection takes the backend out at once, pd_proxy.legs). When a backend
goes down, the prefill legs still waiting for its answer are told to move (``Backend.waiters``),
so a hung replica costs them the detection time, not the leg's whole timeout.

The choice of a backend for a leg is pd_proxy.scheduler's, the one place replicas are chosen.

Membership can change at run time (``BackendPool.update``, fed by pd_proxy.discovery.watch): a
backend
that no source lists any more moves to ``draining``. It gets no new requests, its in-flight ones
finish, and ``reap`` drops it once nothing is outstanding on it, so a scale-down loses no request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from yarl import URL

from pd_proxy.backends.breaker import Breaker

log = logging.getLogger("pd_proxy.routing.pool")

# The message a moved leg's cancellation carries (pd_proxy.legs tells it from a client leaving).
MOVE = "pd-proxy: backend went down"


class Backend:
    """One vLLM instance; ``outstanding`` counts requests on it now."""

    __slots__ = (
        "role",
        "url",
        "base",
        "address",
        "healthy",
        "outstanding",
        "tokens_in_flight",
        "draining",
        "slow_checks",
        "probing",
        "passes",
        "fails",
        "progress",
        "waiters",
        "_urls",
    )

    def __init__(self, role: str, url: str, healthy: bool = True) -> None:
        self.role = role
        self.url = url
        self.base = URL(url)
        # (host, port, TLS) for pd_proxy.http.upstream; the host as the resolver wants it (IDNA).
        self.address = (self.base.raw_host or "", self.base.port or 80, self.base.scheme == "https")
        # Configured backends start optimistic (the first round runs before the proxy listens);
        # discovered ones start down, so none gets a request before its first check passes.
        self.healthy = healthy
        self.outstanding = 0
        # Prompt tokens its legs in flight compute (the route's uncached tokens; 0 unplanned).
        self.tokens_in_flight = 0
        self.draining = False  # left every source: no new requests, dropped once idle
        self.slow_checks = 0  # health checks in a row that timed out while it was busy
        self.probing = False  # half-open: one request at a time until it proves itself
        self.passes = 0  # checks in a row that passed
        self.fails = 0  # checks in a row that failed
        self.progress = 0  # answers and stream chunks received from it (pd_proxy.legs bumps it)
        # Legs waiting for its answer that move to another backend when it goes down (the
        # value: whether it was told to move).
        self.waiters: dict[asyncio.Task, bool] = {}
        self._urls: dict[str, URL] = {}

    def endpoint(self, path: str) -> URL:
        """Absolute URL of ``path`` on this backend (keeps any base path prefix); cached."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.base.with_path(self.base.path.rstrip("/") + path)
        return url

    def went_down(self) -> None:
        """Down now (a refused connection): its waiting legs move elsewhere."""
        Breaker.open(self)
        self.move_waiters()

    def move_waiters(self) -> None:
        """Cancel the legs waiting for its answer with ``MOVE``: each goes again elsewhere."""
        for task, told in self.waiters.items():
            if not told:
                self.waiters[task] = True
                task.cancel(MOVE)

    def __repr__(self) -> str:
        return f"Backend({self.role}, {self.url}, healthy={self.healthy})"


class BackendPool:
    """The backends of one role: ``backends`` take requests, ``draining`` ones only finish theirs.

    Both lists are replaced, never changed in place, so a caller iterating one across an ``await``
    keeps a consistent snapshot.
    """

    STATIC = "static"  # the source name of the configured URLs

    def __init__(self, role: str, urls: tuple[str, ...]) -> None:
        self.role = role
        self.backends = [Backend(role, u) for u in dict.fromkeys(urls)]
        self.draining: list[Backend] = []
        self._sources: dict[str, frozenset[str]] = {self.STATIC: frozenset(urls)}
        self.rotation = 0  # where pd_proxy.scheduler's next round-robin turn starts

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def down(self) -> list[str]:
        return [b.url for b in self.backends if not b.healthy]

    def update(self, source: str, urls: Iterable[str]) -> list[Backend]:
        """Set what ``source`` lists now; the pool serves the union of all its sources.

        New URLs join unhealthy (the caller checks them, see ``HealthChecker.check_some``); URLs
        no source lists any more start draining; a draining URL that comes back serves again.
        Returns the backends that joined.
        """
        self._sources[source] = frozenset(urls)
        wanted: set[str] = set().union(*self._sources.values())
        keep: list[Backend] = []
        leaving: list[Backend] = []
        for b in self.backends:
            if b.url in wanted:
                keep.append(b)
            else:
                b.draining = True
                leaving.append(b)
                log.info(
                    "%s backend %s is no longer listed: draining (%d in flight)",
                    self.role,
                    b.url,
                    b.outstanding,
                )
        still_draining: list[Backend] = []
        for b in self.draining:
            if b.url in wanted:
                b.draining = False
                keep.append(b)
                log.info("%s backend %s is listed again: serving", self.role, b.url)
            else:
                still_draining.append(b)
        have = {b.url for b in keep} | {b.url for b in still_draining} | {b.url for b in leaving}
        added = [Backend(self.role, url, healthy=False) for url in sorted(wanted - have)]
        for b in added:
            log.info(
                "%s backend %s joined (%s): serving once a health check passes",
                self.role,
                b.url,
                source,
            )
        self.backends = keep + added
        self.draining = still_draining + leaving
        return added

    def reap(self) -> list[Backend]:
        """Drop the draining backends with nothing in flight; returns them."""
        if not self.draining:
            return []
        done = [b for b in self.draining if b.outstanding == 0]
        if done:
            self.draining = [b for b in self.draining if b.outstanding > 0]
            for b in done:
                log.info("%s backend %s drained: dropped", self.role, b.url)
        return done

    def count(self, state: str) -> int:
        """Backends in ``state``: healthy, unhealthy (both taking part) or draining."""
        if state == "draining":
            return len(self.draining)
        want = state == "healthy"
        return sum(1 for b in self.backends if b.healthy == want)
