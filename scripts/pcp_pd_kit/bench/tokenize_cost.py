"""What pd-proxy's --local-prefill-max-tokens pays to count a prompt: a decode's ``POST /tokenize``
(aiohttp, as the proxy does) against a local tokenizer of the same model, inline or through
``asyncio.to_thread``; short and long, completions and chat; the counts must agree. Without
``--url`` it starts one plain vLLM of the kit's model (--port-base + 30) for the run.

    pcp-pd-kit bench tokenize --url http://127.0.0.1:18020     # a running decode
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pcp_pd_kit.bench.client import served_model
from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.results import Outcome
from pcp_pd_kit.bench.serve_plan import bench_settings
from pcp_pd_kit.bench.tables import markdown_table
from pcp_pd_kit.localstack.stack import REFERENCE_PARTS, Stack

HELP = "what counting a prompt costs: decode's /tokenize over HTTP vs a local tokenizer"
# Words for the prompts: any text will do, the model's tokenizer decides the count.
WORDS = (
    "the farmer sold seven eggs and each student bought two more books than the week before "
    "so how many apples were left in the basket after they ate half of them at noon today"
).split()
# (name, words): 36 and 303 tokens with the kit's tiny model as completions (the table says).
PROMPT_SIZES: tuple[tuple[str, int], ...] = (("short", 28), ("long", 230))
ENDPOINTS = ("completions", "chat")
WAYS: tuple[tuple[str, str], ...] = (("http", "decode /tokenize (aiohttp)"),
                                     ("local", "local tokenizer, inline"),
                                     ("local_thread", "local tokenizer, to_thread"))  # fmt: skip


def tokenize_body(model: str, endpoint: str, text: str) -> dict[str, Any]:
    """The /tokenize request pd-proxy sends for this prompt."""
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}]}
    return {"model": model, "prompt": text}


@dataclass(frozen=True)
class Stats:
    """Per-request seconds of one way of counting one prompt."""

    n: int
    median_ms: float
    p90_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        ms = sorted(s * 1000.0 for s in seconds)
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        return cls(len(ms), statistics.median(ms), p90, statistics.fmean(ms))


@dataclass(frozen=True)
class Row:
    """One prompt (size, endpoint): its token count by each way and the timings."""

    size: str
    endpoint: str
    counts: Mapping[str, int]
    stats: Mapping[str, Stats]

    @property
    def counts_agree(self) -> bool:
        return len(set(self.counts.values())) == 1


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: median (p90) ms per request for each way, and whether the counts agree."""
    body = []
    for row in rows:
        counts = "/".join(str(c) for c in dict.fromkeys(row.counts.values()))
        timings = [f"{s.median_ms:.3f} ({s.p90_ms:.3f})" for s in (row.stats[k] for k, _t in WAYS)]
        body.append([f"{row.size}, {row.endpoint}", counts, *timings])
    head = ["prompt", "tokens", *(title for _key, title in WAYS)]
    note = "\nms per request: median (p90). tokens: the count (two values: the ways disagree)."
    lines = [markdown_table(head, body), note]
    disagree = [f"{r.size}, {r.endpoint}: {dict(r.counts)}" for r in rows if not r.counts_agree]
    if disagree:
        lines += ["WARNING: the counts differ:", *(f"  {d}" for d in disagree)]
    return "\n".join(lines)


async def _timed(fn: Callable[[], Awaitable[int]], warmup: int, n: int) -> tuple[int, list[float]]:
    count, seconds = 0, []
    for i in range(warmup + n):
        start = time.perf_counter()
        count = await fn()
        if i >= warmup:  # the first ones untimed
            seconds.append(time.perf_counter() - start)
    return count, seconds


async def measure(url: str, model: str, tokenizer_dir: str, n: int, warmup: int) -> list[Row]:
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    print(f"local tokenizer loaded in {time.perf_counter() - start:.2f}s ({type(tok).__name__})")

    def local_count(endpoint: str, text: str) -> int:
        if endpoint == "chat":
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers
                ids = ids["input_ids"]
            return len(ids)
        return len(tok(text)["input_ids"])

    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for size, words in PROMPT_SIZES:
            text = " ".join(WORDS[i % len(WORDS)] for i in range(words))
            for endpoint in ENDPOINTS:
                body = json.dumps(tokenize_body(model, endpoint, text)).encode()

                async def http(body: bytes = body) -> int:
                    headers = {"Content-Type": "application/json"}
                    async with session.post(f"{url}/tokenize", data=body, headers=headers) as resp:
                        resp.raise_for_status()
                        return int((await resp.json())["count"])

                async def inline(endpoint: str = endpoint, text: str = text) -> int:
                    return local_count(endpoint, text)

                async def threaded(endpoint: str = endpoint, text: str = text) -> int:
                    return await asyncio.to_thread(local_count, endpoint, text)

                counts, stats = {}, {}
                for key, call in (("http", http), ("local", inline), ("local_thread", threaded)):
                    counts[key], seconds = await _timed(call, warmup, n)
                    stats[key] = Stats.of(seconds)
                rows.append(Row(size, endpoint, counts, stats))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--url", str, None, "a running vLLM (a decode); default: start one"),
        ("--tokenizer", str, None, "default: the served model's root"),
        ("--requests", int, 200, "timed per cell (%(default)s)"),
        ("--warmup", int, 20, "untimed first (%(default)s)"),
        ("--port-base", int, 18400, "when starting (%(default)s)"),
    ])  # fmt: skip


def check(args: argparse.Namespace) -> str | None:
    if args.requests < 1 or args.warmup < 0:
        return "--requests must be >= 1 and --warmup >= 0"
    return None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    url = args.url.rstrip("/") if args.url else None
    with contextlib.ExitStack() as servers:
        if url is None:  # one plain vLLM of the kit's model, stopped on the way out
            stack = Stack(bench_settings(args.port_base), REFERENCE_PARTS, work_dir=out / "servers")
            url = servers.enter_context(stack).urls["reference"]
        model, root = served_model(url)
        rows = asyncio.run(measure(url, model, args.tokenizer or root, args.requests, args.warmup))
    knobs = {"url": args.url, "requests": args.requests, "warmup": args.warmup, "model": model}
    rc = 0 if all(r.counts_agree for r in rows) else 1
    result = [{**asdict(r), "counts_agree": r.counts_agree} for r in rows]
    return Outcome(result, format_table(rows), {"bench": knobs}, rc=rc)
