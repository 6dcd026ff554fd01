"""Names of the dedup metrics (three counters and one gauge), importable without vLLM.

The compose/Grafana tests and the dashboards check their queries against
``DEDUP_METRIC_NAMES``; keeping the names in a module with no heavy imports
lets them do that without loading vLLM.
"""

from __future__ import annotations

# prometheus_client appends ``_total`` to a Counter's name in the text
# exposition (as vLLM's ``vllm:nixl_num_failed_transfers`` shows up as
# ``vllm:nixl_num_failed_transfers_total``), so the counters are registered
# under the base names and the exposed names carry the suffix.
HANDSHAKE_PUBLICATIONS_SKIPPED = "vllm:nixl_pcp_handshake_publications_skipped"
FINISHED_SENDING_SUPPRESSED = "vllm:nixl_pcp_finished_sending_suppressed"
CANONICAL_COMPLETIONS = "vllm:nixl_pcp_canonical_completions"

COUNTER_BASE_NAMES: tuple[str, ...] = (
    HANDSHAKE_PUBLICATIONS_SKIPPED,
    FINISHED_SENDING_SUPPRESSED,
    CANONICAL_COMPLETIONS,
)

# Gauge, per engine, set once at API-server startup from the config: how many suppressed
# finished_sending reports go with one canonical completion (p-1 for a replicated PCP=p producer
# in `canonical` mode; 0 in `world_size` mode, with PCP1 and on consumers). The dedup alert
# multiplies canonical completions by it instead of reading a hand-set PCP size.
EXPECTED_SUPPRESSED_PER_COMPLETION = "vllm:nixl_pcp_expected_suppressed_per_completion"

# Full names of the counters as they appear on /metrics.
DEDUP_COUNTER_NAMES: tuple[str, ...] = tuple(f"{name}_total" for name in COUNTER_BASE_NAMES)

# Every dedup metric on /metrics (the counters, then the gauge), each present from startup.
DEDUP_METRIC_NAMES: tuple[str, ...] = (*DEDUP_COUNTER_NAMES, EXPECTED_SUPPRESSED_PER_COMPLETION)

# Keys of the per-step stats payload (worker -> scheduler -> API server),
# one per counter, in the same order.
STATS_KEYS: tuple[str, ...] = (
    "num_pcp_handshake_publications_skipped",
    "num_pcp_finished_sending_suppressed",
    "num_pcp_canonical_completions",
)

# Requests a kv_producer finished with their KV held for remote decode (one per request, counted
# by the scheduler): what the canonical completions must add up to once every hold ended.
HELD_REQUESTS = "vllm:nixl_pcp_held_requests"
HELD_REQUESTS_KEY = "num_pcp_held_requests"

# The per-request handover breakdown (handover.py): one histogram, a ``phase`` label per step of
# the P/D handover, and the configured KV lease the prefill-side hold time is measured against.
HANDOVER_SECONDS = "vllm:nixl_handover_seconds"
KV_LEASE_SECONDS = "vllm:nixl_kv_lease_seconds"
HANDOVER_METRIC_NAMES: tuple[str, ...] = (
    f"{HANDOVER_SECONDS}_bucket",
    f"{HANDOVER_SECONDS}_sum",
    f"{HANDOVER_SECONDS}_count",
    KV_LEASE_SECONDS,
)
# Stats payload key of the handover events (scheduler and worker -> API server).
HANDOVER_EVENTS_KEY = "kit_handover_events"

# Gauge, per engine: requests the scheduler-side connector follows for that breakdown (decode:
# admitted for remote KV, first token not yet out; prefill: KV held for decode, not yet freed).
# Each leaves when vLLM finishes or aborts it, so the gauge drains to 0 on an idle server.
HANDOVER_PENDING = "vllm:nixl_handover_pending_requests"
HANDOVER_PENDING_KEY = "kit_handover_pending"
