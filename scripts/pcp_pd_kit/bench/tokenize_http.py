"""What pd-proxy's --local-prefill-max-tokens pays to count a prompt, measured per request.

The proxy asks a decode's ``POST /tokenize`` (aiohttp, as the proxy does). The alternative is a
local Hugging Face tokenizer of the same model dir (transformers' AutoTokenizer; for chat its
chat template applied), run inline (blocking the event loop) or through ``asyncio.to_thread``
(what a proxy must do not to block it). Short (36 tokens) and long (303 tokens) prompts, for
completions and chat; medians over ``--requests`` after a warm-up; the counts of both ways must
agree.

    pcp-pd-kit bench tokenize                                  # starts a vLLM, stops it
    pcp-pd-kit bench tokenize --url http://127.0.0.1:18020     # a running decode

Without ``--url`` it starts one plain vLLM of the kit's model (the local stack's single-instance
part, on --port-base + 30; the same /tokenize code as a decode's) and stops it afterwards. Run it
under the same lock as other timing measurements: it times a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from pcp_pd_kit.bench import tokenize_cost as tc
from pcp_pd_kit.bench.results import Outcome

HELP = "what counting a prompt costs: decode's /tokenize over HTTP vs a local tokenizer"


async def _timed(
    call: Callable[[], Awaitable[int]], warmup: int, n: int
) -> tuple[int, list[float]]:
    count = 0
    for _ in range(warmup):
        count = await call()
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        count = await call()
        seconds.append(time.perf_counter() - start)
    return count, seconds


async def measure(url: str, model: str, tokenizer_dir: str, n: int, warmup: int) -> list[tc.Row]:
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
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for size, words in tc.PROMPT_SIZES:
            text = tc.prompt_text(words)
            for endpoint in tc.ENDPOINTS:
                body = json.dumps(tc.tokenize_body(model, endpoint, text)).encode()

                async def http(body: bytes = body) -> int:
                    async with session.post(
                        f"{url}/tokenize",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        resp.raise_for_status()
                        return int((await resp.json())["count"])

                async def inline(endpoint: str = endpoint, text: str = text) -> int:
                    return local_count(endpoint, text)

                async def threaded(endpoint: str = endpoint, text: str = text) -> int:
                    return await asyncio.to_thread(local_count, endpoint, text)

                counts, stats = {}, {}
                for key, call in (("http", http), ("local", inline), ("local_thread", threaded)):
                    counts[key], seconds = await _timed(call, warmup, n)
                    stats[key] = tc.Stats.of(seconds)
                rows.append(tc.Row(size, endpoint, counts, stats))
    return rows


def served(url: str) -> tuple[str, str]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        first = json.loads(resp.read())["data"][0]
    return str(first["id"]), str(first.get("root") or first["id"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running vLLM (a decode); default: start one")
    parser.add_argument("--tokenizer", default=None, help="default: the served model's root")
    parser.add_argument("--requests", type=int, default=200, help="timed per cell (%(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed first (%(default)s)")
    parser.add_argument("--port-base", type=int, default=18400, help="when starting (%(default)s)")


def check(args: argparse.Namespace) -> str | None:
    if args.requests < 1 or args.warmup < 0:
        return "--requests must be >= 1 and --warmup >= 0"
    return None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    stack = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        from pcp_pd_kit.bench import spec
        from pcp_pd_kit.localstack.stack import REFERENCE_PARTS, Stack
        from pcp_pd_kit.settings import kit_env, settings_from_env

        ports = spec.bench_ports(args.port_base)
        settings = dataclasses.replace(settings_from_env(kit_env(os.environ)), **ports)  # type: ignore[arg-type]
        stack = Stack(settings, parts=REFERENCE_PARTS, work_dir=out / "servers")
        stack.start()
        url = stack.urls["reference"]
    try:
        model, root = served(url)
        rows = asyncio.run(measure(url, model, args.tokenizer or root, args.requests, args.warmup))
    finally:
        if stack is not None:
            stack.stop()
    knobs = {"url": args.url, "requests": args.requests, "warmup": args.warmup, "model": model}
    return Outcome(
        tc.rows_json(rows),
        tc.format_table(rows),
        {"bench": knobs},
        rc=0 if all(r.counts_agree for r in rows) else 1,
    )
