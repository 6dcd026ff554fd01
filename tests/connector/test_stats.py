"""Dedup stats survive vLLM's aggregation and reach Prometheus under the exact names."""

from __future__ import annotations

import pytest
from pcp_nixl_connector import DEDUP_METRIC_NAMES

pytestmark = pytest.mark.vllm


def test_stats_only_dedup_events_are_not_empty_and_aggregate():
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats

    a, b = PcpNixlKVConnectorStats(), PcpNixlKVConnectorStats()
    assert a.is_empty()
    a.record_handshake_publication_skipped()
    b.record_finished_sending_suppressed(3)
    b.record_canonical_completions(0)  # zero is not an event
    assert not a.is_empty() and not b.is_empty()
    merged = PcpNixlKVConnectorStats().aggregate(a).aggregate(b)
    assert merged.dedup_totals() == {
        "num_pcp_handshake_publications_skipped": 1,
        "num_pcp_finished_sending_suppressed": 3,
        "num_pcp_canonical_completions": 0,
    }
    assert merged.reduce()["PCP sends suppressed"] == 3
    clone = merged.clone_and_reset()
    assert isinstance(clone, PcpNixlKVConnectorStats) and merged.is_empty()


def test_prom_counters_exist_at_zero_and_count(tiny_model_dir):
    import prometheus_client
    from pcp_nixl_connector import PcpCanonicalNixlConnector
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    registry = prometheus_client.CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    cfg = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_dir), skip_tokenizer_init=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PcpCanonicalNixlConnector",
            kv_connector_module_path="pcp_nixl_connector",
            kv_role="kv_consumer",
        ),
    )
    prom = PcpCanonicalNixlConnector.build_prom_metrics(
        cfg,
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    text = prometheus_client.generate_latest(registry).decode()
    for name in DEDUP_METRIC_NAMES:
        assert f'{name}{{engine="1",model_name="m"}} 0.0' in text
    stats = PcpCanonicalNixlConnector.build_kv_connector_stats()
    stats.record_canonical_completions(2)
    stats.record_canonical_completions(3)
    prom.observe(stats.data, engine_idx=1)
    prom.observe({"num_pcp_finished_sending_suppressed": [4]}, engine_idx=0)  # sparse payload
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:nixl_pcp_canonical_completions_total{engine="1",model_name="m"} 5.0' in text
    assert 'vllm:nixl_pcp_finished_sending_suppressed_total{engine="0",model_name="m"} 4.0' in text
    assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0' in text


def test_push_is_refused_clearly():
    from pcp_nixl_connector import PcpCanonicalNixlPushConnector

    with pytest.raises(NotImplementedError, match="pull"):
        PcpCanonicalNixlPushConnector(None, None, None)
