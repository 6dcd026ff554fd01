"""The decode leg takes the prompt as the token ids the prefill computed (vLLM's decode-side
token reuse): which requests, how each endpoint carries them, and the fallback to the text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.protocol.pd_bodies import (
    decode_payload,
    prefill_body,
    prompt_ids_from_prefill,
    reuses_prompt_ids,
)
from pd_proxy.testing.fake_model import tokenize
from tests.proxy.proxy_harness import Stack, pd_stack

KV = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
TEXT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("endpoint", "body", "reuses"),
    [
        (COMPLETIONS, {"prompt": "a b"}, True),
        (COMPLETIONS, {"prompt": ["a b"]}, True),  # a batch of one
        (COMPLETIONS, {"prompt": "a b", "logprobs": 2, "stream": True}, True),
        (COMPLETIONS, {"prompt": ["a", "b"]}, False),  # several prompts
        (COMPLETIONS, {"prompt": [1, 2, 3]}, False),  # ids already
        (COMPLETIONS, {"prompt": ""}, False),
        (COMPLETIONS, {"prompt": "a b", "echo": True}, False),  # the text is answered
        (COMPLETIONS, {"prompt": "a b", "suffix": "c"}, False),  # rendered around the prompt
        (COMPLETIONS, {"prompt_embeds": "..."}, False),
        (CHAT_COMPLETIONS, {"messages": TEXT}, True),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
            True,
        ),
        (CHAT_COMPLETIONS, {"messages": TEXT, "return_prompt_text": True}, False),
        (CHAT_COMPLETIONS, {"messages": TEXT, "echo": True}, False),
        (
            CHAT_COMPLETIONS,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
                ]
            },
            False,
        ),
        (CHAT_COMPLETIONS, {"messages": "hi"}, False),
    ],
)
def test_which_requests_forward_the_prompt_ids(
    endpoint: Any, body: dict[str, Any], reuses: bool
) -> None:
    assert reuses_prompt_ids(endpoint, body) is reuses
    assert prefill_body(body, prompt_ids=reuses).get("return_token_ids") is (
        True if reuses else None
    )


def test_the_ids_are_read_where_each_endpoint_answers_them() -> None:
    completion = {"choices": [{"text": "x", "prompt_token_ids": [1, 5, 6]}]}
    chat = {"choices": [{"message": {}}], "prompt_token_ids": [1, 7]}
    assert prompt_ids_from_prefill(COMPLETIONS, completion) == [1, 5, 6]
    assert prompt_ids_from_prefill(CHAT_COMPLETIONS, chat) == [1, 7]
    for bad in (
        {"choices": [{"prompt_token_ids": None}]},
        {"choices": [{"prompt_token_ids": [1, True]}]},
        {"choices": [{"prompt_token_ids": []}]},
        {"choices": []},
        {"choices": "x"},
    ):
        assert prompt_ids_from_prefill(COMPLETIONS, bad) is None
    assert prompt_ids_from_prefill(CHAT_COMPLETIONS, {"prompt_token_ids": "1 7"}) is None


def test_completions_get_the_ids_as_prompt_and_chat_in_the_kv_params() -> None:
    body = {"prompt": "a b", "max_tokens": 3, "stream": True}
    raw = json.dumps(body).encode()
    out = json.loads(decode_payload(raw, body, KV, COMPLETIONS, [1, 5]))
    assert out == {**body, "prompt": [1, 5], "kv_transfer_params": KV}
    chat = {"messages": TEXT, "max_tokens": 3}
    out = json.loads(decode_payload(json.dumps(chat).encode(), chat, KV, CHAT_COMPLETIONS, [1, 7]))
    assert out == {**chat, "kv_transfer_params": {**KV, "prompt_token_ids": [1, 7]}}
    assert KV == {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}  # not mutated
    # no KV to pull (the prefill's token was EOS): the decode computes the client's own prompt
    assert json.loads(decode_payload(raw, body, None, COMPLETIONS, [1, 5])) == {
        **body,
        "kv_transfer_params": None,
    }


def count(s: Stack, outcome: str, reason: str = "") -> float:
    labels = {"outcome": outcome, "reason": reason}
    return s.sample("pd_proxy_decode_prompt_ids_total", labels) or 0.0


async def test_the_decode_computes_on_the_prefills_ids_and_each_outcome_is_counted() -> None:
    async with pd_stack() as s:
        body = {"model": "fake-model", "prompt": "one two three", "max_tokens": 2}
        status, _, raw = await s.post("/v1/completions", body)
        assert status == 200, raw
        assert s.decode.seen[-1].body["prompt"] == tokenize("one two three")
        assert count(s, "forwarded") == 1
        status, _, raw = await s.post("/v1/completions", {**body, "echo": True})
        assert status == 200, raw
        assert s.decode.seen[-1].body["prompt"] == "one two three"
        assert count(s, "text", "not_eligible") == 1
        # a prefill that answers no ids (an older server): the decode gets the client's text
        kv = {"do_remote_prefill": True, "remote_block_ids": [[9]], "remote_engine_id": "p"}
        s.prefill.knobs.fail_status = 200
        s.prefill.knobs.fail_body = json.dumps(
            {"choices": [{"text": "x"}], "kv_transfer_params": kv}
        ).encode()
        s.decode.role = "plain"  # the stand-in answer's KV is not the fake's own
        status, _, raw = await s.post("/v1/completions", body)
        assert status == 200, raw
        assert s.decode.seen[-1].body == {**body, "kv_transfer_params": kv}
        assert count(s, "text", "not_answered") == 1 and count(s, "forwarded") == 1
