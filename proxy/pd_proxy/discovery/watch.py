"""Backend discovery: DNS names, an endpoints file and Kubernetes Services, every
``discovery_interval`` or at once when a source says it changed.

A Kubernetes Service (``--prefill-k8s-service`` / ``--decode-k8s-service``) is watched through the
API server (pd_proxy.discovery.k8s_service): a terminating pod leaves its pool as soon as the API
says so,
not after a DNS cache. A DNS name (``--prefill-dns`` / ``--decode-dns``, e.g. a headless
Service) is resolved to its A and AAAA records and each address becomes ``http://ADDR:PORT``; the
endpoints file (pd_proxy.discovery.endpoints_file) is re-read when its stat signature changes. What
a source
finds replaces what it found before in its role's ``BackendPool``: new backends join once a health
check passes, gone ones drain (pd_proxy.backends.pool).

Discovery never empties a pool. A name that stops resolving (NXDOMAIN, SERVFAIL, timeout) or
resolves to nothing, a file that goes missing, malformed or drops every endpoint of a role, and an
API server that cannot be reached or lists no ready endpoint, keep the last known backends: during
such an outage the backends are most likely still there, and health checks still take dead ones
out. Each such outage logs one warning (the file: one per bad edit) and a line when it ends, and
counts ``pd_proxy_discovery_errors_total`` on every poll.

The resolver is injectable: production uses the event loop's ``getaddrinfo`` (the system
resolver, so ``/etc/hosts``, search domains and ndots apply as for any process), tests a UDP
client for a DNS server they control (pd_proxy.testing.dns).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.config import ROLES, ProxyConfig, split_host_port
from pd_proxy.config.service_ref import parse_service_ref
from pd_proxy.discovery.address import DiscoveryError, address_url
from pd_proxy.discovery.endpoints_file import read_endpoints_file, stat_signature
from pd_proxy.discovery.k8s_service import EndpointSliceWatch
from pd_proxy.discovery.kube_api import InCluster
from pd_proxy.metrics import ProxyMetrics

__all__ = ["Discovery", "DiscoveryError", "DnsWatch", "FileWatch", "address_url", "system_resolver"]

log = logging.getLogger("pd_proxy.discovery.watch")

# host -> its addresses; raises (any exception) when the name does not resolve.
Resolver = Callable[[str], Awaitable[Sequence[str]]]
# Bounds one resolution, whatever the resolver's own timeouts are.
RESOLVE_TIMEOUT_S = 5.0


async def system_resolver(host: str) -> list[str]:
    """The A and AAAA addresses of ``host`` from ``getaddrinfo``, in its order, without repeats."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class DnsWatch:
    """One role's DNS name."""

    source = "dns"

    def __init__(
        self, role: str, target: str, resolver: Resolver, timeout: float = RESOLVE_TIMEOUT_S
    ) -> None:
        self.role = role
        self.target = target
        self.host, self.port = split_host_port(target)
        self.resolver = resolver
        self.timeout = timeout
        self.roles: tuple[str, ...] = (role,)
        self._pending: asyncio.Future[Sequence[str]] | None = None

    @property
    def label(self) -> str:
        return f"{self.role} DNS name {self.target}"

    async def poll(self) -> dict[str, list[str]] | None:
        lookup = self._pending
        if lookup is None or lookup.done():
            if lookup is not None and not lookup.cancelled():
                lookup.exception()  # consumed: a late failure is not "never retrieved"
            lookup = self._pending = asyncio.ensure_future(self.resolver(self.host))
        try:
            # A lookup that outlives the timeout keeps running (getaddrinfo cannot be stopped:
            # it holds an executor thread) and the next poll waits on it, so hung lookups never
            # pile up.
            addresses = await asyncio.wait_for(asyncio.shield(lookup), self.timeout)
        except asyncio.TimeoutError:
            raise DiscoveryError(f"no answer within {self.timeout:g}s") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # gaierror, a test resolver's errors: all mean "no answer"
            raise DiscoveryError(str(exc) or type(exc).__name__) from None
        urls = [u for u in (address_url(a, self.port) for a in addresses) if u is not None]
        if not urls:
            raise DiscoveryError("resolves to no addresses")
        return {self.role: list(dict.fromkeys(urls))}

    def close(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()

    def replaced(self) -> list[str]:
        return []  # a name's records carry no identity


class FileWatch:
    """The endpoints file; ``poll`` is None while the file is unchanged since its last good read."""

    source = "file"

    def __init__(self, path: str) -> None:
        self.path = path
        self.roles: tuple[str, ...] = ROLES
        self._signature: tuple[int, int, int, int] | None = None

    def close(self) -> None:
        pass

    def replaced(self) -> list[str]:
        return []

    @property
    def label(self) -> str:
        return f"endpoints file {self.path}"

    async def poll(self) -> dict[str, list[str]] | None:
        try:
            signature = stat_signature(self.path)
        except OSError as exc:
            raise DiscoveryError(f"cannot stat it: {exc.strerror or exc}") from None
        if signature == self._signature:
            return None
        try:
            found = read_endpoints_file(self.path)
        except ValueError as exc:  # EndpointsFileError
            raise DiscoveryError(str(exc)) from None
        # Stat before read: a write racing the read changes the signature again, so it is re-read.
        self._signature = signature
        return {role: list(urls) for role, urls in found.items()}


Watch = DnsWatch | FileWatch | EndpointSliceWatch


class Discovery:
    """Polls every watch and feeds the pools; ``run`` loops until cancelled."""

    def __init__(
        self,
        pools: dict[str, BackendPool],
        watches: list[Watch],
        interval: float,
        metrics: ProxyMetrics,
    ) -> None:
        self.pools = pools
        self.watches = watches
        self.interval = interval
        self.metrics = metrics
        self.polls = 0  # completed refresh rounds, for tests and debugging
        self._last: dict[tuple[str, str], list[str]] = {}  # (role, source) -> last good URLs
        # (watch label, role or None) -> the reason of the outage it is in
        self._failing: dict[tuple[str, str | None], str] = {}
        # A watch that learns of a change by itself (the Kubernetes API) wakes the loop at once.
        self._wake = asyncio.Event()
        for watch in watches:
            if isinstance(watch, EndpointSliceWatch):
                watch.on_change = self._wake.set
        metrics.track_discovery((role, w.source) for w in watches for role in w.roles)

    @classmethod
    def from_config(
        cls,
        config: ProxyConfig,
        pools: dict[str, BackendPool],
        metrics: ProxyMetrics,
        resolver: Resolver | None = None,
    ) -> Discovery | None:
        """The config's watches, or None when nothing is discovered."""
        if not config.discovery:
            return None
        watches: list[Watch] = []
        cluster: InCluster | None = None
        for role in ROLES:
            target = getattr(config, f"{role}_dns")
            if target is not None:
                watches.append(DnsWatch(role, target, resolver or system_resolver))
            service = getattr(config, f"{role}_k8s_service")
            if service is not None:
                cluster = cluster or InCluster.from_environment()
                watches.append(EndpointSliceWatch(role, parse_service_ref(service), cluster))
        if config.endpoints_file is not None:
            watches.append(FileWatch(config.endpoints_file))
        return cls(pools, watches, config.discovery_interval, metrics)

    async def refresh(self) -> list[Backend]:
        """Poll every watch once, update the pools and drop drained backends; returns joiners.

        Watches are polled together, so one slow name delays a round by its timeout, not more.
        """
        results = await asyncio.gather(*(w.poll() for w in self.watches), return_exceptions=True)
        added: list[Backend] = []
        for watch, found in zip(self.watches, results, strict=True):
            if isinstance(found, DiscoveryError):
                self._fail(watch, None, str(found))
                continue
            if isinstance(found, BaseException):
                raise found  # a bug, or cancellation: not a discovery outage
            self._recover(watch, None)
            if found is not None:
                for role, urls in found.items():
                    added += self._apply(watch, role, urls)
            added += self._recheck(watch)
        for role, pool in self.pools.items():
            for backend in pool.reap():
                self.metrics.forget_backend(role, backend.url)
        self.polls += 1
        return added

    def _apply(self, watch: Watch, role: str, urls: list[str]) -> list[Backend]:
        key = (role, watch.source)
        last = self._last.get(key, [])
        if not urls:
            if last:  # a file that lost a role's last endpoint: keep them, as for DNS
                self._fail(watch, role, f"lists no {role} endpoint")
            return []
        self._recover(watch, role)
        if urls == last:
            return []
        self._last[key] = urls
        return self.pools[role].update(watch.source, urls)

    def _recheck(self, watch: Watch) -> list[Backend]:
        """Backends whose address now belongs to another pod: down until a check passes."""
        again = []
        for url in watch.replaced():
            for role in watch.roles:
                for backend in self.pools[role].backends:
                    if backend.url == url:
                        backend.healthy = False
                        again.append(backend)
        return again

    def _fail(self, watch: Watch, role: str | None, reason: str) -> None:
        roles = (role,) if role else self._covered(watch)
        for r in roles:
            self.metrics.discovery_error(r, watch.source)
        key = (watch.label, role)
        previous = self._failing.get(key)
        # Once per outage; for the file also once per new mistake, since each edit is news.
        if previous is not None and (watch.source != "file" or previous == reason):
            log.debug("%s: %s", watch.label, reason)
            return
        self._failing[key] = reason
        kept = {r: len(self._last.get((r, watch.source), [])) for r in roles}
        log.warning(
            "%s: %s; keeping the last known backends (%s) until it recovers",
            watch.label,
            reason,
            ", ".join(f"{r}: {n}" for r, n in kept.items()),
        )

    def _recover(self, watch: Watch, role: str | None) -> None:
        key = (watch.label, role)
        if self._failing.pop(key, None) is not None:
            log.info("%s%s: discovery works again", watch.label, f" ({role})" if role else "")

    def _covered(self, watch: Watch) -> tuple[str, ...]:
        """The roles a failing watch feeds: those it found backends for, else all it could."""
        have = tuple(r for r in watch.roles if self._last.get((r, watch.source)))
        return have or watch.roles

    def close(self) -> None:
        """Stop lookups still running (the app is stopping)."""
        for watch in self.watches:
            watch.close()

    async def run(self, check: Callable[[list[Backend]], Awaitable[None]]) -> None:
        """After the start-up ``refresh``: poll every interval, or at once when a watch reports a
        change, and health-check the joiners with ``check``."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            try:
                added = await self.refresh()
                if added:
                    await check(added)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop discovery for good
                log.exception("discovery round failed")
