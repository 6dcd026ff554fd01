"""Backends: their pools, the choice of one for a leg, and their periodic health checks.

Health is both active (``GET {backend}/health`` every interval, judged by pd_proxy.routing.breaker's
circuit breaker, which tells a hung backend from a busy one by what the proxy sees) and passive
(a refused connection takes the backend out at once, pd_proxy.legs). When a backend goes down,
the prefill legs still waiting for its answer are told to move (``Backend.waiters``), so a hung
replica costs them the detection time, not the leg's whole timeout.

``Chooser`` is the one place that picks a backend for a leg among the eligible ones: least
outstanding requests, ties rotating round-robin. A routing policy (cache-aware, say) replaces it.

Membership can change at run time (``BackendPool.update``, fed by pd_proxy.discovery.watch): a
backend
that no source lists any more moves to ``draining``. It gets no new requests, its in-flight ones
finish, and ``reap`` drops it once nothing is outstanding on it, so a scale-down loses no request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable

import aiohttp
from yarl import URL

from pd_proxy.routing.breaker import Breaker, CheckResult, Verdict, judge

log = logging.getLogger("pd_proxy.routing.pool")

# The message a moved leg's cancellation carries (pd_proxy.legs tells it from a client leaving).
MOVE = "pd-proxy: backend went down"
# The part of a health check's time its connect may take.
CONNECT_SHARE = 0.5


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


class Chooser:
    """Picks a leg's backend among the eligible ones: the fewest outstanding requests, ties
    rotating round-robin (the rotation restarts just after the last choice, so a dead backend's
    turn does not fall to its neighbour every time). The one place a routing policy plugs in."""

    def choose(self, candidates: list[Backend]) -> int:
        """The index in ``candidates`` (in rotation order, never empty) of the one to use."""
        best = 0
        fewest = candidates[0].outstanding
        for i in range(1, len(candidates)):
            if candidates[i].outstanding < fewest:
                best, fewest = i, candidates[i].outstanding
        return best


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
        self._next = 0
        self.chooser = Chooser()

    def pick(
        self, exclude: Backend | None = None, among: Collection[Backend] | None = None
    ) -> Backend | None:
        """The backend for a leg: ``chooser`` among the healthy ones (not ``exclude``; with
        ``among``, only those: admission's replicas with room), in rotation order; a probing one
        only while it has nothing in flight, unless no other is healthy."""
        backends = self.backends
        n = len(backends)
        start = self._next
        candidates: list[Backend] = []
        spare: list[Backend] = []  # busy probing backends: the last resort
        for i in range(start, start + n):
            b = backends[i % n]
            if b.healthy and b is not exclude and (among is None or b in among):
                (spare if b.probing and b.outstanding else candidates).append(b)
        if not candidates:
            if not spare:
                return None
            candidates = spare
        chosen = candidates[self.chooser.choose(candidates)]
        self._next = (backends.index(chosen) + 1) % n
        return chosen

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


class HealthChecker:
    """Polls every backend of every pool; ``on_result(backend, passed)`` is called after each
    check that decided something (not after a busy timeout), with ``backend.healthy`` updated."""

    def __init__(
        self,
        pools: list[BackendPool],
        session: aiohttp.ClientSession,
        interval: float,
        timeout: float,
        on_result: Callable[[Backend, bool], None],
        breaker: Breaker | None = None,
    ) -> None:
        self.pools = pools
        self.session = session
        self.interval = interval
        # The connect gets its own share, so a backend that cannot even accept a connection
        # (ConnectionTimeoutError) is told from one that accepted and stays silent.
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=timeout * CONNECT_SHARE)
        self.on_result = on_result
        self.breaker = breaker or Breaker()
        self.rounds = 0
        self.first_round = asyncio.Event()  # set once every backend has been checked

    async def check(self, backend: Backend) -> CheckResult:
        """One ``GET /health``. A connect timeout is a failure: only a backend that accepted the
        connection and then stayed silent may be a busy one."""
        try:
            async with self.session.get(backend.endpoint("/health"), timeout=self.timeout) as r:
                await r.read()
                return CheckResult.OK if r.status == 200 else CheckResult.FAILED
        except aiohttp.ConnectionTimeoutError:  # a subclass of TimeoutError: first
            return CheckResult.FAILED
        except asyncio.TimeoutError:
            return CheckResult.TIMED_OUT
        except (aiohttp.ClientError, OSError):
            return CheckResult.FAILED

    async def check_all(self) -> None:
        await self.check_some([b for pool in self.pools for b in pool.backends])
        self.rounds += 1
        self.first_round.set()

    async def check_some(self, backends: list[Backend]) -> None:
        """Check ``backends`` now and apply the results (discovery calls it for new backends)."""
        roles = {pool.role: pool.backends for pool in self.pools}
        before = {id(b): b.progress for group in roles.values() for b in group}
        before.update((id(b), b.progress) for b in backends)
        results = await asyncio.gather(*(self.check(b) for b in backends))
        for backend, result in zip(backends, results, strict=True):
            if backend.draining:
                continue  # left meanwhile: no result may revive its metrics
            progressed = backend.progress != before[id(backend)]
            others = any(
                p.progress != before.get(id(p), p.progress)
                for p in roles.get(backend.role, ())
                if p is not backend
            )
            verdict = judge(result, backend, progressed, others)
            was_healthy = backend.healthy
            if verdict is Verdict.BUSY:
                self.breaker.apply(backend, verdict)
                log.info(
                    "%s backend %s: health check timed out with %d requests in flight, "
                    "judged busy (%d in a row)",
                    backend.role,
                    backend.url,
                    backend.outstanding,
                    backend.slow_checks,
                )
                continue
            if self.breaker.apply(backend, verdict):
                if backend.healthy:
                    log.warning(
                        "%s backend %s is now healthy%s",
                        backend.role,
                        backend.url,
                        " (probing: one request at a time)" if backend.probing else "",
                    )
                else:
                    hung = result is CheckResult.TIMED_OUT and backend.outstanding > 0
                    log.warning(
                        "%s backend %s is now DOWN%s",
                        backend.role,
                        backend.url,
                        f" (hung: {backend.outstanding} requests in flight stopped while "
                        "others progressed)"
                        if hung and others
                        else "",
                    )
            if (
                was_healthy
                and not backend.healthy
                and any(p.healthy for p in roles.get(backend.role, ()) if p is not backend)
            ):
                backend.move_waiters()  # with nowhere to go, its legs keep their chance here
            self.on_result(backend, verdict is Verdict.PASS)

    async def run(self) -> None:
        """Check at once, then every ``interval`` seconds, until cancelled."""
        while True:
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(self.interval)
