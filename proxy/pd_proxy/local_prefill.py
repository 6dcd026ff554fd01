"""Conditional disaggregation: the prompts a decode prefills itself (--local-prefill-max-tokens).

A short prompt costs less to prefill on the decode than a prefill leg plus the KV handover. The
proxy counts the prompt's tokens with the served model's own tokenizer and chat template, by
asking a decode's ``POST /tokenize`` (vLLM serves it; for ``messages`` it renders the chat
template first), so the proxy stays free of tokenizer libraries and can never disagree with the
model about the count. A prompt given as token ids needs no request at all. Pure functions: the
``/tokenize`` body to send and its answer's count; the caller does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_proxy.rewrite import COMPLETIONS, loads

# Chat fields that change the rendered prompt: /tokenize takes them as the chat endpoint does.
CHAT_RENDER_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


def direct_count(body: Mapping[str, Any], endpoint: str) -> int | None:
    """The prompt's length when the body already has token ids (no tokenizer needed)."""
    prompt = body.get("prompt")
    if endpoint == COMPLETIONS and isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return len(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], list):
            return len(prompt[0])
    return None


def tokenize_body(body: Mapping[str, Any], endpoint: str) -> dict[str, Any] | None:
    """The ``/tokenize`` request that counts the request's prompt as the model will see it, or
    None when the prompt is not one text (those take P/D: the decision needs one count)."""
    out: dict[str, Any] = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    out["messages"] = messages
    for key in CHAT_RENDER_FIELDS:
        if key in body:
            out[key] = body[key]
    return out


def count_from_answer(data: bytes) -> int:
    """The ``count`` of a ``/tokenize`` answer; ``ValueError`` when it has none."""
    obj = loads(data)
    count = obj.get("count") if isinstance(obj, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError("/tokenize answer without a count")
    return count


def goes_local(count: int | None, max_tokens: int) -> bool:
    """A prompt of at most ``max_tokens`` tokens is prefilled by the decode (0: never)."""
    return max_tokens > 0 and count is not None and count <= max_tokens
