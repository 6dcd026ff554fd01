"""The cache-aware routing's Prometheus metrics, on the proxy's registry (pd_proxy.metrics).

Predicted cache hits sit beside vLLM's own count of what it served from cache
(``vllm:prompt_tokens_by_source_total{source="local_cache_hit"}``), so a dashboard shows how well
the index predicts. Index health comes from each replica's ``Health`` counters, exported as
deltas when a batch arrives, and gauges refreshed by the router's watch loop.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd_proxy.routing.cache.index import COUNTERS as HEALTH_COUNTERS
from pd_proxy.routing.cache.index import Health
from pd_proxy.routing.cache.scorer import REASONS
from pd_proxy.routing.decider import DECISIONS

TOKEN_SOURCES = ("local", "server", "ids", "none")  # pd_proxy_tokenizer_requests_total's source
TOKENIZER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)

METRIC_NAMES = (
    "pd_proxy_path_decisions_total",
    "pd_proxy_cache_choices_total",
    "pd_proxy_cache_prompt_tokens_total",
    "pd_proxy_cache_predicted_hit_tokens_total",
    "pd_proxy_kv_events_total",
    "pd_proxy_kv_events_lag_seconds",
    "pd_proxy_cache_blocks",
    "pd_proxy_cache_index_blocks",
    "pd_proxy_cache_index_evicted_blocks_total",
    "pd_proxy_cache_ready",
    "pd_proxy_cache_ready_timeouts_total",
    "pd_proxy_tokenizer_requests_total",
    "pd_proxy_tokenizer_seconds",
    "pd_proxy_tokenizer_shape_trusted",
)


class CacheMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.decisions = Counter(
            "pd_proxy_path_decisions",
            "P/D-eligible requests by the path chosen and why: local/short, local/cached (decode "
            "holds enough of the prompt), pd/long, pd/no_tokens (the prompt could not be counted), "
            "pd/no_choice (one replica per role and no local prefill: nothing to decide).",
            ("path", "reason"),
            registry=reg,
        )
        for path, reason in DECISIONS:
            self.decisions.labels(path, reason)
        self.choices = Counter(
            "pd_proxy_cache_choices",
            "Replicas chosen by the cache-aware scorer, by role and reason: cache (holds the most "
            "of the prompt), load (least busy), guard (the imbalance guard overrode the cache).",
            ("role", "reason"),
            registry=reg,
        )
        for role in ("prefill", "decode"):
            for reason in REASONS:
                self.choices.labels(role, reason)
        self.prompt_tokens = Counter(
            "pd_proxy_cache_prompt_tokens",
            "Prompt tokens of the requests the cache-aware router placed, by role.",
            ("role",),
            registry=reg,
        )
        self.predicted = Counter(
            "pd_proxy_cache_predicted_hit_tokens",
            "Prompt tokens the chosen replica was predicted to serve from its prefix cache; "
            'compare vllm:prompt_tokens_by_source_total{source="local_cache_hit"}.',
            ("role",),
            registry=reg,
        )
        # Every known label set from the start: a dashboard shows 0, not "No data", until the
        # router has placed a request (with one replica per role it may never need to).
        for role in ("prefill", "decode"):
            self.prompt_tokens.labels(role)
            self.predicted.labels(role)
        self.events = Counter(
            "pd_proxy_kv_events",
            "KV-event stream counts per replica: batches, events, gaps (sequence skipped or a "
            "batch unreadable), replays (gaps filled), drops (entries dropped after a gap), "
            "resets (publisher restarted), orphans (stored blocks with an unknown parent).",
            ("backend", "kind"),
            registry=reg,
        )
        self.lag = Gauge(
            "pd_proxy_kv_events_lag_seconds",
            "Proxy clock minus the publisher timestamp of the replica's newest batch, when it "
            "arrived.",
            ("backend",),
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.blocks = Gauge(
            "pd_proxy_cache_blocks",
            "Blocks the index holds per replica, by source: events (its KV events) or approx "
            "(the proxy's own routing history).",
            ("backend", "source"),
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.index_blocks = Gauge(
            "pd_proxy_cache_index_blocks",
            "Block-replica pairs the KV-event index holds, by role (a block held by 3 replicas "
            "counts 3); bounded by --cache-index-max-blocks.",
            ("role",),
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.index_evicted = Counter(
            "pd_proxy_cache_index_evicted_blocks",
            "Block-replica pairs the KV-event index dropped, oldest first, to stay within "
            "--cache-index-max-blocks, by role.",
            ("role",),
            registry=reg,
        )
        for role in ("prefill", "decode"):
            self.index_blocks.labels(role)
            self.index_evicted.labels(role)
        self.ready = Gauge(
            "pd_proxy_cache_ready",
            "1 once every KV-event publisher found at start was replayed or sent a batch (or "
            "events are off); 0 while /health waits for them, and after --cache-ready-timeout "
            "ran out without them.",
            registry=reg,
            multiprocess_mode="livemin",
        )
        self.ready_timeouts = Counter(
            "pd_proxy_cache_ready_timeouts",
            "Starts where --cache-ready-timeout ran out before every KV-event publisher was "
            "replayed or heard: the proxy served without knowing their caches.",
            registry=reg,
        )
        self.tokenizer = Counter(
            "pd_proxy_tokenizer_requests",
            "Prompts tokenized for routing, by source: local (the proxy's tokenizer), server (a "
            "decode's /tokenize), ids (the prompt was token ids), none (no count: P/D).",
            ("source",),
            registry=reg,
        )
        for source in TOKEN_SOURCES:
            self.tokenizer.labels(source)
        self.tokenizer_seconds = Histogram(
            "pd_proxy_tokenizer_seconds",
            "Time to get a prompt's token ids, by source (local or server).",
            ("source",),
            buckets=TOKENIZER_BUCKETS,
            registry=reg,
        )
        for source in ("local", "server"):
            self.tokenizer_seconds.labels(source)
        self.trusted = Gauge(
            "pd_proxy_tokenizer_shape_trusted",
            "1 when the local tokenizer matched a decode's /tokenize on the canary set for the "
            "request shape (completion, chat); 0: that shape is tokenized by the server.",
            ("shape",),
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self._seen: dict[str, Health] = {}
        # Per replica, its series' children (a label lookup per batch cost more than the batch).
        self._children: dict[str, tuple[list[Counter], Gauge, Gauge]] = {}

    def health(self, backend: str, health: Health, lag: float | None, blocks: int) -> None:
        """Export a replica's stream counters (as deltas since the last call) and gauges."""
        seen = self._seen.get(backend) or Health()
        children = self._children.get(backend)
        if children is None:  # every counter at 0 from the first call: "no gaps yet"
            children = self._children[backend] = (
                [self.events.labels(backend, kind) for kind in HEALTH_COUNTERS],
                self.lag.labels(backend),
                self.blocks.labels(backend, "events"),
            )
        counters, lag_gauge, blocks_gauge = children
        for kind, counter in zip(HEALTH_COUNTERS, counters, strict=True):
            delta = getattr(health, kind) - getattr(seen, kind)
            if delta > 0:
                counter.inc(delta)
        self._seen[backend] = Health(**{k: getattr(health, k) for k in HEALTH_COUNTERS})
        if lag is not None:
            lag_gauge.set(lag)
        blocks_gauge.set(blocks)

    def index_size(self, role: str, pairs: int, evicted: int) -> None:
        """A role index's block-replica pairs, and the pairs its bound dropped since last told."""
        self.index_blocks.labels(role).set(pairs)
        if evicted > 0:
            self.index_evicted.labels(role).inc(evicted)

    def forget(self, backend: str) -> None:
        """A replica that left: its gauges go (counters stay, as counters should)."""
        self._seen.pop(backend, None)
        self._children.pop(backend, None)
        for gauge, labels in (
            (self.lag, (backend,)),
            (self.blocks, (backend, "events")),
            (self.blocks, (backend, "approx")),
        ):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
