"""Admission's Prometheus series, on the app's registry.

Flow labels come from the key file (a bounded set) or, behind a gateway, from a trusted header
(thousands of keys): past ``max_flow_labels`` (``--max-flow-labels``) distinct names the rest
share the label ``other``, as llm-d caps its ``fairness_id``. A label whose flow has nothing
queued and sent nothing for ``FLOW_LABEL_IDLE_S`` is given up (its series go) when a new flow
needs one, so the labels follow the flows of the last minutes, not the first ones ever seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Outcomes and their reasons (pd_proxy_admission_total's labels).
ADMITTED, REFUSED, LEFT = "admitted", "refused", "left"
NOW, QUEUED = "now", "queued"  # admitted at once, or after waiting in the queue
QUEUE_FULL = "queue_full"  # the queue, or this flow's share of it, is full
QUEUE_WAIT = "queue_wait"  # the predicted wait is past --queue-timeout
QUEUE_TIMEOUT = "queue_timeout"  # it waited --queue-timeout without room
NO_BACKEND = "no_backend"  # no healthy replica of a role it needs (503)
CLIENT_GONE = "client_gone"  # the client left while it waited
OUTCOMES = (
    (ADMITTED, NOW),
    (ADMITTED, QUEUED),
    (REFUSED, QUEUE_FULL),
    (REFUSED, QUEUE_WAIT),
    (REFUSED, QUEUE_TIMEOUT),
    (REFUSED, NO_BACKEND),
    (LEFT, CLIENT_GONE),
)
KINDS = ("requests", "tokens", "pulls")
MAX_FLOW_LABELS = 100  # --max-flow-labels' default
FLOW_LABEL_IDLE_S = 600.0
OTHER = "other"
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)


class AdmissionMetrics:
    def __init__(
        self,
        reg: CollectorRegistry,
        max_flow_labels: int = MAX_FLOW_LABELS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_flow_labels = max_flow_labels
        self.clock = clock
        self.outcomes = Counter(
            "pd_proxy_admission",
            "Requests by admission outcome and reason: admitted now or after queueing; refused "
            "(429: queue_full, queue_wait, queue_timeout; 503: no_backend); left while queued.",
            ("outcome", "reason"),
            registry=reg,
        )
        for outcome, reason in OUTCOMES:
            self.outcomes.labels(outcome, reason)
        self.depth = Gauge(
            "pd_proxy_queue_depth",
            "Requests waiting in pd-proxy's admission queue, by flow.",
            ("flow",),
            registry=reg,
        )
        self.wait = Histogram(
            "pd_proxy_queue_wait_seconds",
            "Time each request waited for admission before it was admitted, refused or left, by "
            "flow (0 for one admitted at once).",
            ("flow",),
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        self._rows: Callable[[], Iterable[tuple[str, str, str, int]]] = tuple
        reg.register(_InFlight(lambda: self._rows()))
        self.limit = Gauge(
            "pd_proxy_admission_limit",
            "Admission's limit per replica, by role and kind (0: none); room = limit - in flight.",
            ("role", "kind"),
            registry=reg,
        )
        # Each flow's wait histogram child, by label; a new flow's depth series starts at 0, so
        # the dashboard shows every flow seen, queued or not.
        self._waits: dict[str, Histogram] = {}
        self._children: dict[tuple[str, str], Counter] = {}
        self._queued: dict[str, int] = {}  # label -> requests waiting under it
        self._used: dict[str, float] = {}  # label -> when a request last asked for it
        self._sweep_after = 0.0  # no idle label before then (the last look found none)

    def flow(self, name: str) -> str:
        """The label for flow ``name``."""
        now = self.clock()
        if name not in self._waits:
            named = len(self._waits) - (OTHER in self._waits)
            if named >= self.max_flow_labels and not self._give_up_idle(now):
                name = OTHER
            if name not in self._waits:
                self.depth.labels(name).set(0)
                self._waits[name] = self.wait.labels(name)
        self._used[name] = now
        return name

    def _give_up_idle(self, now: float) -> bool:
        """Drop the series of flows idle past ``FLOW_LABEL_IDLE_S``; whether any went (looked
        for at most every tenth of that, so a flood of unlabelled flows costs no scan each)."""
        if now < self._sweep_after:
            return False
        idle = [
            label
            for label, used in self._used.items()
            if label != OTHER and now - used >= FLOW_LABEL_IDLE_S and not self._queued.get(label)
        ]
        for label in idle:
            del self._waits[label], self._used[label]
            self._queued.pop(label, None)
            for family in (self.depth, self.wait):
                try:
                    family.remove(label)
                except KeyError:
                    pass
        if not idle:
            self._sweep_after = now + FLOW_LABEL_IDLE_S / 10
        return bool(idle)

    def enter(self, label: str) -> None:
        """A request of flow ``label`` joined the queue."""
        n = self._queued[label] = self._queued.get(label, 0) + 1
        self.depth.labels(label).set(n)

    def exit(self, label: str) -> None:
        """A request of flow ``label`` left the queue (admitted, refused or gone)."""
        n = self._queued[label] = max(0, self._queued.get(label, 0) - 1)
        self.depth.labels(label).set(n)

    def waited(self, label: str, seconds: float) -> None:
        """A request of flow ``label`` (from ``flow``) stopped waiting after ``seconds``."""
        self._waits[label].observe(seconds)

    def count(self, outcome: str, reason: str) -> None:
        child = self._children.get((outcome, reason))
        if child is None:
            child = self._children[outcome, reason] = self.outcomes.labels(outcome, reason)
        child.inc()

    def watch(self, rows: Callable[[], Iterable[tuple[str, str, str, int]]]) -> None:
        """Export what is admitted to each replica, read from the gate when scraped (so the
        request path updates no gauge): ``rows()`` gives (role, backend, kind, value)."""
        self._rows = rows


class _InFlight(Collector):
    def __init__(self, rows: Callable[[], Iterable[tuple[str, str, str, int]]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "pd_proxy_admitted_in_flight",
            "What the proxy has admitted to each replica and not yet seen finish: requests, "
            "uncached prompt tokens (prefill), KV waiting for this decode's pull (pulls).",
            labels=("role", "backend", "kind"),
        )
        for role, backend, kind, value in self._rows():
            family.add_metric((role, backend, kind), value)
        yield family
