"""Conditional disaggregation on the real stack: a second pd-proxy with
``--local-prefill-max-tokens N`` sends prompts of at most N tokens (counted by decode's
``/tokenize``, the chat template applied) to decode alone and longer ones through P/D. Prompts
of N-1, N and N+1 tokens, completions and chat, streamed and not: the greedy answer equals the
normal proxy's, and the path counter says which way each went.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pcp_pd_kit.localstack.commands import proxy_spec
from pcp_pd_kit.localstack.live import post_json, scrape
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.report import total
from pcp_pd_kit.localstack.stack import Stack
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS

from .shape_matrix import send

pytestmark = pytest.mark.e2e
LOCAL_PROXY_PORT = 18545
WORDS = (
    "the farmer sold seven eggs and each student bought two more books than the week before "
    "so how many apples were left in the basket after they ate half of them at noon today"
).split()


def _count(decode: str, model: str, endpoint: str, text: str) -> int:
    body: dict[str, object] = {"model": model, "prompt": text}
    if endpoint == CHAT_COMPLETIONS:
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return int(post_json(f"{decode}/tokenize", body)["count"])


def _texts_around(decode: str, model: str, endpoint: str) -> tuple[int, list[str]]:
    """N and texts of N-1, N and N+1 tokens (word prefixes), as the model counts them."""
    by_count: dict[int, str] = {}
    for k in range(1, len(WORDS) + 1):
        text = " ".join(WORDS[:k])
        by_count.setdefault(_count(decode, model, endpoint, text), text)
    for n in sorted(by_count):
        if n > 8 and n - 1 in by_count and n + 1 in by_count:
            return n, [by_count[n - 1], by_count[n], by_count[n + 1]]
    raise AssertionError(f"no three consecutive prompt lengths among {sorted(by_count)}")


@pytest.fixture(scope="module")
def local_proxy(pd_stack: Stack) -> Iterator[tuple[str, int]]:
    """The proxy with the option and its N (from completions prompts; a chat prompt's route
    follows from its own count, template included)."""
    decode, model = pd_stack.urls["decode"], pd_stack.served_model_name
    n_completions, _ = _texts_around(decode, model, COMPLETIONS)
    # Routing off: the limit on the prompt's own count (its texts share prefixes, which a
    # cache-aware proxy would rightly send alone; test_cache_aware_routing covers that).
    settings = dataclasses.replace(
        pd_stack.settings, proxy_port=LOCAL_PROXY_PORT, prefix_cache_routing="off"
    )
    spec = proxy_spec(settings)
    argv = [*spec.argv, "--local-prefill-max-tokens", str(n_completions)]
    proc = ManagedProcess(
        dataclasses.replace(spec, name="proxy-local-prefill", argv=argv), pd_stack.log_dir
    )
    proc.start()
    try:
        wait_healthy([proc], 60)
        yield settings.url(LOCAL_PROXY_PORT), n_completions
    finally:
        proc.stop()


def _paths(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {p: total(samples, "pd_proxy_requests_total", path=p) or 0.0 for p in ("pd", "local")}


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_prompts_around_n_same_answer_on_both_paths(
    pd_stack: Stack, local_proxy: tuple[str, int], endpoint: str, stream: bool
) -> None:
    url, n = local_proxy
    decode, model = pd_stack.urls["decode"], pd_stack.served_model_name
    # chat's own N-1, N, N+1 (template included) are found the same way; each prompt's route
    # follows from its count against the option's N
    for text in _texts_around(decode, model, endpoint)[1]:
        count = _count(decode, model, endpoint, text)
        body: dict = {"model": model, "max_tokens": 12, "temperature": 0.0, "stream": stream}
        if endpoint == COMPLETIONS:
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        before = _paths(url)
        got = send(url, endpoint, body)
        after = _paths(url)
        want = send(pd_stack.urls["proxy"], endpoint, body)
        assert got.status == 200 and got == want, (count, n)
        went = "local" if count <= n else "pd"
        assert after[went] - before[went] == 1, (count, n, before, after)


def _first_byte_s(url: str, endpoint: str, body: dict) -> float:
    """Seconds to the first streamed byte of one request."""
    import json
    import time
    import urllib.request

    request = urllib.request.Request(
        f"{url}{endpoint}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read(1)
        first = time.monotonic() - start
        resp.read()
    return first


def test_short_prompt_ttft_local_vs_pd_vs_decode(
    pd_stack: Stack, local_proxy: tuple[str, int]
) -> None:
    """A prompt below N, at concurrency 1: time to first byte through the normal proxy (P/D),
    through the option's proxy (decode alone, after /tokenize) and from decode directly (a
    single instance). Logged for the docs; the local path must beat P/D's prefill leg."""
    import logging
    import statistics

    url, n = local_proxy
    decode, model = pd_stack.urls["decode"], pd_stack.served_model_name
    text = _texts_around(decode, model, COMPLETIONS)[1][0]  # N-1 tokens
    body = {"model": model, "prompt": text, "max_tokens": 4, "temperature": 0.0}
    figures = {}
    for name, base in (("pd", pd_stack.urls["proxy"]), ("local", url), ("single", decode)):
        _first_byte_s(base, COMPLETIONS, body)  # warm
        figures[name] = statistics.median(_first_byte_s(base, COMPLETIONS, body) for _ in range(7))
    logging.getLogger("pcp_pd_kit.localstack").info(
        "TTFB at %d tokens (N=%d), medians of 7: %s",
        n - 1,
        n,
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in figures.items()),
    )
    assert figures["local"] < figures["pd"]
