"""Start the local P/D stack, send one request the moment it reports up and one after a pause.

The first request after start-up is the one that pays for the decode's first NIXL handshake and
its first transfer; every later one reuses them. A start whose first request fails or is slow
keeps its logs (prefill, decode, proxy) under ``run/first-request/``, so the cause can be read
from the failing run itself.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

from pcp_pd_kit.localstack.live import HttpError, post_json
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import StackSettings

from .clients import SHORT_PROMPT

log = logging.getLogger("pcp_pd_kit.localstack")

# Apart from make up (18000s), make bench (18400s), e2e (18500s), the bench smoke (18600s).
PORTS = {
    "proxy_port": 18700,
    "prefill_port": 18710,
    "prefill_side_channel_port": 18711,
    "prefill_kv_events_port": 18712,
    "prefill_kv_replay_port": 18713,
    "decode_port": 18720,
    "decode_side_channel_port": 18721,
    "decode_kv_events_port": 18722,
    "decode_kv_replay_port": 18723,
    "reference_port": 18730,
    "prometheus_port": 18790,
}
MAX_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Answer:
    """One request through the proxy: HTTP status (None: nothing answered) and wall seconds."""

    status: int | None
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclasses.dataclass(frozen=True)
class StartResult:
    """One start of the stack: its start-up seconds and the two requests' answers."""

    index: int
    startup_s: float
    warmup_failures: tuple[str, ...]  # the stack's own warm-up tries that failed
    first: Answer
    after_pause: Answer
    kept_logs: Path | None

    def line(self) -> str:
        def text(answer: Answer) -> str:
            return f"{answer.status} in {answer.seconds:.2f}s"

        kept = f", logs kept in {self.kept_logs}" if self.kept_logs else ""
        warm = f" (warm-up failures: {'; '.join(self.warmup_failures)})"
        return (
            f"start {self.index}: up after {self.startup_s:.0f}s"
            f"{warm if self.warmup_failures else ''}, first request "
            f"{text(self.first)}, after the pause {text(self.after_pause)}{kept}"
        )


def settings_for(base: StackSettings) -> StackSettings:
    return dataclasses.replace(base, **PORTS)  # type: ignore[arg-type]


def ask(stack: Stack, timeout_s: float) -> Answer:
    """One greedy completion through the proxy; an HTTP error is an answer, not an exception."""
    body = {
        "model": stack.served_model_name,
        "prompt": SHORT_PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    start = time.monotonic()
    try:
        post_json(f"{stack.urls['proxy']}/v1/completions", body, timeout_s=timeout_s)
    except HttpError as exc:
        return Answer(exc.status, time.monotonic() - start, exc.body[:300])
    return Answer(200, time.monotonic() - start)


def client_timeout_s(settings: StackSettings) -> float:
    """Longer than the proxy's own limits, so a stall shows as the proxy's 504, not ours."""
    s = settings
    return 2 * s.proxy_connect_timeout_s + s.proxy_decode_timeout_s + 60.0


def start_and_ask(
    settings: StackSettings,
    work_dir: Path,
    keep_dir: Path,
    index: int,
    pause_s: float,
    warm: bool = True,
) -> StartResult:
    """Start a fresh stack (``warm``: with its warm-up), ask at once and after ``pause_s``, stop
    it; keep the logs of a start where a request, or a warm-up try, failed."""
    shutil.rmtree(work_dir, ignore_errors=True)
    stack = Stack(settings, work_dir=work_dir, warm=warm)
    began = time.monotonic()
    with stack:
        startup_s = time.monotonic() - began
        timeout_s = client_timeout_s(settings)
        first = ask(stack, timeout_s)
        time.sleep(pause_s)
        after = ask(stack, timeout_s)
    warm_failures = stack.warmup.failures if stack.warmup else ()
    kept: Path | None = None
    if warm_failures or not (first.ok and after.ok):
        kept = keep_dir / f"start-{index}-{time.strftime('%H%M%S')}"
        shutil.copytree(stack.log_dir, kept)
    result = StartResult(index, startup_s, warm_failures, first, after, kept)
    log.info("%s", result.line())
    return result
