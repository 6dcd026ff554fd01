"""Active health: every backend's ``GET /health`` each interval, judged by the circuit breaker
(pd_proxy.backends.breaker), which tells a hung backend from a busy one by what the proxy sees."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from pd_proxy.backends.breaker import Breaker, CheckResult, Verdict, judge
from pd_proxy.backends.pool import Backend, BackendPool

# The logger keeps its name from before the split: operators' log filters match it.
log = logging.getLogger("pd_proxy.routing.pool")

# The part of a health check's time its connect may take.
CONNECT_SHARE = 0.5


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
        *,
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
