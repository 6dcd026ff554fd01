"""A follow-up turn's time to first token against one server at concurrency 1, cached and with a
unique ``cache_salt`` (a full prefill), the order alternating; each round a new first turn of
``--context`` token ids, its follow-up ``--new`` more. `bench cache` compares it through the kit.

    pcp-pd-kit bench prefix-ttft --url http://127.0.0.1:18200 --rounds 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.bench.tables import markdown_table

FIRST_ID, LAST_ID = 10, 2000  # past the tiny tokenizer's special tokens


def token_ids(seed: int, count: int, first: int = FIRST_ID) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(first, LAST_ID) for _ in range(count)]


def request_body(model: str, prompt: str | Sequence[int], salt: str | None) -> dict[str, object]:
    """One token, streamed; a text prompt or token ids; `salt`: a cache_salt of its own."""
    text = prompt if isinstance(prompt, str) else list(prompt)
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0,
            "stream": True, "cache_salt": salt}  # fmt: skip
    return {k: v for k, v in body.items() if v is not None}


def ttft_s(url: str, body: dict[str, object], timeout_s: float = 120.0) -> float:
    """Seconds from sending the request to the first streamed choice."""
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), headers)
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and '"choices"' in line:
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: the stream ended without a choice")


@dataclass(frozen=True)
class Summary:
    cached_ms: float
    uncached_ms: float
    rounds: int

    @property
    def ratio(self) -> float:
        return self.uncached_ms / self.cached_ms

    def line(self, context: int, new: int) -> str:
        return (
            f"follow-up turn ({context} cached + {new} new tokens), c=1, median of "
            f"{self.rounds}: cached {self.cached_ms:.1f} ms, uncached {self.uncached_ms:.1f} ms, "
            f"uncached/cached {self.ratio:.1f}x"
        )


def summarize(cached_s: Sequence[float], uncached_s: Sequence[float]) -> Summary:
    if not cached_s or len(cached_s) != len(uncached_s):
        raise ValueError("want the same number (> 0) of cached and uncached timings")
    cached_ms, uncached_ms = (statistics.median(s) * 1000 for s in (cached_s, uncached_s))
    return Summary(cached_ms, uncached_ms, len(cached_s))


def run_rounds(url: str, model: str, context: int, new: int, rounds: int, seed: int) -> Summary:
    cached: list[float] = []
    uncached: list[float] = []
    for i in range(rounds):
        first = token_ids(seed + 2 * i, context)
        follow_up = first + token_ids(seed + 2 * i + 1, new)
        ttft_s(url, request_body(model, first, None))  # fills the cache
        salted = request_body(model, follow_up, f"bench-{uuid.uuid4().hex}")
        plain = request_body(model, follow_up, None)
        order = [(uncached, salted), (cached, plain)]  # alternating: neither always goes first
        for timings, body in order if i % 2 else order[::-1]:
            timings.append(ttft_s(url, body))
    return summarize(cached, uncached)


HELP = "one server's follow-up-turn TTFT with its prefix cache against a full prefill"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [("--url", str, "http://127.0.0.1:18200", "one vLLM server"),
                       ("--model", str, "tiny-mla-moe", "its served model name"),
                       ("--context", int, 1440, "first turn, token ids"),
                       ("--new", int, 40, "new token ids in the follow-up"),
                       ("--rounds", int, 8, None), ("--seed", int, 7000, None)])  # fmt: skip


def check(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.context < 1 or args.new < 1:
        return "--rounds, --context and --new must be >= 1"
    return None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    summary = run_rounds(
        args.url.rstrip("/"), args.model, args.context, args.new, args.rounds, args.seed
    )
    table = markdown_table(
        ["follow-up turn", "cached p50 (ms)", "uncached p50 (ms)", "uncached/cached", "rounds"],
        [[f"{args.context} cached + {args.new} new tokens, c=1", f"{summary.cached_ms:.1f}",
          f"{summary.uncached_ms:.1f}", f"{summary.ratio:.1f}x", summary.rounds]],
    )  # fmt: skip
    used = knobs(args, "url", "model", "context", "new", "rounds", "seed")
    return Outcome({**dataclasses.asdict(summary), "ratio": summary.ratio}, table, {"bench": used})
