"""The cache-aware routing's metric names."""

from __future__ import annotations


def test_metric_names_are_the_exposed_families() -> None:
    """The names the dashboard is checked against (tests/compose/promql_names) are the ones the
    proxy exposes."""
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from pd_proxy.routing.cache.index import Health
    from pd_proxy.routing.cache.metrics import METRIC_NAMES, CacheMetrics

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


def test_every_known_series_exists_at_zero_before_any_request() -> None:
    """A dashboard shows 0 rather than "No data" while the router has nothing to place (one
    replica per role, no local prefill: the compose default); the live Grafana check reads them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pd_proxy.routing.cache.index import Health
    from pd_proxy.routing.cache.metrics import CacheMetrics

    reg = CollectorRegistry()
    metrics = CacheMetrics(reg)
    metrics.health("http://decode:8200", Health(), None, 0)
    text = generate_latest(reg).decode()
    for line in (
        'pd_proxy_cache_prompt_tokens_total{role="decode"} 0.0',
        'pd_proxy_cache_predicted_hit_tokens_total{role="prefill"} 0.0',
        'pd_proxy_tokenizer_seconds_count{source="local"} 0.0',
        'pd_proxy_kv_events_total{backend="http://decode:8200",kind="gaps"} 0.0',
        'pd_proxy_kv_events_total{backend="http://decode:8200",kind="resets"} 0.0',
    ):
        assert line in text, line
