"""Backend choice and health: least outstanding requests among healthy backends, periodic checks.

Health is both active (``GET {backend}/health`` every interval) and passive (a refused connection
marks the backend down at once), so a dead backend costs at most one retried request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from yarl import URL

log = logging.getLogger("pd_proxy.pool")


class Backend:
    """One vLLM instance; ``outstanding`` counts requests on it now."""

    __slots__ = ("role", "url", "base", "healthy", "outstanding", "_urls")

    def __init__(self, role: str, url: str) -> None:
        self.role = role
        self.url = url
        self.base = URL(url)
        # Optimistic until the first check: a refused connection flips it at once anyway.
        self.healthy = True
        self.outstanding = 0
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
    """The backends of one role."""

    def __init__(self, role: str, urls: tuple[str, ...]) -> None:
        self.role = role
        self.backends = [Backend(role, u) for u in urls]
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

    async def check(self, backend: Backend) -> bool:
        try:
            async with self.session.get(backend.endpoint("/health"), timeout=self.timeout) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def check_all(self) -> None:
        backends = [b for pool in self.pools for b in pool.backends]
        results = await asyncio.gather(*(self.check(b) for b in backends))
        for backend, ok in zip(backends, results, strict=True):
            if ok != backend.healthy:
                log.warning(
                    "%s backend %s is now %s",
                    backend.role,
                    backend.url,
                    "healthy" if ok else "DOWN",
                )
            backend.healthy = ok
            self.on_result(backend, ok)
        self.rounds += 1
        self.first_round.set()

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
