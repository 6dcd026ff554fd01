"""Cache-aware routing's settings: clear errors for bad values, and the proxy's routing unchanged
(no router, none of its libraries loaded) while it is off."""

from __future__ import annotations

import re

import pytest

from pd_proxy.config import ConfigError, ProxyConfig, load_config

URLS = {"prefill": ("http://p:1",), "decode": ("http://d:1",)}


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"prefix_cache_routing": "precise"}, "prefix_cache_routing 'precise' is not one of"),
        ({"cache_overlap_weight": -1.0}, "cache_overlap_weight must be >= 0"),
        ({"cache_max_imbalance": -1}, "cache_max_imbalance must be >= 0"),
        ({"cache_approx_blocks": 0}, "cache_approx_blocks must be > 0"),
        ({"tokenize_timeout": 0.0}, "tokenize_timeout must be > 0"),
        ({"tokenizer": " "}, "--tokenizer (PD_PROXY_TOKENIZER) is an empty path"),
    ],
)
def test_bad_values_are_refused_by_name(options, needle) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ProxyConfig(**URLS, **options)


def test_environment_and_flags() -> None:
    env = {
        "PD_PROXY_PREFILL": "http://p:1",
        "PD_PROXY_DECODE": "http://d:1",
        "PD_PROXY_PREFIX_CACHE_ROUTING": "AUTO",
        "PD_PROXY_CACHE_MAX_IMBALANCE": "2",
    }
    config = load_config(["--cache-overlap-weight", "3.5"], env)
    assert config.prefix_cache_routing == "auto"
    assert (config.cache_max_imbalance, config.cache_overlap_weight) == (2, 3.5)


def _started(config: ProxyConfig):
    """The running parts ``pd_proxy.api.app.start`` builds for ``config`` (the flow needs a
    loop)."""
    import asyncio
    import contextlib

    from pd_proxy.api.app import PROXY_KEY, build_app, start

    async def build():
        async with contextlib.AsyncExitStack() as stack:
            return await start(build_app(config)[PROXY_KEY], stack)

    return asyncio.run(build())


def test_a_tokenizer_folder_without_files_stops_the_start(tmp_path) -> None:
    config = ProxyConfig(**URLS, prefix_cache_routing="events", tokenizer=str(tmp_path))
    with pytest.raises(ConfigError, match="tokenizer.json"):
        _started(config)


def test_off_builds_no_router() -> None:
    running = _started(ProxyConfig(**URLS, local_prefill_max_tokens=8))
    assert running.pipeline.planner.cache is None
