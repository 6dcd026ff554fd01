"""Prefix caching on the CPU stack is exact: cached runs equal no-cache runs of the same prompt.

vLLM's CPU build turns prefix caching off for MLA models; the kit's CPU plugin keeps it on
(docs/cpu.md). Each check here sends a prompt whose prefix the server holds, and the same prompt
with a unique ``cache_salt`` (the salt enters the first block's hash, so nothing matches: a
no-cache run on the same server), and compares greedy text *and* logprobs. The cache-hit
counters (``vllm:prompt_tokens_by_source_total``) show the cached runs really read the cache,
in whole blocks, on decode (PCP1), on the PCP2 + EP2 prefill, and through P/D, where decode
pulls over NIXL only the blocks it lacks.

Prompts are token ids (the tiny model's vocabulary), so block boundaries are exact. The shared
package stack serves them; every prompt here is new to it (seeded random ids).
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from pcp_nixl_connector.metric_names import FINISHED_SENDING_SUPPRESSED
from pcp_pd_kit.localstack.live import post_json, scrape, settle_prefill
from pcp_pd_kit.localstack.report import (
    CANONICAL_COMPLETIONS,
    HELD_REQUESTS_TOTAL,
    PROMPT_TOKENS_BY_SOURCE,
    total,
)
from pcp_pd_kit.localstack.stack import Stack, wait_until

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
# Logprobs of a cached run against its no-cache run: the same math, summed in another order
# (context and new tokens apart, merged by log-sum-exp). Measured within 3e-5 on this model.
LOGPROB_TOLERANCE = 1e-3
SOURCES = ("local_cache_hit", "local_compute", "external_kv_transfer")
SUPPRESSED = f"{FINISHED_SENDING_SUPPRESSED}_total"
# Ids past the tiny tokenizer's special tokens; any id decodes to text.
FIRST_ID, LAST_ID = 10, 2000


@dataclass(frozen=True)
class Reply:
    text: str
    logprobs: tuple[float, ...]
    prompt_tokens: int


def token_ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(count)]


def complete(url: str, model: str, prompt: Sequence[int], salt: str | None = None) -> Reply:
    """One greedy completion of token ids with each token's logprob; ``salt``: no cache hit."""
    body: dict[str, object] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    answer = post_json(f"{url}/v1/completions", body)
    choice = answer["choices"][0]
    logprobs = tuple(float(x) for x in choice["logprobs"]["token_logprobs"])
    return Reply(choice["text"], logprobs, answer["usage"]["prompt_tokens"])


def no_cache(url: str, model: str, prompt: Sequence[int]) -> Reply:
    return complete(url, model, prompt, salt=f"no-cache-{uuid.uuid4().hex}")


def assert_same(cached: Reply, fresh: Reply, what: str) -> None:
    assert cached.text == fresh.text, f"{what}: text differs from the no-cache run"
    assert len(cached.logprobs) == len(fresh.logprobs) == MAX_TOKENS
    worst = max(abs(a - b) for a, b in zip(cached.logprobs, fresh.logprobs, strict=True))
    assert worst <= LOGPROB_TOLERANCE, f"{what}: logprobs differ by {worst:.2e}"


def sources(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {s: total(samples, PROMPT_TOKENS_BY_SOURCE, source=s) or 0.0 for s in SOURCES}


def delta(url: str, before: dict[str, float]) -> dict[str, float]:
    now = sources(url)
    return {s: now[s] - before[s] for s in SOURCES}


def cached_tokens(cached_prefix: int, prompt_len: int, block: int) -> int:
    """What a prefix cache serves of a prompt: whole blocks of the cached prefix, and never the
    prompt's last token (vLLM computes at least one)."""
    return (min(cached_prefix, prompt_len - 1) // block) * block


@pytest.fixture(scope="module")
def model(pd_stack: Stack) -> str:
    return pd_stack.served_model_name


def test_cache_config_info_shows_prefix_caching_on(pd_stack: Stack) -> None:
    for part in ("prefill", "decode"):
        info = [s for s in scrape(pd_stack.urls[part]) if s.name == "vllm:cache_config_info"]
        assert info, f"{part} has no vllm:cache_config_info"
        assert info[0].labels["enable_prefix_caching"] == "True", part
        logs = pd_stack.processes[part].log_path.read_text(errors="replace")
        assert "CPU fix: prefix caching kept on for MLA" in logs, part


@pytest.mark.parametrize("part", ["decode", "prefill"])
def test_cached_prefixes_equal_no_cache_runs(pd_stack: Stack, model: str, part: str) -> None:
    """On decode (PCP1) and on the PCP2 + EP2 prefill, each served directly: a repeat, a short
    and a long new suffix, a one-token suffix, a prefix ending on and off a block boundary."""
    url, block = pd_stack.urls[part], pd_stack.settings.block_size
    seed = 1000 if part == "decode" else 2000
    base = token_ids(seed, 62 * block)  # 992 tokens, on a block boundary
    cases = {
        "repeat": base,
        "short suffix": base + token_ids(seed + 1, 5),
        "one-token suffix": base + token_ids(seed + 2, 1),
        "long suffix": base + token_ids(seed + 3, 320),
        "prefix off a block boundary": base[: 31 * block + 4] + token_ids(seed + 4, 20),
        "prefix on a block boundary": base[: 31 * block] + token_ids(seed + 5, 20),
    }
    first = complete(url, model, base)  # fills the cache
    assert_same(first, no_cache(url, model, base), f"{part} first run")
    for name, prompt in cases.items():
        fresh = no_cache(url, model, prompt)
        before = sources(url)
        cached = complete(url, model, prompt)
        moved = delta(url, before)
        assert_same(cached, fresh, f"{part} {name}")
        shared = next(
            (i for i, (a, b) in enumerate(zip(prompt, base, strict=False)) if a != b),
            min(len(prompt), len(base)),
        )
        want = cached_tokens(shared, len(prompt), block)
        assert moved["local_cache_hit"] == want, f"{part} {name}: {moved}, want {want} hit"
        assert moved["local_compute"] == len(prompt) - want, f"{part} {name}: {moved}"


def test_concurrent_batch_mixing_cached_and_fresh_prompts(pd_stack: Stack, model: str) -> None:
    """Ten requests at once on decode, half of them with a cached prefix: each equals its own
    no-cache run (the batch mixes context-path prefills, plain prefills and decodes)."""
    url, block = pd_stack.urls["decode"], pd_stack.settings.block_size
    base = token_ids(3000, 40 * block)
    complete(url, model, base)
    prompts = [base + token_ids(3100 + i, 7 + 13 * i) for i in range(5)]
    prompts += [token_ids(3200 + i, 50 + 90 * i) for i in range(5)]
    fresh = [no_cache(url, model, p) for p in prompts]
    before = sources(url)
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        cached = list(pool.map(lambda p: complete(url, model, p), prompts))
    for i, (got, want) in enumerate(zip(cached, fresh, strict=True)):
        assert_same(got, want, f"concurrent request {i}")
    assert delta(url, before)["local_cache_hit"] == 5 * len(base)


def test_pd_decode_pulls_only_what_it_lacks(pd_stack: Stack, model: str) -> None:
    """Through the proxy: the second turn's prefix is on decode (its blocks came over NIXL in
    the first turn), so decode reads it from its cache and pulls only the new tail; the text
    equals a no-cache P/D run; prefill releases every block it held (held == freed) and both
    KV caches are back to 0."""
    proxy, block = pd_stack.urls["proxy"], pd_stack.settings.block_size
    decode, prefill = pd_stack.urls["decode"], pd_stack.urls["prefill"]
    pcp = pd_stack.settings.prefill_pcp_size
    first_turn = token_ids(4000, 600)
    second_turn = first_turn + token_ids(4001, 25)
    fresh = no_cache(proxy, model, second_turn)
    complete(proxy, model, first_turn)
    assert settle_prefill(prefill, pd_stack.settings.kv_lease_s * 2) is not None
    before_decode, before_prefill = sources(decode), sources(prefill)
    counters = (HELD_REQUESTS_TOTAL, CANONICAL_COMPLETIONS, SUPPRESSED)
    before_dedup = [total(scrape(prefill), name) or 0.0 for name in counters]
    cached = complete(proxy, model, second_turn)
    assert_same(cached, fresh, "P/D second turn")
    want = cached_tokens(len(first_turn), len(second_turn), block)
    on_decode = wait_until(
        lambda: (d := delta(decode, before_decode))["external_kv_transfer"] > 0 and d,
        10,
        "decode's prompt-token counters",
        0.2,
    )
    assert on_decode == {
        "local_cache_hit": want,
        "local_compute": 0,
        "external_kv_transfer": len(second_turn) - want,
    }
    assert delta(prefill, before_prefill)["local_cache_hit"] == want  # the prefill's own cache
    assert settle_prefill(prefill, pd_stack.settings.kv_lease_s * 2) is not None
    held, canonical, suppressed = (
        (total(scrape(prefill), name) or 0.0) - old
        for name, old in zip(counters, before_dedup, strict=True)
    )
    assert held == canonical == 1 and suppressed == canonical * (pcp - 1)
    for part in ("prefill", "decode"):
        assert total(scrape(pd_stack.urls[part]), "vllm:kv_cache_usage_perc") == 0, part
    assert not math.isnan(cached.logprobs[0])
