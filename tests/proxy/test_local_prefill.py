"""Conditional disaggregation's pure parts: what to count, how, and the threshold."""

from __future__ import annotations

import pytest

from pd_proxy.local_prefill import count_from_answer, direct_count, goes_local, tokenize_body
from pd_proxy.rewrite import CHAT_COMPLETIONS, COMPLETIONS


def test_token_ids_are_counted_without_a_tokenizer() -> None:
    assert direct_count({"prompt": [5, 6, 7]}, COMPLETIONS) == 3
    assert direct_count({"prompt": [[5, 6]]}, COMPLETIONS) == 2
    assert direct_count({"prompt": "text"}, COMPLETIONS) is None
    assert direct_count({"prompt": [True, 2]}, COMPLETIONS) is None
    assert direct_count({"prompt": [[1], [2]]}, COMPLETIONS) is None  # a list: fan-out's


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


def test_count_from_answer() -> None:
    assert count_from_answer(b'{"count": 7, "max_model_len": 64, "tokens": [1]}') == 7
    for bad in (b'{"tokens": []}', b'{"count": -1}', b'{"count": true}', b"[]"):
        with pytest.raises(ValueError):
            count_from_answer(bad)


@pytest.mark.parametrize(
    ("count", "limit", "local"),
    [(31, 32, True), (32, 32, True), (33, 32, False), (1, 0, False), (None, 32, False)],
)
def test_goes_local(count: int | None, limit: int, local: bool) -> None:
    assert goes_local(count, limit) is local
