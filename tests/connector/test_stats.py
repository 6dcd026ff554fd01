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


def _build_prom(cfg, connector_cls=None):
    """``build_prom_metrics`` as vLLM's ``KVConnectorProm`` calls it, on a private registry."""
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram

    from pcp_nixl_connector import PcpCanonicalNixlConnector

    registry = prometheus_client.CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    prom = (connector_cls or PcpCanonicalNixlConnector).build_prom_metrics(
        cfg,
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    return prom, lambda: prometheus_client.generate_latest(registry).decode()


def _config(model_dir, role="kv_consumer", pcp=1, extra=None):
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PcpCanonicalNixlConnector",
            kv_connector_module_path="pcp_nixl_connector",
            kv_role=role,
            kv_connector_extra_config=extra or {},
        ),
    )
    cfg.parallel_config.prefill_context_parallel_size = pcp
    return cfg


def test_prom_counters_exist_at_zero_and_count(tiny_model_dir):
    from pcp_nixl_connector import PcpCanonicalNixlConnector

    prom, text_of = _build_prom(_config(tiny_model_dir))
    text = text_of()
    assert len(DEDUP_METRIC_NAMES) == 4
    for name in DEDUP_METRIC_NAMES:  # counters and the gauge (0 on a consumer)
        assert f'{name}{{engine="1",model_name="m"}} 0.0' in text
    stats = PcpCanonicalNixlConnector.build_kv_connector_stats()
    stats.record_canonical_completions(2)
    stats.record_canonical_completions(3)
    prom.observe(stats.data, engine_idx=1)
    prom.observe({"num_pcp_finished_sending_suppressed": [4]}, engine_idx=0)  # sparse payload
    text = text_of()
    assert 'vllm:nixl_pcp_canonical_completions_total{engine="1",model_name="m"} 5.0' in text
    assert 'vllm:nixl_pcp_finished_sending_suppressed_total{engine="0",model_name="m"} 4.0' in text
    assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0' in text


@pytest.mark.parametrize(
    "role,pcp,mode,want",
    [
        ("kv_producer", 2, "canonical", 1),
        ("kv_producer", 4, "canonical", 3),
        ("kv_producer", 2, "world_size", 0),
        ("kv_producer", 1, "canonical", 0),
        ("kv_consumer", 2, "canonical", 0),
    ],
)
def test_expected_suppressed_gauge_from_config(tiny_model_dir, role, pcp, mode, want):
    from pcp_nixl_connector import EXPECTED_SUPPRESSED_PER_COMPLETION

    cfg = _config(tiny_model_dir, role, pcp, {"pcp_completion_mode": mode})
    _prom, text_of = _build_prom(cfg)
    text = text_of()
    assert f"# TYPE {EXPECTED_SUPPRESSED_PER_COMPLETION} gauge" in text
    for engine in ("0", "1"):  # same engine/model labels as the counters, from startup
        labels = f'{{engine="{engine}",model_name="m"}}'
        assert f"{EXPECTED_SUPPRESSED_PER_COMPLETION}{labels} {float(want)}" in text
        assert f"vllm:nixl_pcp_canonical_completions_total{labels} 0.0" in text


@pytest.mark.parametrize("mode,want", [("world_size", 0), (None, 1)])
def test_multiconnector_gauge_follows_the_mode_in_the_childs_section(tiny_model_dir, mode, want):
    """MultiConnector builds its children's metrics from their own sections, so the API server
    reads the mode written there (the kit's stacks write world_size when they wrap)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from pcp_nixl_connector import EXPECTED_SUPPRESSED_PER_COMPLETION
    from tests.connector.test_scheduler_leak import COUNTLESS

    cfg = _config(tiny_model_dir, "kv_producer", 2)
    kit = {**_config(tiny_model_dir).kv_transfer_config.__dict__}
    child = {k: kit[k] for k in ("kv_connector", "kv_connector_module_path")}
    if mode:
        child["kv_connector_extra_config"] = {"pcp_completion_mode": mode}
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"connectors": [{**child, "kv_role": "kv_producer"}, COUNTLESS]},
    )
    _prom, text_of = _build_prom(cfg, MultiConnector)
    text = text_of()
    assert (
        f'{EXPECTED_SUPPRESSED_PER_COMPLETION}{{engine="0",model_name="m"}} {float(want)}' in text
    )


def test_push_is_refused_clearly():
    from pcp_nixl_connector import PcpCanonicalNixlPushConnector

    with pytest.raises(NotImplementedError, match="pull"):
        PcpCanonicalNixlPushConnector(None, None, None)


def test_held_requests_alone_ship_aggregate_and_count(tiny_model_dir):
    """A prefill interval whose only event is a held request still reaches Prometheus: the
    invariant canonical completions = held x TP x PP needs every hold counted."""
    from pcp_nixl_connector import PcpCanonicalNixlConnector
    from pcp_nixl_connector.metric_names import HELD_REQUESTS, HELD_REQUESTS_KEY
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats

    a, b = PcpNixlKVConnectorStats(), PcpNixlKVConnectorStats()
    a.record_held_request()
    b.record_held_request()
    b.record_held_request()
    assert not a.is_empty()
    merged = PcpNixlKVConnectorStats().aggregate(a).aggregate(b)
    assert sum(merged.data[HELD_REQUESTS_KEY]) == 3
    prom, text_of = _build_prom(_config(tiny_model_dir, role="kv_producer", pcp=2))
    assert f'{HELD_REQUESTS}_total{{engine="0",model_name="m"}} 0.0' in text_of()
    prom.observe(merged.data, engine_idx=0)
    assert f'{HELD_REQUESTS}_total{{engine="0",model_name="m"}} 3.0' in text_of()
    assert merged.clone_and_reset().data[HELD_REQUESTS_KEY] and merged.is_empty()
    assert isinstance(PcpCanonicalNixlConnector.build_kv_connector_stats(), PcpNixlKVConnectorStats)
