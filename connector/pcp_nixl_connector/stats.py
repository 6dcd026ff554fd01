"""Dedup counters carried on vLLM's NIXL stats -> Prometheus path.

Worker stats are aggregated across ranks by ``KVOutputAggregator`` (which
asserts all ranks send the same stats type), so every rank of an engine that
loads this connector sends ``PcpNixlKVConnectorStats``; the API server turns
them into counters with vLLM's engine/model labels via ``PcpNixlPromMetrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from .handover import PHASES, Event, HandoverTracker
from .metric_names import (
    CANONICAL_COMPLETIONS,
    COUNTER_BASE_NAMES,
    EXPECTED_SUPPRESSED_PER_COMPLETION,
    FINISHED_SENDING_SUPPRESSED,
    HANDOVER_EVENTS_KEY,
    HANDOVER_PENDING,
    HANDOVER_PENDING_KEY,
    HANDOVER_SECONDS,
    HANDSHAKE_PUBLICATIONS_SKIPPED,
    HELD_REQUESTS,
    HELD_REQUESTS_KEY,
    KV_LEASE_SECONDS,
    STATS_KEYS,
)
from .topology import layout_from_config

HANDOVER_BUCKETS = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
]  # fmt: skip
DEFAULT_LEASE_S = 30  # vLLM 0.32's kv_lease_duration default (nixl/base_scheduler.py)

SKIPPED_KEY, SUPPRESSED_KEY, CANONICAL_KEY = STATS_KEYS
_STOCK_KEYS: tuple[str, ...] = tuple(NixlKVConnectorStats().data)

_DOCS = {
    HANDSHAKE_PUBLICATIONS_SKIPPED: "NIXL handshake metadata publications skipped by "
    "non-canonical prefill-context-parallel (PCP) replicas.",
    FINISHED_SENDING_SUPPRESSED: "Duplicate finished_sending reports suppressed on "
    "non-canonical PCP replicas (one per request per non-canonical rank).",
    CANONICAL_COMPLETIONS: "finished_sending reports emitted by canonical ranks of a "
    "KV producer (every rank is canonical when PCP=1).",
    EXPECTED_SUPPRESSED_PER_COMPLETION: "Suppressed finished_sending reports expected per "
    "canonical completion: PCP size - 1 for a replicated-PCP producer in canonical mode, "
    "0 otherwise (world_size mode, PCP=1, consumers).",
    HELD_REQUESTS: "Requests a KV producer finished with their KV blocks held for a remote "
    "decode; canonical completions add up to this x TP x PP once every hold ended.",
    HANDOVER_SECONDS: "Per-request P/D handover, by phase: on decode admitted (waiting for "
    "remote KV) -> read posted -> transfer done -> seen by the scheduler -> first token "
    "(and admitted_to_first_token overall); on prefill prefill_kv_hold, request finished -> "
    "its KV blocks freed.",
    HANDOVER_PENDING: "Requests the connector follows for the handover breakdown: on decode "
    "admitted for remote KV whose first token is not out yet, on prefill KV held for decode and "
    "not yet freed. Every finished or aborted request leaves: 0 on an idle server.",
    KV_LEASE_SECONDS: "How long a prefill keeps a finished request's KV for decode to pull "
    "(kv_connector_extra_config.kv_lease_duration) before freeing it as expired.",
}


@dataclass
class PcpNixlKVConnectorStats(NixlKVConnectorStats):
    """NIXL stats plus the dedup counts (each a list of increments, as vLLM does)."""

    def reset(self) -> None:
        super().reset()
        for key in (*STATS_KEYS, HELD_REQUESTS_KEY, HANDOVER_EVENTS_KEY, HANDOVER_PENDING_KEY):
            self.data[key] = []

    def _add(self, key: str, n: int) -> None:
        if n:
            self.data.setdefault(key, []).append(n)

    def record_handshake_publication_skipped(self) -> None:
        self._add(SKIPPED_KEY, 1)

    def record_finished_sending_suppressed(self, n: int) -> None:
        self._add(SUPPRESSED_KEY, n)

    def record_canonical_completions(self, n: int) -> None:
        self._add(CANONICAL_KEY, n)

    def record_held_request(self) -> None:
        self._add(HELD_REQUESTS_KEY, 1)

    def record_handover(self, events: list[Event]) -> None:
        if events:
            self.data.setdefault(HANDOVER_EVENTS_KEY, []).extend(events)

    def record_handover_pending(self, n: int) -> None:
        """The current count (a level, not an increment: the last one shipped wins)."""
        self.data.setdefault(HANDOVER_PENDING_KEY, []).append(n)

    def dedup_totals(self) -> dict[str, int]:
        return {key: int(sum(self.data.get(key, ()))) for key in STATS_KEYS}

    def is_empty(self) -> bool:
        # The parent ignores unknown keys; an interval with only dedup events
        # must still be shipped.
        return super().is_empty() and not any(
            self.data.get(key)
            for key in (*STATS_KEYS, HELD_REQUESTS_KEY, HANDOVER_EVENTS_KEY, HANDOVER_PENDING_KEY)
        )

    def aggregate(self, other: Any) -> PcpNixlKVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced = super().reduce()
        totals = self.dedup_totals()
        reduced["PCP handshakes skipped"] = totals[SKIPPED_KEY]
        reduced["PCP sends suppressed"] = totals[SUPPRESSED_KEY]
        reduced["PCP canonical completions"] = totals[CANONICAL_KEY]
        return reduced


class PcpNixlPromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics plus the dedup counters (per engine, at 0) and the expectation gauge.

    Built in the API server (``KVConnectorProm``), which has the engine's ``vllm_config`` but no
    worker: the gauge's value comes from the config's layout and mode, set once per engine.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types these as the union of its metric classes; they are Counter and Gauge here.
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls
        self.pcp_counters: dict[str, dict[int, Any]] = {}
        for key, name in zip(STATS_KEYS, COUNTER_BASE_NAMES, strict=True):
            counter = counter_cls(name=name, documentation=_DOCS[name], labelnames=labelnames)
            self.pcp_counters[key] = create_metric_per_engine(counter, self.per_engine_labelvalues)
        held = counter_cls(
            name=HELD_REQUESTS, documentation=_DOCS[HELD_REQUESTS], labelnames=labelnames
        )
        self.held_requests = create_metric_per_engine(held, self.per_engine_labelvalues)
        # The API server sees no wrapper (a MultiConnector hands us our own section only):
        # the mode is the setting, which the kit's stacks write out when they wrap us.
        self.expected_suppressed_per_completion = layout_from_config(
            vllm_config
        ).expected_suppressed_per_completion()
        gauge = gauge_cls(
            name=EXPECTED_SUPPRESSED_PER_COMPLETION,
            documentation=_DOCS[EXPECTED_SUPPRESSED_PER_COMPLETION],
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.pcp_expected_gauge: dict[int, Any] = dict(
            create_metric_per_engine(gauge, self.per_engine_labelvalues)
        )
        for child in self.pcp_expected_gauge.values():
            child.set(self.expected_suppressed_per_completion)
        handover = self._histogram_cls(
            name=HANDOVER_SECONDS,
            documentation=_DOCS[HANDOVER_SECONDS],
            buckets=HANDOVER_BUCKETS,
            labelnames=[*labelnames, "phase"],
        )
        # Children for every phase at startup, so the series exist (at 0) before traffic.
        self.handover: dict[int, dict[str, Any]] = {
            idx: {phase: handover.labels(*values, phase) for phase in PHASES}
            for idx, values in self.per_engine_labelvalues.items()
        }
        self.handover_trackers = {idx: HandoverTracker() for idx in self.per_engine_labelvalues}
        lease = self._gauge_cls(
            name=KV_LEASE_SECONDS,
            documentation=_DOCS[KV_LEASE_SECONDS],
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        transfer = vllm_config.kv_transfer_config
        lease_s = (
            transfer.get_from_extra_config("kv_lease_duration", DEFAULT_LEASE_S)
            if transfer is not None
            else DEFAULT_LEASE_S
        )
        for child in create_metric_per_engine(lease, self.per_engine_labelvalues).values():
            child.set(lease_s)
        pending = self._gauge_cls(
            name=HANDOVER_PENDING,
            documentation=_DOCS[HANDOVER_PENDING],
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.handover_pending: dict[int, Any] = dict(
            create_metric_per_engine(pending, self.per_engine_labelvalues)
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = transfer_stats_data
        if any(k not in base for k in _STOCK_KEYS):
            # Tolerate a payload missing stock keys (e.g. empty); vLLM's
            # observe indexes them directly.
            base = {**{k: [] for k in _STOCK_KEYS}, **transfer_stats_data}
        super().observe(base, engine_idx)
        for key, per_engine in self.pcp_counters.items():
            total = sum(transfer_stats_data.get(key, ()))
            if total:
                per_engine[engine_idx].inc(total)
        levels = transfer_stats_data.get(HANDOVER_PENDING_KEY)
        if levels:
            self.handover_pending[engine_idx].set(levels[-1])
        held = sum(transfer_stats_data.get(HELD_REQUESTS_KEY, ()))
        if held:
            self.held_requests[engine_idx].inc(held)
        events = transfer_stats_data.get(HANDOVER_EVENTS_KEY)
        if events:
            tracker = self.handover_trackers[engine_idx]
            # The payload crossed a process boundary: tuples may arrive as lists.
            for phase, seconds in tracker.add(tuple(e) for e in events):
                self.handover[engine_idx][phase].observe(seconds)
