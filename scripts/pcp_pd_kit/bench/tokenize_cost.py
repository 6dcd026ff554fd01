"""What counting a prompt's tokens costs per request: decode's ``/tokenize`` over HTTP (what
pd-proxy's --local-prefill-max-tokens does) against a local Hugging Face tokenizer of the same
model. Pure: the prompts to count, the statistics and the table; bench.tokenize_http does the
timing.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.bench.results import markdown_table

# Words for the prompts: any text will do, the model's tokenizer decides the count.
WORDS = (
    "the farmer sold seven eggs and each student bought two more books than the week before "
    "so how many apples were left in the basket after they ate half of them at noon today"
).split()
# (name, words): 36 and 303 tokens with the kit's tiny model as completions (the table prints
# each count, chat template included).
PROMPT_SIZES: tuple[tuple[str, int], ...] = (("short", 28), ("long", 230))
ENDPOINTS = ("completions", "chat")
# (column key, title) of the ways to count, in table order.
WAYS: tuple[tuple[str, str], ...] = (
    ("http", "decode /tokenize (aiohttp)"),
    ("local", "local tokenizer, inline"),
    ("local_thread", "local tokenizer, to_thread"),
)


def prompt_text(words: int) -> str:
    """A prompt of `words` words cycled from WORDS."""
    if words < 1:
        raise ValueError("a prompt needs at least one word")
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def tokenize_body(model: str, endpoint: str, text: str) -> dict[str, Any]:
    """The /tokenize request pd-proxy sends for this prompt (pd_proxy.local_prefill)."""
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}]}
    if endpoint == "completions":
        return {"model": model, "prompt": text}
    raise ValueError(f"endpoint {endpoint!r}: one of {ENDPOINTS}")


@dataclass(frozen=True)
class Stats:
    """Per-request seconds of one way of counting one prompt."""

    n: int
    median_ms: float
    p90_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        if not seconds:
            raise ValueError("no timings")
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
    """Markdown: median (p90) ms per request for each way, side by side, and whether the counts
    agree."""
    body = []
    for row in rows:
        counts = "/".join(str(c) for c in dict.fromkeys(row.counts.values()))
        cells = [f"{row.size}, {row.endpoint}", counts]
        for key, _title in WAYS:
            s = row.stats.get(key)
            cells.append("n/a" if s is None else f"{s.median_ms:.3f} ({s.p90_ms:.3f})")
        body.append(cells)
    lines = [markdown_table(["prompt", "tokens", *(title for _key, title in WAYS)], body)]
    lines.append(
        "\nms per request: median (p90). tokens: the count (two values: the ways disagree)."
    )
    disagree = [f"{r.size}, {r.endpoint}: {dict(r.counts)}" for r in rows if not r.counts_agree]
    if disagree:
        lines += ["WARNING: the counts differ:", *(f"  {d}" for d in disagree)]
    return "\n".join(lines)


def rows_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [
        {
            "size": r.size,
            "endpoint": r.endpoint,
            "counts": dict(r.counts),
            "counts_agree": r.counts_agree,
            "stats": {k: vars(v) for k, v in r.stats.items()},
        }
        for r in rows
    ]
