"""One P/D request through the proxy before the local stack reports up.

Why: the first P/D request after start-up is the one that makes decode's first NIXL handshake
with prefill (the side-channel query, prefill's agent metadata and every KV block descriptor
loaded into decode's agent) and opens the first UCX connection between them; every later
request reuses them. A user's first request right after "stack up" used to pay for that, and
once in a while it got no answer at all (the proxy's 504 at its decode limit) while every later
request was fine. Start-up now sends that first request itself, through the same proxy, prefill
and decode a client uses, and retries it, so the first client request finds the path open.

The request must go P/D to open that path: its prompt is longer than the proxy's
LOCAL_PREFILL_MAX_TOKENS (a shorter one would go to decode alone), and it sends the stack's client
key when the proxy wants one.

The loop is pure (``warm_up`` takes the sender); ``proxy_sender`` is the real request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pcp_pd_kit.localstack.live import HttpError, post_json

log = logging.getLogger("pcp_pd_kit.localstack")

PROMPT = "Warm-up: 1, 2, 3,"
# Numbers past the local-prefill limit: each ", N" is at least one token in any tokenizer.
MARGIN = 16
MAX_TOKENS = 4
ATTEMPTS = 3
PAUSE_S = 1.0  # between a failed attempt and the next


class WarmupError(RuntimeError):
    """Every warm-up request failed: the P/D path does not serve."""


@dataclass(frozen=True)
class WarmupResult:
    """How the warm-up went: the seconds of the request that answered, and each failure before
    it (empty when the first try answered)."""

    seconds: float
    failures: tuple[str, ...]


def warm_up(
    send: Callable[[], None],
    attempts: int = ATTEMPTS,
    pause_s: float = PAUSE_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> WarmupResult:
    """Call ``send`` until one call returns; an HttpError is a failed attempt, logged and retried
    after ``pause_s``. Raises WarmupError naming every failure after ``attempts`` tries."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        start = clock()
        try:
            send()
        except HttpError as exc:
            failures.append(f"try {attempt}: {exc} after {clock() - start:.1f}s")
            log.warning("warm-up request failed (%s)", failures[-1])
            if attempt < attempts:
                sleep(pause_s)
            continue
        return WarmupResult(clock() - start, tuple(failures))
    raise WarmupError(
        f"no warm-up request through the proxy was answered in {attempts} tries: "
        + "; ".join(failures)
    )


def warmup_prompt(local_prefill_max_tokens: int) -> str:
    """PROMPT, counted on past ``local_prefill_max_tokens`` tokens so the proxy sends it P/D."""
    if local_prefill_max_tokens <= 0:
        return PROMPT
    count = local_prefill_max_tokens + MARGIN
    return "Warm-up: " + ", ".join(str(n) for n in range(1, count + 1)) + ","


def proxy_sender(
    proxy_url: str,
    model: str,
    timeout_s: float,
    local_prefill_max_tokens: int = 0,
    headers: dict[str, str] | None = None,
) -> Callable[[], None]:
    """A greedy completion through the proxy (prefill leg, KV over NIXL, decode leg): a prompt
    the proxy sends P/D, with ``headers`` (the stack's client key, keys.auth_headers)."""
    prompt = warmup_prompt(local_prefill_max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}

    def send() -> None:
        post_json(f"{proxy_url}/v1/completions", body, timeout_s=timeout_s, headers=headers)

    return send
