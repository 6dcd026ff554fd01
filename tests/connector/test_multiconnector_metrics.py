"""The kit's connector beside another child of vLLM's MultiConnector, on the API server's side:
the stats that crossed the process boundary are rebuilt by class name, and the Prometheus
metrics are built once per engine."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

KIT = "PcpCanonicalNixlConnector"


def _multi_config(model_dir: Any, tmp_path: Any) -> Any:
    from vllm.config import KVTransferConfig

    from tests.connector.test_stats import _config

    cfg = _config(model_dir, "kv_producer", 1)
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": KIT,
                    "kv_connector_module_path": "pcp_nixl_connector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"pcp_completion_mode": "world_size"},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
                },
            ]
        },
    )
    return cfg


def _prom_on_private_registry() -> tuple[type, Any]:
    """vLLM's KVConnectorProm (what the API server's Prometheus logger builds), on its own
    registry so the test can build it more than once."""
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = prometheus_client.CollectorRegistry()

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    class PrivateProm(KVConnectorProm):
        _gauge_cls = bound(Gauge)
        _counter_cls = bound(Counter)
        _histogram_cls = bound(Histogram)

    return PrivateProm, lambda: prometheus_client.generate_latest(registry).decode()


def test_stats_payload_from_the_engine_is_rebuilt_and_counted(
    tiny_model_dir: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What killed both API servers' output handlers: vLLM's KVConnectorLogging rebuilding a
    MultiConnector payload that names the kit's class. The classes are loaded the way the API
    server loads them (from the config), which registers the kit's class with vLLM's factory."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats, PcpNixlPromMetrics

    built: list[object] = []
    real_init = PcpNixlPromMetrics.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(PcpNixlPromMetrics, "__init__", counting_init)
    cfg = _multi_config(tiny_model_dir, tmp_path)
    prom_cls, text_of = _prom_on_private_registry()
    prom = prom_cls(cfg, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    logging = KVConnectorLogging(cfg.kv_transfer_config)
    assert len(built) == 1  # one set of metrics for both engines

    cls = KVConnectorFactory.get_connector_class_by_name(KIT)
    assert cls.__name__ == KIT and cls.build_kv_connector_stats is not None
    stats = PcpNixlKVConnectorStats()
    stats.record_canonical_completions(2)
    stats.record_held_request()

    def payload() -> dict[str, Any]:
        """MultiKVConnectorStats.to_dict() as it arrives: a fresh copy each step."""
        return {KIT: copy.deepcopy(stats.to_dict())}

    logging.observe(payload())  # raised "Connector 'PcpCanonicalNixlConnector' is not registered"
    logging.observe(payload())
    prom.observe(payload(), engine_idx=1)
    assert logging.transfer_stats_accumulator is not None
    assert (
        logging.transfer_stats_accumulator[KIT].dedup_totals()["num_pcp_canonical_completions"] == 4
    )
    text = text_of()
    assert 'vllm:nixl_pcp_canonical_completions_total{engine="1",model_name="m"} 2.0' in text
    assert 'vllm:nixl_pcp_held_requests_total{engine="1",model_name="m"} 1.0' in text


def test_registration_survives_a_second_import() -> None:
    """The module is imported by the engine, the API server and the tests, sometimes twice in
    one process (reload): the registration is idempotent and names the class vLLM runs."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import pcp_nixl_connector.connector as kit

    kit.register_with_vllm()
    before = dict(kit.__dict__)
    try:
        reloaded = importlib.reload(kit)
        assert (
            KVConnectorFactory.get_connector_class_by_name(KIT)
            is reloaded.PcpCanonicalNixlConnector
        )
    finally:
        # Later tests patch the class the package exports: give the module its classes back.
        kit.__dict__.clear()
        kit.__dict__.update(before)
        kit.register_with_vllm()
