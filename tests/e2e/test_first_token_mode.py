"""pd-proxy's first-token-from-prefill mode on the real stack: the same greedy answers, token for
token, as the normal mode - completions and chat, streamed and not, usage included - and the mode
really continued the requests (its counter), rather than quietly falling back.

A second pd-proxy with `--first-token-from-prefill` runs beside the session stack's own, in front
of the same prefill and decode.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pcp_pd_kit.localstack.commands import proxy_spec
from pcp_pd_kit.localstack.live import scrape
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.report import total
from pcp_pd_kit.localstack.stack import Stack

from .clients import CASES

pytestmark = pytest.mark.e2e
FIRST_TOKEN_PORT = 18540
COUNTER = "pd_proxy_first_token_requests_total"


@pytest.fixture(scope="module")
def first_token_proxy(pd_stack: Stack) -> Iterator[str]:
    settings = dataclasses.replace(pd_stack.settings, proxy_port=FIRST_TOKEN_PORT)
    spec = proxy_spec(settings)
    spec = dataclasses.replace(
        spec, name="proxy-first-token", argv=[*spec.argv, "--first-token-from-prefill"]
    )
    proc = ManagedProcess(spec, pd_stack.log_dir)
    proc.start()
    try:
        wait_healthy([proc], 60)
        yield settings.url(FIRST_TOKEN_PORT)
    finally:
        proc.stop()


def _request(base: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """Text, finish reason and usage of one answer, streamed or not."""
    request = urllib.request.Request(
        f"{base}{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        raw = resp.read().decode()
    if not body.get("stream"):
        answer = json.loads(raw)
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"text": text, "finish": choice["finish_reason"], "usage": _counts(answer["usage"])}
    text, finish, usage = "", None, None
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        for choice in chunk.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            usage = _counts(chunk["usage"])
    return {"text": text, "finish": finish, "usage": usage}


def _counts(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _continued(url: str) -> float:
    return total(scrape(url), COUNTER, outcome="continued") or 0.0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_first_token_mode_answers_exactly_as_the_normal_mode(
    stream: bool, pd_stack: Stack, first_token_proxy: str
) -> None:
    normal = pd_stack.urls["proxy"]
    before = _continued(first_token_proxy)
    mismatches = []
    for case in CASES:
        body: dict[str, Any] = {
            **case.body,
            "model": pd_stack.served_model_name,
            "max_tokens": 24,
            "temperature": 0.0,
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        want = _request(normal, case.endpoint, body)
        got = _request(first_token_proxy, case.endpoint, body)
        if got != want:
            mismatches.append((case.name, want, got))
    assert not mismatches, mismatches
    continued = _continued(first_token_proxy) - before
    by_outcome = {
        s.labels.get("outcome", "?") + "/" + s.labels.get("reason", ""): s.value
        for s in scrape(first_token_proxy)
        if s.name == COUNTER and s.value
    }
    # Prompts whose length fills its last KV block exactly fall back (decode would need one more
    # block than prefill sent); every other case must have been continued from prefill's token.
    assert continued >= len(CASES) - 1, by_outcome


def test_max_tokens_1_is_answered_by_prefill_alone_and_frees_its_blocks(
    pd_stack: Stack, first_token_proxy: str
) -> None:
    case = CASES[1]
    body = {**case.body, "model": pd_stack.served_model_name, "max_tokens": 1, "temperature": 0.0}
    assert _request(first_token_proxy, case.endpoint, body) == _request(
        pd_stack.urls["proxy"], case.endpoint, body
    )
    finished = total(scrape(first_token_proxy), COUNTER, outcome="finished") or 0
    assert finished >= 1
