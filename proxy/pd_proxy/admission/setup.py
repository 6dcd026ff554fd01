"""The gate the settings ask for, and the two request facts admission reads that the planner may
not have: a prompt's size when its tokens were not counted, and the request's own priority."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_proxy.admission.gate import Gate, Settings
from pd_proxy.admission.metrics import AdmissionMetrics
from pd_proxy.admission.room import Limits
from pd_proxy.config import ProxyConfig
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.routing.pool import BackendPool

# Bytes of request body per prompt token, for a request whose tokens were not counted (no local
# prefill limit, no cache-aware routing): English text runs about four characters a token, and
# the JSON around the prompt is small next to a long one.
BYTES_PER_TOKEN = 4


def build_gate(
    config: ProxyConfig, prefill: BackendPool, decode: BackendPool, metrics: ProxyMetrics
) -> Gate:
    limits = Limits(
        config.prefill_max_inflight,
        config.prefill_max_tokens,
        config.decode_max_inflight,
        config.decode_max_pending_pulls,
    )
    settings = Settings(limits, config.queue_size, config.queue_timeout, config.health_interval)
    return Gate(settings, prefill, decode, AdmissionMetrics(metrics.registry))


def estimated_tokens(body: bytes) -> int:
    return max(1, len(body) // BYTES_PER_TOKEN)


def request_priority(body: Mapping[str, Any]) -> int:
    """The request's ``priority`` (vLLM's field: an integer, lower is earlier), 0 if absent or
    not an integer (vLLM refuses such a request itself)."""
    value = body.get("priority")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0
