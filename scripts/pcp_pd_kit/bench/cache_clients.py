"""The cache bench's clients: conversations of two turns, short text prompts, counters read from
/metrics, and a decode's prefix cache emptied between runs. Blocking HTTP (urllib), one thread per
concurrent conversation.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from pcp_pd_kit.bench import cache_plan
from pcp_pd_kit.bench.metrics import counter_values
from pcp_pd_kit.bench.prefix_ttft import request_body, ttft_s
from pcp_pd_kit.localstack.report import parse_metrics

# The counters the cache bench reads, and the labels it keeps of each.
COUNTERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pd_proxy_requests_total", ("path",)),
    ("vllm:prefix_cache_hits_total", ()),
    ("vllm:prefix_cache_queries_total", ()),
    ("vllm:prompt_tokens_by_source_total", ("source",)),
    ("vllm:request_success_total", ()),
)
Counters = dict[str, float]
Send = Callable[[str, dict[str, object]], float]


def http_ttft(url: str, body: dict[str, object]) -> float:
    return ttft_s(url, body)


def follow_up_ttfts(
    url: str,
    model: str,
    seeds: Sequence[int],
    plan: cache_plan.CachePlan,
    concurrency: int,
    send: Send = http_ttft,
) -> list[float]:
    """One conversation per seed, ``concurrency`` at a time: the first turn (untimed), a pause
    of plan.think_ms, then the follow-up, whose TTFT (s) is returned in seed order."""

    def one(seed: int) -> float:
        first, follow_up = cache_plan.conversation(seed, plan.context, plan.new)
        send(url, request_body(model, first, None))
        time.sleep(plan.think_ms / 1000)
        return send(url, request_body(model, follow_up, None))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, seeds))


def short_body(model: str, text: str) -> dict[str, object]:
    return {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0, "stream": True}


def counters(url: str, timeout_s: float = 10.0) -> Counters:
    """The COUNTERS of one /metrics page, keyed by selector; {} when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
            samples = parse_metrics(resp.read().decode(errors="replace"))
    except (OSError, ValueError):
        return {}
    out: Counters = {}
    for name, keep in COUNTERS:
        out.update(counter_values(samples, name, keep) or {})
    return out


def snapshot(sources: Mapping[str, str]) -> dict[str, Counters]:
    return {name: counters(url) for name, url in sources.items()}


def grown(before: Mapping[str, Counters], after: Mapping[str, Counters]) -> dict[str, Counters]:
    """source -> selector -> growth (a series absent before counts from zero)."""
    return {
        source: {k: v - before.get(source, {}).get(k, 0.0) for k, v in later.items()}
        for source, later in after.items()
    }


def reset_prefix_cache(url: str, tries: int = 20) -> None:
    """Empty a server's prefix cache (vLLM's dev endpoint: the server runs with
    VLLM_SERVER_DEV_MODE=1); retried while blocks are still held."""
    for _ in range(tries):
        request = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as resp:
            text = resp.read().decode(errors="replace")
        try:
            ok = json.loads(text).get("success", True) if text.strip() else True
        except ValueError:
            ok = True
        if ok:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: the prefix cache could not be reset")


def added_special_tokens(url: str, model: str) -> int:
    """How many tokens the tokenizer adds to a completion prompt (a BOS): /tokenize of ''."""
    request = urllib.request.Request(
        f"{url}/tokenize",
        data=json.dumps({"model": model, "prompt": ""}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return int(json.loads(resp.read())["count"])
