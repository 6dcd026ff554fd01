"""pd_proxy.modes.first_token_rewrite's pure rules: which requests and answers allow the
continuation,
the KV block arithmetic, the bodies of the legs, and the stream rewriting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_proxy.modes import first_token_rewrite as ft
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.protocol.pd_bodies import release_body
from pd_proxy.routing.block_size import parse_block_size

KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[7, 8]],
    "remote_engine_id": "e",
    "remote_request_id": "r",
    "remote_host": "h",
    "remote_port": 1,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 20,
}


def first(n_prompt: int = 20, text: str = " x", kv: Any = None, **fields: Any) -> ft.FirstToken:
    obj = {
        "id": "cmpl-r",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": text, "token_ids": [9], "finish_reason": "length"}],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": 1, "total_tokens": n_prompt + 1},
        "kv_transfer_params": KV if kv is None else kv,
        **fields,
    }
    obj["choices"][0]["prompt_token_ids"] = list(range(n_prompt))
    parsed = ft.parse_first_token(COMPLETIONS, obj)
    assert isinstance(parsed, ft.FirstToken)
    return parsed


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"logprobs": 0}, "logprobs"),  # 0 is an int here, not False
        ({"logprobs": False}, None),
        ({"echo": 0}, "echo"),
        ({"n": 1.0}, None),
        ({"n": True}, "n"),
        ({"frequency_penalty": 0.0}, None),
        ({"thinking_token_budget": -1}, None),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"stop": []}, None),
        ({"stop": ["a", "b", ""]}, None),
        ({"stop": ["é"]}, None),
        ({"stop": ["ab"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": 1, "temperature": 0}, None),
        ({"seed": 1, "temperature": 0.5}, "seed"),
        ({"max_tokens": None}, None),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": 16}, None),  # the default limit is 16
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt_embeds": "abc"}, "prompt_embeds"),
        ({"guided_json": {}}, "guided_json"),
        ({"watermarking": True}, "watermarking"),
        ({"repetition_detection": {"min_count": 3}}, "repetition_detection"),
    ],
)
def test_completion_request_rules(fields: dict[str, Any], reason: str | None) -> None:
    body = {"prompt": "hello", **fields}
    assert ft.request_fallback(COMPLETIONS, body) == reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, None),
        ({"max_tokens": 3, "max_completion_tokens": None}, None),
        ({"max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": []}, None),
        ({"messages": "hi"}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ],
)
def test_chat_request_rules(fields: dict[str, Any], reason: str | None) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    assert ft.request_fallback(CHAT_COMPLETIONS, body) == reason


@pytest.mark.parametrize(
    ("n_prompt", "blocks", "block_size", "problem"),
    [
        (20, [[7, 8]], 16, None),  # 21 slots needed, 32 there
        (31, [[7, 8]], 16, None),  # 32 needed, 32 there
        (32, [[7, 8]], 16, "kv_blocks"),  # position 32 needs a third block
        (16, [[7]], 16, "kv_blocks"),
        (15, [7], 16, None),  # one group, written flat
        (15, [[7], [9]], 16, None),
        (15, [[7], []], 16, "kv_blocks"),
        (15, [], 16, "kv_blocks"),
        (15, [[7]], None, "block_size"),
    ],
)
def test_the_prefill_blocks_must_have_a_slot_for_token_1(n_prompt, blocks, block_size, problem):
    kv = {**KV, "remote_block_ids": blocks, "remote_num_tokens": n_prompt}
    assert ft.continuation_problem(first(n_prompt, kv=kv), block_size) == problem


def test_other_reasons_decode_cannot_continue() -> None:
    assert ft.continuation_problem(first(text=""), 16) == "first_token_text"
    assert ft.continuation_problem(first(kv={**KV, "remote_num_tokens": 19}), 16) == "kv_tokens"
    assert ft.continuation_problem(first(kv={**KV, "remote_num_tokens": 21}), 16) is None
    assert ft.continuation_problem(first(kv={**KV, "dcp_size": 2}), 16) == "kv_layout"
    no_pull = first(kv={**KV, "do_remote_prefill": False})
    assert not ft.needs_block_size(no_pull)
    assert ft.continuation_problem(no_pull, None) is None


def test_completion_legs() -> None:
    body = {"prompt": "hi", "min_tokens": 3, "truncate_prompt_tokens": 5, "stream": True}
    prefill = ft.prefill_body_first_token(body)
    assert (prefill["max_tokens"], prefill["min_tokens"], prefill["stream"]) == (1, 1, False)
    assert prefill["return_token_ids"] is True
    assert "min_tokens" not in ft.prefill_body_first_token({"prompt": "hi", "min_tokens": 0})
    decode = ft.continuation_body(COMPLETIONS, body, first(3))
    assert decode["prompt"] == [0, 1, 2, 9]
    assert (decode["max_tokens"], decode["min_tokens"], decode["stream"]) == (15, 2, True)
    assert decode["kv_transfer_params"] == KV
    assert "truncate_prompt_tokens" not in decode
    release = release_body(body, KV)
    assert (release["max_tokens"], release["stream"], release["kv_transfer_params"]) == (
        1,
        False,
        KV,
    )


def test_chat_continuation_sets_the_limit_vllm_reads() -> None:
    chat = {"messages": [], "max_completion_tokens": 6, "max_tokens": 2}
    decode = ft.continuation_body(CHAT_COMPLETIONS, chat, first(2))
    assert decode["max_completion_tokens"] == 5 and "max_tokens" not in decode
    assert decode["kv_transfer_params"] == {**KV, "prompt_token_ids": [0, 1, 9]}
    decode = ft.continuation_body(CHAT_COMPLETIONS, {"messages": []}, first(2, kv=False))
    assert "max_tokens" not in decode and "max_completion_tokens" not in decode
    # Null KV params: decode computes the prompt, still from the forwarded ids.
    nokv = first(2)
    nokv.obj["kv_transfer_params"] = None
    assert ft.continuation_body(CHAT_COMPLETIONS, {"messages": []}, nokv)["kv_transfer_params"] == {
        "prompt_token_ids": [0, 1, 9]
    }


def test_parse_first_token_of_a_chat_answer() -> None:
    obj = {
        "id": "chatcmpl-r",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "reasoning": None,
                    "tool_calls": [],
                },
                "token_ids": [5],
                "finish_reason": "stop",
                "stop_reason": 7,
            }
        ],
        "usage": {"prompt_tokens": 2},
    }
    got = ft.parse_first_token(CHAT_COMPLETIONS, obj)
    assert isinstance(got, ft.FirstToken)
    assert (got.text, got.token_id, got.prompt_ids, got.stop_reason) == ("Hi", 5, [1, 2], 7)
    assert ft.finished_at_first(CHAT_COMPLETIONS, {"max_tokens": 9}, got)
    obj["choices"][0]["message"]["tool_calls"] = [{"id": "x"}]
    assert ft.parse_first_token(CHAT_COMPLETIONS, obj) == "parsed_output"
    assert ft.parse_first_token(CHAT_COMPLETIONS, {"choices": [{}, {}]}) == "prefill_answer"
    assert ft.parse_first_token(CHAT_COMPLETIONS, []) == "prefill_answer"


def events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def test_continuation_filter_across_any_chunking() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"\\"usage\\": no"}}]}\n\n'
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":21,"total_tokens":24,'
        b'"completion_tokens":3}}\n\n'
    )
    stream = role + token + usage + b"data: [DONE]\n\n"
    for size in (1, 7, len(stream)):
        f = ft.ContinuationFilter(CHAT_COMPLETIONS, first(20))
        out = b"".join(f.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert f.flush() == b""
        assert out.startswith(token)  # the role chunk is gone, the token's bytes untouched
        assert out.endswith(b"data: [DONE]\n\n")
        assert events(out)[-1]["usage"] == {
            "prompt_tokens": 20,
            "total_tokens": 24,
            "completion_tokens": 4,
        }
    # Completions have no role chunk; a first event that is not one stays.
    f = ft.ContinuationFilter(COMPLETIONS, first(20))
    assert f.feed(token + b"data: {partial") == token
    assert f.flush() == b"data: {partial"


def test_rendered_chunks_and_answers() -> None:
    token1 = first(4)
    body = {"stream": True, "stream_options": {"include_usage": True}}
    head = events(ft.stream_head(COMPLETIONS, body, token1))
    assert head == [
        {
            "id": "cmpl-r",
            "object": "text_completion",
            "created": 5,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": " x",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                    "prompt_token_ids": None,
                    "token_ids": None,
                }
            ],
        }
    ]
    done = ft.finished_stream(COMPLETIONS, body, token1)
    assert done.endswith(b"data: [DONE]\n\n")
    assert events(done)[-1]["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 5,
        "completion_tokens": 1,
    }
    answer = json.loads(ft.finished_json(COMPLETIONS, token1))
    assert answer["kv_transfer_params"] is None
    assert answer["choices"][0]["prompt_token_ids"] is None
    decode = {
        "choices": [{"index": 0, "text": " y z"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    }
    merged = json.loads(ft.merge_json(COMPLETIONS, token1, json.dumps(decode).encode()))
    assert merged["choices"][0]["text"] == " x y z"
    assert merged["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    with pytest.raises(ValueError):
        ft.merge_json(COMPLETIONS, token1, b'{"choices": []}')


def test_block_size_from_vllm_metrics() -> None:
    text = (
        b"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        b"# TYPE vllm:cache_config_info gauge\n"
        b'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
        b'kv_block_size="99",num_gpu_blocks="None"} 1.0\n'
        b'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1"} 1.0\n'
    )
    assert parse_block_size(text) == 16
    assert parse_block_size(b'vllm:cache_config_info{kv_block_size="16"} 1.0\n') is None
    assert parse_block_size(text.replace(b'"16",cache_dtype="auto",engine="1"', b'"32"')) is None
    assert parse_block_size(b"") is None
