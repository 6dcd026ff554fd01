"""Backend choice and health: least outstanding requests among healthy backends, periodic checks.

Health is both active (``GET {backend}/health`` every interval) and passive (a refused connection
marks the backend down at once), so a dead backend costs at most one retried request. A check
that only times out while the backend is busy with this proxy's own requests is weak evidence:
vLLM answers /health from the same event loop that streams tokens, and on a saturated host (CPU
servers sharing cores) it can miss the timeout in the middle of a long prefill. Such a backend
stays in the pool through ``BUSY_TIMEOUTS_TOLERATED`` such checks in a row (the next one takes it
out); an idle backend that times out, and any refusal or error status, is down at once.

Membership can change at run time (``BackendPool.update``, fed by pd_proxy.discovery): a backend
that no source lists any more moves to ``draining``. It gets no new requests, its in-flight ones
finish, and ``reap`` drops it once nothing is outstanding on it, so a scale-down loses no request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp
from yarl import URL

log = logging.getLogger("pd_proxy.pool")

# Timed-out checks in a row a backend with requests in flight stays healthy through.
BUSY_TIMEOUTS_TOLERATED = 2


class Backend:
    """One vLLM instance; ``outstanding`` counts requests on it now."""

    __slots__ = (
        "role",
        "url",
        "base",
        "address",
        "healthy",
        "outstanding",
        "draining",
        "slow_checks",
        "_urls",
    )

    def __init__(self, role: str, url: str, healthy: bool = True) -> None:
        self.role = role
        self.url = url
        self.base = URL(url)
        # (host, port, TLS) for pd_proxy.upstream; the host as the resolver wants it (IDNA).
        self.address = (self.base.raw_host or "", self.base.port or 80, self.base.scheme == "https")
        # Configured backends start optimistic (the first round runs before the proxy listens);
        # discovered ones start down, so none gets a request before its first check passes.
        self.healthy = healthy
        self.outstanding = 0
        self.draining = False  # left every source: no new requests, dropped once idle
        self.slow_checks = 0  # health checks in a row that timed out while it was busy
        self._urls: dict[str, URL] = {}

    def endpoint(self, path: str) -> URL:
        """Absolute URL of ``path`` on this backend (keeps any base path prefix); cached."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.base.with_path(self.base.path.rstrip("/") + path)
        return url

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
        self._next = 0

    def pick(self, exclude: Backend | None = None) -> Backend | None:
        """Healthy backend with the fewest outstanding requests; ties rotate round-robin.

        The rotation restarts just after the last choice, so a dead backend's turn does not fall
        to its neighbour every time.
        """
        backends = self.backends
        n = len(backends)
        start = self._next
        best: Backend | None = None
        best_i = 0
        for i in range(start, start + n):
            b = backends[i % n]
            if (
                b.healthy
                and b is not exclude
                and (best is None or b.outstanding < best.outstanding)
            ):
                best, best_i = b, i
        if best is not None:
            self._next = (best_i + 1) % n
        return best

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
    """Polls every backend of every pool; ``on_change(backend)`` is called on each transition."""

    def __init__(
        self,
        pools: list[BackendPool],
        session: aiohttp.ClientSession,
        interval: float,
        timeout: float,
        on_result: Callable[[Backend, bool], None],
    ) -> None:
        self.pools = pools
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.on_result = on_result
        self.rounds = 0
        self.first_round = asyncio.Event()  # set once every backend has been checked

    async def check(self, backend: Backend) -> bool | None:
        """True: healthy; False: refused, reset or an error status; None: no answer in time."""
        try:
            async with self.session.get(backend.endpoint("/health"), timeout=self.timeout) as r:
                await r.read()
                return r.status == 200
        except asyncio.TimeoutError:
            return None
        except (aiohttp.ClientError, OSError):
            return False

    async def check_all(self) -> None:
        await self.check_some([b for pool in self.pools for b in pool.backends])
        self.rounds += 1
        self.first_round.set()

    async def check_some(self, backends: list[Backend]) -> None:
        """Check ``backends`` now and apply the results (discovery calls it for new backends)."""
        results = await asyncio.gather(*(self.check(b) for b in backends))
        for backend, result in zip(backends, results, strict=True):
            if backend.draining:
                continue  # left meanwhile: no result may revive its metrics
            if result is None and busy_and_tolerated(backend):
                backend.slow_checks += 1
                log.info(
                    "%s backend %s: health check timed out with %d requests in flight (%d/%d)",
                    backend.role,
                    backend.url,
                    backend.outstanding,
                    backend.slow_checks,
                    BUSY_TIMEOUTS_TOLERATED,
                )
                continue
            backend.slow_checks = 0
            ok = bool(result)
            if ok != backend.healthy:
                log.warning(
                    "%s backend %s is now %s",
                    backend.role,
                    backend.url,
                    "healthy" if ok else "DOWN",
                )
            backend.healthy = ok
            self.on_result(backend, ok)

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


def busy_and_tolerated(backend: Backend) -> bool:
    """A timed-out check that leaves ``backend`` in the pool: it is serving requests of ours and
    has not yet had ``BUSY_TIMEOUTS_TOLERATED`` slow checks in a row."""
    return (
        backend.healthy
        and backend.outstanding > 0
        and backend.slow_checks < BUSY_TIMEOUTS_TOLERATED
    )
