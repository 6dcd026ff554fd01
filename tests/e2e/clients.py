"""Greedy OpenAI-API calls used to compare P/D output with the single-instance reference."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.localstack.live import post_json

MAX_TOKENS = 24
# Fewer tokens than a PCP2 prefill has chunks (2 x PCP = 4): some ranks get no query rows.
TINY_PROMPT = "Hi"
SHORT_PROMPT = "James has 3 apples and buys 5 more. How many"
MULTI_BLOCK_PROMPT = " ".join(
    f"On day {day} the farmer sold {day * 7} eggs for {day * 3} dollars, and each student "
    "bought two more books than the week before."
    for day in range(1, 9)
)
CHAT_MESSAGES = [
    {"role": "system", "content": "You answer math questions."},
    {"role": "user", "content": "Mary has 12 cookies and gives half to her friend. How many left?"},
]


@dataclass(frozen=True)
class Case:
    """One request kind; `body` is completed with the served model name at send time."""

    name: str
    endpoint: str
    body: dict[str, Any]


CASES = (
    Case("tiny", "/v1/completions", {"prompt": TINY_PROMPT}),
    Case("short", "/v1/completions", {"prompt": SHORT_PROMPT}),
    Case("multi_block", "/v1/completions", {"prompt": MULTI_BLOCK_PROMPT}),
    Case("chat", "/v1/chat/completions", {"messages": CHAT_MESSAGES}),
)


@dataclass(frozen=True)
class Output:
    text: str
    prompt_tokens: int
    finish_reason: str


def greedy(base_url: str, model: str, case: Case, timeout_s: float = 300.0) -> Output:
    """Send one greedy request; return the generated text and the prompt's token count."""
    body = {**case.body, "model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    answer = post_json(f"{base_url}{case.endpoint}", body, timeout_s=timeout_s)
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Output(text, answer["usage"]["prompt_tokens"], choice["finish_reason"])


def median_latency_s(base_url: str, model: str, requests: int = 7) -> float:
    """Median wall time of sequential greedy requests cycling through CASES."""
    seconds = []
    for i in range(requests):
        start = time.monotonic()
        greedy(base_url, model, CASES[i % len(CASES)])
        seconds.append(time.monotonic() - start)
    return statistics.median(seconds)
