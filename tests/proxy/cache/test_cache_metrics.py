"""The cache-aware routing's metric names."""

from __future__ import annotations


def test_metric_names_are_the_exposed_families() -> None:
    """The names the dashboard is checked against (tests/compose/promql_names) are the ones the
    proxy exposes."""
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from pd_proxy.cache.index import Health
    from pd_proxy.cache.metrics import METRIC_NAMES, CacheMetrics

    reg = CollectorRegistry()
    metrics = CacheMetrics(reg)
    metrics.health("http://d:1", Health(batches=1), lag=0.1, blocks=3)
    metrics.tokenizer_seconds.labels("local").observe(0.001)
    metrics.predicted.labels("decode").inc(16)
    metrics.prompt_tokens.labels("decode").inc(20)
    metrics.trusted.labels("chat").set(1)
    text = generate_latest(reg).decode()
    families = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    assert {f for f in families if not f.endswith("_created")} == set(METRIC_NAMES)
