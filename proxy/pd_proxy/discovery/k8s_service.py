"""Backends from a Kubernetes Service's EndpointSlices, watched through the API server.

DNS learns that a pod left only after the resolver's cache (CoreDNS: 30 s by default) and the
next poll; the API server says so at once, with the reason. Each endpoint carries conditions:

- ``terminating``: the pod is being deleted (its preStop sleep runs). It leaves the pool, so it
  gets no new request, while requests already on it finish (pd_proxy.backends.pool drains it);
- ``ready`` (``serving`` and not terminating): it takes requests; unknown counts as ready, as the
  API asks consumers to do;
- ``serving``: logged, to tell a terminating pod that still answers from one that stopped.

``targetRef`` names the pod: it appears in the log lines, and an address that comes back for a
different pod (a reused IP) is checked again before it gets traffic.

One watch per role: LIST the slices with ``kubernetes.io/service-name=<service>``, then WATCH from
the list's ``resourceVersion`` with bookmarks, resume from the last version seen when the server
ends the stream, LIST again on ``410 Gone`` (an ``ERROR`` event or the HTTP status: servers send
either; with backoff when it answers the very version a LIST just gave, which listing again at
once cannot fix), and retry with backoff on any other error; a successful LIST resets the
backoff, so one failure after hours of good service is retried at once. While the API cannot be
reached the pool keeps what it had (pd_proxy.discovery.watch counts and logs the outage). The watch
runs as a task that only ends when closed: if a bug ends it anyway, the next poll logs the
exception, reports an outage and starts it again (a dead task would otherwise freeze the pool
silently). The proxy's ServiceAccount needs ``list`` and ``watch`` on ``endpointslices`` in the
namespace, no more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pd_proxy.config.service_ref import ServiceRef
from pd_proxy.discovery.address import DiscoveryError, address_url
from pd_proxy.discovery.kube_api import InCluster, KubeApiError, KubeClient

log = logging.getLogger("pd_proxy.discovery.watch")

SERVICE_LABEL = "kubernetes.io/service-name"
# The server ends each watch after this long; the next one resumes from the last version.
WATCH_TIMEOUT_S = 240
LIST_TIMEOUT_S = 10.0
RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0
# How long the first poll waits for the first LIST before it reports an outage.
FIRST_SYNC_S = 5.0


@dataclass(frozen=True)
class Endpoint:
    """One address of a slice, as the proxy reads it."""

    url: str
    pod: str | None
    uid: str | None
    ready: bool
    serving: bool
    terminating: bool

    @property
    def wanted(self) -> bool:
        """Takes new requests: ready and not on its way out."""
        return self.ready and not self.terminating

    def describe(self) -> str:
        return f"pod {self.pod or '?'} ({self.url})"


def _condition(conditions: dict[str, Any], name: str, unknown: bool) -> bool:
    value = conditions.get(name)
    return unknown if value is None else bool(value)


def _slice_port(ports: list[dict[str, Any]], want: str | int | None) -> int | None:
    if isinstance(want, int):
        return want
    if want is None:
        return int(ports[0]["port"]) if len(ports) == 1 and ports[0].get("port") else None
    for port in ports:
        if port.get("name") == want and port.get("port"):
            return int(port["port"])
    return None


def slice_endpoints(obj: dict[str, Any], want_port: str | int | None) -> list[Endpoint]:
    """The endpoints of one EndpointSlice on the wanted port (none if it lacks that port)."""
    if obj.get("addressType") not in (None, "IPv4", "IPv6"):
        return []  # FQDN slices are for ExternalName-like services
    port = _slice_port(obj.get("ports") or [], want_port)
    if port is None:
        return []
    found = []
    for ep in obj.get("endpoints") or []:
        addresses = ep.get("addresses") or []
        url = address_url(str(addresses[0]), port) if addresses else None
        if url is None:
            continue
        conditions = ep.get("conditions") or {}
        terminating = _condition(conditions, "terminating", False)
        ready = _condition(conditions, "ready", not terminating)
        ref = ep.get("targetRef") or {}
        found.append(
            Endpoint(
                url=url,
                pod=ref.get("name"),
                uid=ref.get("uid"),
                ready=ready,
                serving=_condition(conditions, "serving", ready),
                terminating=terminating,
            )
        )
    return found


class EndpointSliceWatch:
    """One role's Service, for pd_proxy.discovery.watch (same ``poll``/``close`` as the other
    watches)."""

    source = "k8s"

    def __init__(
        self,
        role: str,
        service: ServiceRef,
        cluster: InCluster,
        first_sync: float | None = None,
        watch_timeout: int = WATCH_TIMEOUT_S,
    ) -> None:
        namespace = service.namespace or cluster.namespace
        if namespace is None:
            raise ValueError(f"{service}: no namespace given and none mounted for the pod")
        self.role = role
        self.roles: tuple[str, ...] = (role,)
        self.service = ServiceRef(service.name, namespace, service.port)
        self.cluster = cluster
        self.first_sync = FIRST_SYNC_S if first_sync is None else first_sync
        self.watch_timeout = watch_timeout
        self.on_change: Callable[[], None] | None = None  # set by Discovery: poll again now
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.selector = f"{SERVICE_LABEL}={service.name}"
        self._slices: dict[str, dict[str, Any]] = {}
        self._version = 0  # bumped on every change of the slices
        self._polled = -1  # the version the last poll returned
        self._synced = asyncio.Event()  # the first LIST succeeded
        self._settled = asyncio.Event()  # the first LIST succeeded or failed
        self._error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._pods: dict[str, str | None] = {}  # url -> pod uid, as last polled
        self._states: dict[str, tuple[bool, bool, bool]] = {}  # url -> conditions, for the log
        self._replaced: list[str] = []
        self.resource_version: str | None = None  # the last one seen (tests, debugging)
        self.lists = 0  # completed LISTs: 1 + relists after 410 Gone or errors
        self.restarts = 0  # times the watch task ended by itself and was started again
        self._closed = False

    @property
    def label(self) -> str:
        return f"{self.role} Service {self.service}"

    # ------------------------------------------------------------------ Discovery's interface
    async def poll(self) -> dict[str, list[str]] | None:
        task = self._task
        if task is None:
            task = self._start()
            settled = asyncio.ensure_future(self._settled.wait())
            try:  # the first LIST, its failure, or the task's end (a bug): whichever comes first
                await asyncio.wait(
                    {settled, task}, timeout=self.first_sync, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                settled.cancel()
        if task.done():
            self._revive(task)
        if self._error is not None:
            raise DiscoveryError(self._error)
        if not self._synced.is_set():
            raise DiscoveryError(f"no list from the API server within {self.first_sync:g}s")
        if self._version == self._polled:
            return None
        self._polled = self._version
        return {self.role: self._current()}

    def replaced(self) -> list[str]:
        """URLs whose pod changed since the last poll (a reused IP): check them again."""
        urls, self._replaced = self._replaced, []
        return urls

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ the watch task
    def _start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._run(), name=f"pd-proxy-k8s-{self.role}")
        self._task.add_done_callback(self._ended)
        return self._task

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The task only ends when closed: otherwise wake Discovery, whose poll revives it."""
        if not self._closed and self.on_change is not None:
            self.on_change()

    def _revive(self, task: asyncio.Task[None]) -> None:
        """Log why the task ended, start a new one (it lists again) and report an outage until
        that LIST succeeds; the pool keeps its backends meanwhile."""
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            why = "cancelled"
        else:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.error(
            "%s: the EndpointSlice watch stopped (%s); starting it again",
            self.label,
            why,
            exc_info=exc,
        )
        self.restarts += 1
        self._error = f"the EndpointSlice watch stopped ({why}); restarted, listing again"
        self._start()

    # ------------------------------------------------------------------ the endpoint set
    def _current(self) -> list[str]:
        endpoints: dict[str, Endpoint] = {}
        for obj in self._slices.values():
            for ep in slice_endpoints(obj, self.service.port):
                endpoints.setdefault(ep.url, ep)
        for url, ep in endpoints.items():
            self._log_transition(ep)
            before = self._pods.get(url)
            if before is not None and ep.uid is not None and before != ep.uid:
                log.info("%s: %s replaces another pod at that address", self.label, ep.describe())
                self._replaced.append(url)
        self._pods = {url: ep.uid for url, ep in endpoints.items()}
        self._states = {url: state for url, state in self._states.items() if url in endpoints}
        return sorted(url for url, ep in endpoints.items() if ep.wanted)

    def _log_transition(self, ep: Endpoint) -> None:
        state = (ep.ready, ep.serving, ep.terminating)
        if self._states.get(ep.url) == state:
            return
        self._states[ep.url] = state
        if ep.terminating:
            still = "still serving" if ep.serving else "no longer serving"
            log.info(
                "%s: %s is terminating (%s): no new requests", self.label, ep.describe(), still
            )
        elif not ep.ready:
            log.info("%s: %s is not ready", self.label, ep.describe())
        else:
            log.debug("%s: %s is ready", self.label, ep.describe())

    def _changed(self) -> None:
        self._version += 1
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------------ list + watch
    async def _run(self) -> None:
        delay = RETRY_MIN_S
        stuck = was_stuck = False  # 410 Gone right after the (previous) LIST
        async with aiohttp.ClientSession(
            skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar()
        ) as session:
            client = KubeClient(self.cluster, session)
            while True:
                try:
                    await self._list(client)
                    if not stuck:
                        delay = RETRY_MIN_S  # it works again: the next failure is retried soon
                    was_stuck, stuck = stuck, False
                    await self._watch(client)  # returns only by raising
                except _Gone as gone:
                    if not gone.fresh:
                        log.debug(
                            "%s: resourceVersion too old (410 Gone): listing again", self.label
                        )
                        continue
                    # Gone for the version the LIST just gave: listing again at once would loop.
                    if not was_stuck:
                        log.warning(
                            "%s: the API server answers 410 Gone to a watch from the version its "
                            "list just returned; listing again with backoff",
                            self.label,
                        )
                    stuck = True
                except (KubeApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    self._fail(str(exc) or type(exc).__name__)
                except ValueError as exc:  # JSON that is not what the API returns
                    self._fail(f"unexpected answer: {exc}")
                log.debug("%s: retrying in %gs", self.label, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    def _fail(self, reason: str) -> None:
        self._settled.set()
        if self._error != reason:
            self._error = reason
            self._changed()  # so the next round reports it

    async def _list(self, client: KubeClient) -> None:
        doc = await client.list(self.path, {"labelSelector": self.selector}, LIST_TIMEOUT_S)
        self._slices = {
            item["metadata"]["name"]: item for item in doc.get("items") or [] if _named(item)
        }
        version = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        self.resource_version = version
        self.lists += 1
        self._error = None
        self._synced.set()
        self._settled.set()
        self._changed()

    async def _watch(self, client: KubeClient) -> None:
        """Watch from the last version seen, again each time the server ends the stream."""
        fresh = True  # no event and no stream since the LIST: a 410 now is the server's fault
        while True:
            params = {
                "labelSelector": self.selector,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(self.watch_timeout),
            }
            if self.resource_version:
                params["resourceVersion"] = self.resource_version
            try:
                async for event in client.watch(self.path, params, self.watch_timeout + 30.0):
                    self._apply(event)
                    fresh = False
            except _Gone as gone:
                gone.fresh = fresh
                raise
            except KubeApiError as exc:
                if exc.status == 410:  # the answer's status instead of an ERROR event
                    raise _Gone(fresh) from exc
                raise
            fresh = False

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event["type"], event["object"]
        if kind != "ERROR" and not isinstance(obj, dict):
            raise ValueError(f"a {kind} watch event whose object is not a JSON object")
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                raise _Gone()
            message = obj.get("message") if isinstance(obj, dict) else obj
            raise KubeApiError(f"watch error {code}: {message}", code)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        if kind == "BOOKMARK" or not _named(obj):
            return
        name = obj["metadata"]["name"]
        if kind in ("ADDED", "MODIFIED"):
            self._slices[name] = obj
        elif kind == "DELETED":
            self._slices.pop(name, None)
        else:
            return
        if self._error is not None:
            self._error = None
        self._changed()


class _Gone(Exception):
    """The watch's resourceVersion is older than the server keeps: list again. ``fresh``: it came
    right after a LIST, for the version that LIST returned."""

    def __init__(self, fresh: bool = False) -> None:
        super().__init__("410 Gone")
        self.fresh = fresh


def _named(obj: Any) -> bool:
    return isinstance(obj, dict) and bool((obj.get("metadata") or {}).get("name"))
