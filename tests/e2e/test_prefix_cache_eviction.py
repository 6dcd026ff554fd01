"""Prefix caching when the cache is full: a turn whose prefix was evicted is still exact.

One extra single-instance server with a KV cache of 40 blocks (``--num-gpu-blocks-override``;
the stack's own caches hold about 230,000 tokens, too many to fill in a test). A first turn is
cached; two other prompts then take every block, evicting it; the second turn finds nothing
(or, if vLLM kept some of it, only leading blocks) and equals its no-cache run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pcp_pd_kit.localstack.commands import vllm_server_spec
from pcp_pd_kit.localstack.host import run_dir
from pcp_pd_kit.localstack.model_source import resolve_model
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.settings import StackSettings
from tests.support.paths import REPO

from .test_prefix_cache import assert_same, complete, delta, no_cache, sources, token_ids

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL_CACHE_PORT = 18540
BLOCKS = 40  # 640 tokens
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def small_cache(e2e_settings: StackSettings) -> Iterator[tuple[str, str]]:
    settings = dataclasses.replace(e2e_settings, reference_port=SMALL_CACHE_PORT)
    model = resolve_model(settings.model, settings.served_model_name, REPO)
    spec = vllm_server_spec(settings, "reference", model.path, model.served_name, REPO)
    argv = [*spec.argv, "--num-gpu-blocks-override", str(BLOCKS)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN)]  # the last value wins
    proc = ManagedProcess(
        dataclasses.replace(spec, name="small-kv-cache", argv=argv),
        run_dir() / "e2e-small-kv-cache",
    )
    proc.start()
    try:
        wait_healthy([proc], settings.startup_timeout_s)
        yield settings.url(SMALL_CACHE_PORT), model.served_name
    finally:
        proc.stop()


def test_a_turn_after_its_prefix_was_evicted_equals_a_no_cache_run(
    small_cache: tuple[str, str], e2e_settings: StackSettings
) -> None:
    url, model = small_cache
    block = e2e_settings.block_size
    first_turn = token_ids(5000, 20 * block)
    complete(url, model, first_turn)
    before = sources(url)
    complete(url, model, first_turn + token_ids(5001, 5))
    assert delta(url, before)["local_cache_hit"] == len(first_turn)  # cached while it fits
    for seed in (5002, 5003):  # two prompts of 20 blocks each take the cache's 39 usable blocks
        complete(url, model, token_ids(seed, 20 * block))
    second_turn = first_turn + token_ids(5004, 20)
    fresh = no_cache(url, model, second_turn)
    before = sources(url)
    cached = complete(url, model, second_turn)
    hit = delta(url, before)["local_cache_hit"]
    assert_same(cached, fresh, "second turn after eviction")
    assert hit < len(first_turn) and hit % block == 0, f"{hit} tokens still cached"
