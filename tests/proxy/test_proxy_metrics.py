"""``/metrics``: no ``_created`` series unless asked; the settings for that and for workers."""

from __future__ import annotations

import pytest

from pd_proxy.config import ConfigError, load_config
from pd_proxy.metrics import ProxyMetrics
from tests.proxy.proxy_harness import pd_stack

BASE = {"PD_PROXY_PREFILL": "http://127.0.0.1:16801", "PD_PROXY_DECODE": "http://127.0.0.1:16802"}


async def _scrape(**options) -> str:
    async with pd_stack(**options) as s:
        status, _, _ = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200
        status, raw = await s.get("/metrics")
        assert status == 200
        return raw.decode()


async def test_metrics_have_no_created_series_by_default():
    text = await _scrape()
    assert 'pd_proxy_requests_total{endpoint="/v1/completions",path="pd",status="200"} 1.0' in text
    assert "pd_proxy_request_duration_seconds_count 1.0" in text
    assert "_created" not in text


async def test_metrics_created_brings_them_back():
    text = await _scrape(metrics_created=True)
    created = [line for line in text.splitlines() if "_created" in line]
    assert 'pd_proxy_requests_created{endpoint="/v1/completions",path="pd",status="200"}' in text
    assert any(line.startswith("pd_proxy_request_duration_seconds_created ") for line in created)
    # Everything else is the same exposition.
    plain = [line for line in text.splitlines() if "_created" not in line]
    assert "pd_proxy_request_duration_seconds_count 1.0" in plain


def test_created_filter_keeps_every_other_sample():
    with_created = ProxyMetrics(["http://p:1"], ["http://d:2"], created=True)
    without = ProxyMetrics(["http://p:1"], ["http://d:2"])
    for m in (with_created, without):
        m.count_request("/v1/completions", 200)
        m.backend_error("decode", "http://d:2")
        m.request_duration.observe(0.01)

    def samples(m: ProxyMetrics) -> list[str]:
        return [line for line in m.render().decode().splitlines() if not line.startswith("#")]

    expected = [line for line in samples(with_created) if "_created" not in line]
    assert samples(without) == expected
    assert len(samples(with_created)) > len(expected)


def test_metrics_created_and_workers_settings():
    c = load_config([], BASE)
    assert (c.metrics_created, c.workers) == (False, 1)
    c = load_config([], {**BASE, "PD_PROXY_METRICS_CREATED": "1", "PD_PROXY_WORKERS": "4"})
    assert (c.metrics_created, c.workers) == (True, 4)
    c = load_config(["--metrics-created", "--workers", "2"], BASE)
    assert (c.metrics_created, c.workers) == (True, 2)
    c = load_config(["--workers", "1"], {**BASE, "PD_PROXY_WORKERS": "8"})
    assert c.workers == 1  # the flag wins


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PD_PROXY_WORKERS": "0"}, "workers must be 1-256"),
        ({"PD_PROXY_WORKERS": "many"}, "PD_PROXY_WORKERS"),
        ({"PD_PROXY_WORKERS": "1000"}, "workers must be 1-256"),
        ({"PD_PROXY_METRICS_CREATED": "perhaps"}, "PD_PROXY_METRICS_CREATED"),
    ],
)
def test_bad_workers_or_created_settings(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], {**BASE, **env})
