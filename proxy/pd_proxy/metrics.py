"""Prometheus metrics for one proxy app, on its own registry.

A per-app ``CollectorRegistry`` (not the process-global one) lets several proxies live in one test
process and keeps the exposition free of unrelated collectors. Label children that are known up
front are created once so the request path does no label lookups for them.

``_created`` series (one per counter and histogram child) are left out of the exposition unless
``created=True`` (``--metrics-created``); the filter is per registry, not prometheus_client's
process-wide switch, so proxies with either setting can share a process.

With ``--workers N`` each worker process runs with ``PROMETHEUS_MULTIPROC_DIR`` set by the parent
(pd_proxy.workers.supervisor), so prometheus_client keeps every value in a per-process file there,
and
``render()`` merges the files of all workers: counters and histograms are summed (a worker that
died keeps its counts), in-flight requests are summed over live workers, and the per-backend and
per-role gauges show the most recent worker's value. Values a function computes at scrape time in
one process (in-flight requests, backends per state) are written to the files by ``sync()``, once
a second and before each scrape.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from pd_proxy.backends.route import LOCAL, PD

# Names other tools read (the kit's demo report and eval manifest) import these, not a copy.
REQUESTS_TOTAL = "pd_proxy_requests_total"
BACKEND_ERRORS_TOTAL = "pd_proxy_backend_errors_total"
# Family names exactly as they appear in the text exposition (``# TYPE`` lines).
METRIC_NAMES: tuple[str, ...] = (
    REQUESTS_TOTAL,
    "pd_proxy_in_flight_requests",
    "pd_proxy_prefill_duration_seconds",
    "pd_proxy_decode_ttfb_seconds",
    "pd_proxy_time_to_first_byte_seconds",
    "pd_proxy_request_duration_seconds",
    BACKEND_ERRORS_TOTAL,
    "pd_proxy_retries_total",
    "pd_proxy_backend_healthy",
    "pd_proxy_backends",
    "pd_proxy_discovery_errors_total",
    "pd_proxy_first_token_requests_total",
    "pd_proxy_refused_total",
    "pd_proxy_fanout_requests_total",
    "pd_proxy_fanout_legs_total",
)
BACKEND_STATES = ("healthy", "unhealthy", "draining")
# Why a leg went again (pd_proxy.http.exchange).
RETRY_REASONS = ("unreachable", "unhealthy", "broken", "stale_connection")
# How a completions request was served: through a prefill, or by decode alone
# (pd_proxy.routing.shapes,
# --local-prefill-max-tokens).
PATHS = (PD, LOCAL)

# Loopback legs take milliseconds, real CPU/GPU prefill and KV transfer seconds to minutes.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# How often a worker writes its scrape-time gauges to the shared files (multiprocess mode).
SYNC_INTERVAL_S = 1.0
# Metric types whose children carry a ``_created`` sample.
_WITH_CREATED = ("counter", "histogram", "summary", "gaugehistogram")


def multiprocess_dir() -> str | None:
    """The shared metrics directory when prometheus_client runs in multiprocess mode, else None.

    The mode is fixed when prometheus_client is imported (from ``PROMETHEUS_MULTIPROC_DIR``), so
    both the import-time choice and the directory must agree.
    """
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path and values.ValueClass is not values.MutexValue:
        return path
    return None


class _WithoutCreated:
    """A view of a registry whose exposition drops the ``_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            if metric.type in _WITH_CREATED:
                created = metric.name + "_created"
                metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class CountedPool(Protocol):
    """What the backends gauge reads from a pool (pd_proxy.backends.pool.BackendPool)."""

    role: str

    def count(self, state: str) -> int: ...


class ProxyMetrics:
    """The proxy's metric families; ``render()`` gives the exposition for ``GET /metrics``."""

    def __init__(
        self, prefill: Iterable[str], decode: Iterable[str], created: bool = False
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.created = created
        self.multiprocess_dir = multiprocess_dir()
        self._pools: list[CountedPool] = []
        self.requests = Counter(
            "pd_proxy_requests",
            "Client requests by endpoint, HTTP status (499: client left) and path: pd (through a "
            "prefill; refusals and errors before any backend too), local (decode alone), or "
            "empty for the side endpoints.",
            ("endpoint", "status", "path"),
            registry=reg,
        )
        self.in_flight = Gauge(
            "pd_proxy_in_flight_requests",
            "Client requests being served now.",
            registry=reg,
            multiprocess_mode="livesum",
        )
        # A plain int that pd_flow bumps, read only at scrape time: no lock or call per request.
        self.in_flight_count = 0
        self.in_flight.set_function(lambda: self.in_flight_count)
        self.prefill_duration = Histogram(
            "pd_proxy_prefill_duration_seconds",
            "Prefill leg latency, request sent to JSON read.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.decode_ttfb = Histogram(
            "pd_proxy_decode_ttfb_seconds",
            "Decode leg time to first body byte (includes the KV transfer).",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.time_to_first_byte = Histogram(
            "pd_proxy_time_to_first_byte_seconds",
            "Client request received to the first byte of a 200 answer sent back (a stream's "
            "first event, or a whole JSON answer): the client-visible time to first token, by "
            "path (pd, local: see pd_proxy_requests_total).",
            ("path",),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttfb_by_path = {p: self.time_to_first_byte.labels(p) for p in PATHS}
        self.request_duration = Histogram(
            "pd_proxy_request_duration_seconds",
            "End-to-end client request latency.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.backend_errors = Counter(
            "pd_proxy_backend_errors",
            "Backend failures (connect, timeout, 5xx, broken stream).",
            ("stage", "backend"),
            registry=reg,
        )
        self.retries = Counter(
            "pd_proxy_retries",
            "Legs sent again, by stage and reason: unreachable (connection refused: another "
            "backend), unhealthy (its backend went down while the prefill leg waited: another), "
            "broken (the connection broke before a prefill answer: another), stale_connection "
            "(a reused connection closed before any answer: the same backend, a new connection).",
            ("stage", "reason"),
            registry=reg,
        )
        for stage in ("prefill", "decode"):
            for reason in RETRY_REASONS:
                self.retries.labels(stage, reason)
        self.backend_healthy = Gauge(
            "pd_proxy_backend_healthy",
            "1 when the backend's last health check passed.",
            ("role", "backend"),
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.backends = Gauge(
            "pd_proxy_backends",
            "Backends per role: healthy and unhealthy ones take part, draining ones only finish "
            "their in-flight requests.",
            ("role", "state"),
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.discovery_errors = Counter(
            "pd_proxy_discovery_errors",
            "Failed discovery polls (DNS name not resolving or empty, endpoints file unreadable, "
            "malformed or missing a role); the last known backends stay.",
            ("role", "source"),
            registry=reg,
        )
        self.first_token = Counter(
            "pd_proxy_first_token_requests",
            "Requests under --first-token-from-prefill by outcome: continued (token 1 from "
            "prefill, the rest from decode), finished (token 1 ended the request), normal (the "
            "normal flow; reason: the request parameter or prefill answer that needed it).",
            ("outcome", "reason"),
            registry=reg,
        )
        self.refused = Counter(
            "pd_proxy_refused",
            "Requests refused before any backend was touched, by the shape that P/D cannot "
            "serve (reason: its name in pd_proxy/routing/shapes.yaml).",
            ("reason",),
            registry=reg,
        )
        self.fanout_requests = Counter(
            "pd_proxy_fanout_requests",
            "Client requests served as one P/D request per choice, by shape (n, prompt_list, "
            "prompt_token_id_lists).",
            ("shape",),
            registry=reg,
        )
        self.fanout_legs = Counter(
            "pd_proxy_fanout_legs",
            "P/D requests that fan-outs made, by shape.",
            ("shape",),
            registry=reg,
        )
        self._request_children: dict[tuple[str, int, str], Counter] = {}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                self.backend_healthy.labels(role, url).set(1)

    def count_request(self, endpoint: str, status: int, path: str = "") -> None:
        key = (endpoint, status, path)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(endpoint, str(status), path)
        child.inc()

    def track_pools(self, pools: Iterable[CountedPool]) -> None:
        """Read the backends gauge from ``pools`` at scrape time: nothing to keep in step."""
        pools = list(pools)
        self._pools.extend(pools)
        for pool in pools:
            for state in BACKEND_STATES:
                self.backends.labels(pool.role, state).set_function(
                    functools.partial(pool.count, state)
                )

    def track_discovery(self, sources: Iterable[tuple[str, str]]) -> None:
        """Show each configured (role, source) error counter at 0 before its first error."""
        for role, source in sources:
            self.discovery_errors.labels(role, source)

    def discovery_error(self, role: str, source: str) -> None:
        self.discovery_errors.labels(role, source).inc()

    def forget_backend(self, role: str, backend: str) -> None:
        """A dropped backend's health series goes (its error counts stay, as counters should)."""
        self.backend_healthy.remove(role, backend)

    def backend_error(self, stage: str, backend: str) -> None:
        self.backend_errors.labels(stage, backend).inc()

    def retry(self, stage: str, reason: str) -> None:
        self.retries.labels(stage, reason).inc()

    def set_health(self, role: str, backend: str, healthy: bool) -> None:
        self.backend_healthy.labels(role, backend).set(1 if healthy else 0)

    def sync(self) -> None:
        """Write the scrape-time gauges' values to the shared files (multiprocess mode only)."""
        if self.multiprocess_dir is None:
            return
        self.in_flight.set(self.in_flight_count)
        for pool in self._pools:
            for state in BACKEND_STATES:
                self.backends.labels(pool.role, state).set(pool.count(state))

    def render(self) -> bytes:
        if self.multiprocess_dir is not None:
            self.sync()
            merged = CollectorRegistry()
            MultiProcessCollector(merged, self.multiprocess_dir)  # no _created series there
            return generate_latest(merged)
        if self.created:
            return generate_latest(self.registry)
        return generate_latest(_WithoutCreated(self.registry))
