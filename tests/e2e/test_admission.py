"""Admission on the real CPU stack: a flood from one client key and a trickle from another.

A second pd-proxy in front of the shared stack's prefill and decode, with the shipped settings
(.env.example: admission on with the CPU limits, LOCAL_PREFILL_MAX_TOKENS) and a key file naming
two flows. The light client's short requests are timed alone first, then while the other key
sends several times what the stack serves at once. Then:
- no 5xx;
- every refusal is a 429 (or 503) with Retry-After, answered within 2 s, before any backend;
- some of the flood is served, none waiting over 90 s for its first token;
- the light client is never refused, and its median time to first token stays within 5x its
  median alone;
- the prefill's KV is freed afterwards (KV usage 0, every held request released), and the
  proxy counted the refusals it answered.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from pcp_pd_kit.localstack.commands import proxy_spec
from pcp_pd_kit.localstack.keys import auth_headers
from pcp_pd_kit.localstack.live import scrape, settle_prefill
from pcp_pd_kit.localstack.model_source import tokenizer_folder
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.report import total
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import settings_from_env
from tests.support.env import example_env

pytestmark = pytest.mark.e2e

ADMISSION_PROXY_PORT = 18549  # apart from the other e2e proxies (18540-18548)
FLOOD_KEY, LIGHT_KEY = "sk-e2e-flood", "sk-e2e-light"
SHIPPED = settings_from_env(example_env())
# At once: 1.5x the shipped CPU queue plus the prefill's room, so part of it is refused whatever
# this host's speed (the predicted wait may refuse more on a slow one).
FLOOD = SHIPPED.queue_size * 3 // 2 + SHIPPED.prefill_max_inflight
FLOOD_WORDS = 300  # about 500 tokens each, uncached (a fresh seed per request)
LIGHT_ALONE, LIGHT_LOADED = 5, 6
MAX_TOKENS = 8
WORDS = (
    "farmer sold seven eggs each student bought two more books than week before apples left "
    "basket after they ate half noon today river crossed bridge market opened early morning"
).split()


@dataclass(frozen=True)
class Reply:
    status: int
    headers_s: float  # until the status line and headers
    ttft_s: float | None  # until the first streamed token (served requests)
    retry_after: str | None


def stream(url: str, key: str, prompt: str, timeout_s: float = 180.0) -> Reply:
    """A streamed completion; the time to its headers and to its first token."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth_headers(key)},
        method="POST",
    )
    start = time.monotonic()
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        exc.read()
        return Reply(exc.code, time.monotonic() - start, None, exc.headers.get("Retry-After"))
    headers_s, ttft = time.monotonic() - start, None
    with response:
        for line in response:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.monotonic() - start
    return Reply(response.status, headers_s, ttft, response.headers.get("Retry-After"))


def flood_prompt() -> str:
    rng = random.Random(uuid.uuid4().hex)
    return f"Report {uuid.uuid4().hex}: " + " ".join(rng.choice(WORDS) for _ in range(FLOOD_WORDS))


def light_prompt(i: int) -> str:
    return f"Note {i} {uuid.uuid4().hex[:6]}: James has 3 apples and buys 5 more. How many"


def ttfts(replies: list[Reply]) -> list[float]:
    return [r.ttft_s for r in replies if r.ttft_s is not None]


@pytest.fixture(scope="module")
def admission_proxy(pd_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """pd-proxy with the shipped admission and local-prefill settings and two flows' keys."""
    assert pd_stack.model is not None
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{FLOOD_KEY} flow=flood\n{LIGHT_KEY} flow=light\n")
    shipped = SHIPPED
    assert shipped.admission, "admission is off in .env.example"
    settings = dataclasses.replace(
        pd_stack.settings,
        proxy_port=ADMISSION_PROXY_PORT,
        api_key_file=str(keys),
        local_prefill_max_tokens=shipped.local_prefill_max_tokens,
        **{f.name: getattr(shipped, f.name) for f in dataclasses.fields(shipped) if _admits(f)},
    )
    spec = proxy_spec(settings, tokenizer=tokenizer_folder(pd_stack.model.path))
    proc = ManagedProcess(dataclasses.replace(spec, name="proxy-admission"), pd_stack.log_dir)
    proc.start()
    try:
        wait_healthy([proc], pd_stack.settings.startup_timeout_s)
        yield settings.url(ADMISSION_PROXY_PORT)
    finally:
        proc.stop()


def _admits(field: dataclasses.Field[object]) -> bool:
    return field.name in {
        "admission",
        "prefill_max_inflight",
        "prefill_max_tokens",
        "decode_max_inflight",
        "decode_max_pending_pulls",
        "queue_size",
        "queue_timeout_s",
    }


def refused_total(url: str) -> float:
    samples = scrape(url, auth_headers(LIGHT_KEY))
    return total(samples, "pd_proxy_admission_total", outcome="refused") or 0.0


def test_a_flood_is_bounded_and_a_light_client_keeps_its_latency(
    pd_stack: Stack, admission_proxy: str
) -> None:
    url, started = admission_proxy, time.monotonic()
    stream(url, LIGHT_KEY, light_prompt(-1))  # the proxy's first request: its connections open
    alone = [stream(url, LIGHT_KEY, light_prompt(i)) for i in range(LIGHT_ALONE)]
    assert [r.status for r in alone] == [200] * LIGHT_ALONE
    refused_before = refused_total(url)

    go = threading.Event()

    def flood_one(_: int) -> Reply:
        go.wait()
        return stream(url, FLOOD_KEY, flood_prompt())

    with ThreadPoolExecutor(max_workers=FLOOD) as pool:
        futures = [pool.submit(flood_one, i) for i in range(FLOOD)]
        go.set()
        time.sleep(1.0)  # the flood is admitted, queued or refused by now
        loaded = [stream(url, LIGHT_KEY, light_prompt(100 + i)) for i in range(LIGHT_LOADED)]
        flood = [f.result() for f in futures]

    statuses = sorted(r.status for r in flood + loaded)
    refused = [r for r in flood + loaded if r.status in (429, 503)]
    served = [r for r in flood if r.status == 200]
    assert all(s in (200, 429, 503) for s in statuses), statuses  # no 5xx but admission's 503
    assert all(r.retry_after and int(r.retry_after) >= 1 for r in refused), refused
    assert all(r.headers_s < 2.0 for r in refused), [r.headers_s for r in refused]
    assert refused, "the flood was never refused: it did not exceed the queue"
    assert served, "none of the flood was served"
    assert max(ttfts(served)) < 90.0, ttfts(served)
    assert [r.status for r in loaded] == [200] * LIGHT_LOADED, loaded
    median_alone, median_loaded = statistics.median(ttfts(alone)), statistics.median(ttfts(loaded))
    assert median_loaded <= 5 * median_alone, (median_alone, median_loaded)
    # The proxy counted what it refused; the prefill freed the KV of everything it computed.
    assert refused_total(url) - refused_before == len(refused)
    assert settle_prefill(pd_stack.urls["prefill"], 60.0) is not None, "prefill still holds KV"
    print(
        f"admission: flood {FLOOD} -> {len(served)} served (first token median "
        f"{statistics.median(ttfts(served)):.1f}s, max {max(ttfts(served)):.1f}s), "
        f"{len(refused)} refused; light first token median {median_alone * 1000:.0f} ms alone, "
        f"{median_loaded * 1000:.0f} ms under the flood; {time.monotonic() - started:.0f}s"
    )


def test_the_proxy_wants_a_key(admission_proxy: str) -> None:
    """The keys are in force: no key, no admission (401 before the queue)."""
    reply = stream(admission_proxy, "", light_prompt(0))
    assert reply.status == 401
