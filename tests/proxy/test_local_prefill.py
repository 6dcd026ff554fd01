"""Conditional disaggregation's pure parts: the prompt's ids, the /tokenize body and answer, and
the threshold (pd_proxy.routing.decider)."""

from __future__ import annotations

import pytest

from pd_proxy.backends.route import LOCAL, PD
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.routing.decider import decide
from pd_proxy.routing.token_count import direct_ids, ids_from_answer, tokenize_body


def test_token_ids_are_taken_from_the_request_without_a_tokenizer() -> None:
    assert direct_ids({"prompt": [5, 6, 7]}, COMPLETIONS) == [5, 6, 7]
    assert direct_ids({"prompt": [[5, 6]]}, COMPLETIONS) == [5, 6]
    assert direct_ids({"prompt": "text"}, COMPLETIONS) is None
    assert direct_ids({"prompt": [True, 2]}, COMPLETIONS) is None
    assert direct_ids({"prompt": [[1], [2]]}, COMPLETIONS) is None  # a list: fan-out's
    assert direct_ids({"prompt": [5, 6]}, CHAT_COMPLETIONS) is None


def test_tokenize_body_completions() -> None:
    body = {"model": "m", "prompt": ["one text"], "max_tokens": 3, "add_special_tokens": False}
    assert tokenize_body(body, COMPLETIONS) == {
        "model": "m",
        "prompt": "one text",
        "add_special_tokens": False,
    }
    assert tokenize_body({"prompt": ["a", "b"]}, COMPLETIONS) is None


def test_tokenize_body_chat_keeps_what_renders_the_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {
        "model": "m",
        "messages": messages,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.5,
        "stream": True,
    }
    assert tokenize_body(body, CHAT_COMPLETIONS) == {
        "model": "m",
        "messages": messages,
        "tools": body["tools"],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert tokenize_body({"messages": "nope"}, CHAT_COMPLETIONS) is None


def test_ids_from_answer() -> None:
    assert ids_from_answer(b'{"count": 2, "max_model_len": 64, "tokens": [1, 9]}') == [1, 9]
    for bad in (b'{"count": 2}', b'{"tokens": [1, true]}', b'{"tokens": "12"}', b"[]"):
        with pytest.raises(ValueError):
            ids_from_answer(bad)


@pytest.mark.parametrize(
    ("count", "limit", "path"),
    [(31, 32, LOCAL), (32, 32, LOCAL), (33, 32, PD), (1, 0, PD), (None, 32, PD)],
)
def test_the_limit_sends_short_prompts_local(count: int | None, limit: int, path: str) -> None:
    assert decide(count, 0, limit)[0] == path


# ---------------------------------------------------------------- through the proxy, on fakes
def _requests(stack, path: str) -> float:
    return sum(
        stack.sample("pd_proxy_requests_total", {"endpoint": e, "status": "200", "path": path})
        or 0.0
        for e in (COMPLETIONS, CHAT_COMPLETIONS)
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
async def test_prompts_up_to_n_tokens_go_to_decode_alone(endpoint: str, stream: bool) -> None:
    """The fake counts BOS + one token per word (its chat template adds its own): find N for a
    prompt with the fake's /tokenize, then N-1, N and N+1 tokens take local, local, P/D and all
    three answer as the normal flow does."""
    from pd_proxy.testing.fake_model import render_chat, tokenize
    from tests.proxy.proxy_harness import pd_stack

    def body(words: int) -> dict:
        text = " ".join(f"w{i}" for i in range(words))
        if endpoint == COMPLETIONS:
            return {"model": "fake-model", "prompt": text, "max_tokens": 3, "stream": stream}
        messages = [{"role": "user", "content": text}]
        return {"model": "fake-model", "messages": messages, "max_tokens": 3, "stream": stream}

    def count(b: dict) -> int:
        return len(tokenize(render_chat(b) if "messages" in b else b["prompt"]))

    n = count(body(6))
    async with pd_stack() as normal:
        want = [(await normal.post(endpoint, body(w)))[2] for w in (5, 6, 7)]
    async with pd_stack(local_prefill_max_tokens=n) as s:
        s.decode.knobs.plain_requests = True
        for words, expect_local, answer in zip((5, 6, 7), (True, True, False), want, strict=True):
            local_before, pd_before = _requests(s, "local"), _requests(s, "pd")
            prefills = len(s.prefill.seen)
            status, _, raw = await s.post(endpoint, body(words))
            assert status == 200, raw
            assert _without_ids(raw) == _without_ids(answer)
            assert (_requests(s, "local") - local_before) == int(expect_local)
            assert (_requests(s, "pd") - pd_before) == int(not expect_local)
            assert len(s.prefill.seen) - prefills == int(not expect_local)
            assert count(body(words)) - n == words - 6
        assert s.decode.tokenize_requests == 3


def _without_ids(raw: bytes) -> bytes:
    """Answers differ in their ids and timestamps only."""
    import re

    return re.sub(rb'"(id|created)": ?("[^"]*"|\d+)', b"", raw)


async def test_token_id_prompts_are_counted_without_tokenize() -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(local_prefill_max_tokens=4) as s:
        s.decode.knobs.plain_requests = True
        status, _, raw = await s.post(COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 2})
        assert status == 200, raw
        assert not s.prefill.seen and s.decode.tokenize_requests == 0


async def test_tokenize_failure_takes_p_d() -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(local_prefill_max_tokens=100) as s:
        s.decode.knobs.tokenize_down = True
        status, _, raw = await s.post(COMPLETIONS, {"prompt": "a b", "max_tokens": 2})
        assert status == 200, raw
        assert s.decode.tokenize_requests == 1
        assert len(s.prefill.seen) == 1  # P/D, not an error


async def test_a_slow_tokenize_takes_p_d_after_the_tokenize_timeout() -> None:
    """``/tokenize`` has its own short limit, not the decode's (300 s by default)."""
    import time

    from tests.proxy.proxy_harness import pd_stack

    # The limit bounds the side call's connect too, and a connect cut short marks the decode
    # down: 1 s, so a stalled (loaded) host cannot end it there; the 5 s delay dwarfs it.
    async with pd_stack(local_prefill_max_tokens=100, tokenize_timeout=1.0) as s:
        s.decode.knobs.tokenize_delay = 5.0
        start = time.perf_counter()
        status, _, raw = await s.post(COMPLETIONS, {"prompt": "a b", "max_tokens": 2})
        elapsed = time.perf_counter() - start
        assert status == 200, raw
        assert len(s.prefill.seen) == 1  # P/D
        assert elapsed < 4.0  # not the 5 s /tokenize
