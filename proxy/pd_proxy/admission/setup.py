"""The gate the settings ask for, built once when the app starts."""

from __future__ import annotations

from pd_proxy.admission.gate import Gate, Settings
from pd_proxy.admission.metrics import AdmissionMetrics
from pd_proxy.admission.room import Limits
from pd_proxy.backends.pool import BackendPool
from pd_proxy.config import ProxyConfig
from pd_proxy.metrics import ProxyMetrics


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
    flows = AdmissionMetrics(metrics.registry, config.max_flow_labels)
    return Gate(settings, prefill, decode, flows)
