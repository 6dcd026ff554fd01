"""Fan-out: one P/D request per choice, answers merged as vLLM numbers and counts them."""

from __future__ import annotations

import json

import pytest

from pd_proxy.modes.fanout_rewrite import StreamMerge, merge_json, split
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS


def test_split_prompts_times_samples_in_vllm_choice_order() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 10, "max_tokens": 4}
    legs = split(body, COMPLETIONS)
    assert [(leg["prompt"], leg["seed"]) for leg in legs] == [
        ("a", 10),
        ("a", 11),
        ("a", 12),
        ("b", 10),
        ("b", 11),
        ("b", 12),
    ]
    assert all("n" not in leg and leg["max_tokens"] == 4 for leg in legs)
    assert body["prompt"] == ["a", "b"] and body["n"] == 3  # the client's body is untouched


def test_split_chat_samples_without_seed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}
    legs = split(body, CHAT_COMPLETIONS)
    assert legs == [{"model": "m", "messages": body["messages"]}] * 2
    assert "prompt" not in legs[0]


def test_split_token_id_lists() -> None:
    legs = split({"prompt": [[1, 2], [3]]}, COMPLETIONS)
    assert [leg["prompt"] for leg in legs] == [[1, 2], [3]]


def _answer(text: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    return json.dumps(
        {
            "id": f"cmpl-{text}",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "kv_transfer_params": None,
        }
    ).encode()


def test_merge_json_reindexes_and_counts_each_prompt_once() -> None:
    # two prompts (5 and 7 tokens) x n=2
    answers = [_answer("a0", 5, 3), _answer("a1", 5, 2), _answer("b0", 7, 4), _answer("b1", 7, 1)]
    merged = json.loads(merge_json(COMPLETIONS, 2, answers))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"),
        (1, "a1"),
        (2, "b0"),
        (3, "b1"),
    ]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}
    assert merged["id"] == "cmpl-a0"


def test_merge_json_keeps_vllms_other_usage_fields() -> None:
    answers = []
    for text in ("a", "b"):
        obj = json.loads(_answer(text, 4, 2))
        obj["usage"]["prompt_tokens_details"] = None
        answers.append(json.dumps(obj).encode())
    merged = json.loads(merge_json(COMPLETIONS, 2, answers))
    assert merged["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": None,
    }


def test_merge_json_chat_counts_the_one_prompt_once() -> None:
    answers = [_answer("x", 9, 3), _answer("y", 9, 5), _answer("z", 9, 1)]
    merged = json.loads(merge_json(CHAT_COMPLETIONS, 3, answers))
    assert merged["usage"] == {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}


def test_merge_json_refuses_what_is_not_one_choice() -> None:
    two = json.loads(_answer("a", 1, 1))
    two["choices"].append(two["choices"][0])
    with pytest.raises(ValueError):
        merge_json(COMPLETIONS, 1, [json.dumps(two).encode()])
    with pytest.raises(ValueError):
        merge_json(COMPLETIONS, 1, [b'{"error": "x"}'])


def _chunk(rid: str, text: str | None, usage: dict | None = None) -> bytes:
    obj: dict = {"id": rid, "object": "text_completion", "created": 1, "model": "m"}
    obj["choices"] = [] if text is None else [{"index": 0, "text": text}]
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _events(data: bytes) -> list:
    out = []
    for event in data.split(b"\n\n"):
        if event:
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_stream_merge_interleaves_reindexes_and_ends_once() -> None:
    merge = StreamMerge(COMPLETIONS, 1, 2)
    usage0 = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    usage1 = {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7}
    leg0 = _chunk("cmpl-A", " a") + _chunk("cmpl-A", " b") + _chunk("cmpl-A", None, usage0)
    leg1 = _chunk("cmpl-B", " c") + _chunk("cmpl-B", None, usage1)
    out = b""
    # leg 1's first event split across two reads, legs interleaved, each leg's [DONE] swallowed
    out += merge.feed(1, leg1[:10])
    out += merge.feed(0, leg0 + b"data: [DONE]\n\n")
    out += merge.feed(1, leg1[10:] + b"data: [DONE]\n\n")
    out += merge.finish(include_usage=True)
    events = _events(out)
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:3]] == [
        (0, " a"),
        (0, " b"),
        (1, " c"),
    ]
    assert {e["id"] for e in events[:-1]} == {"cmpl-A"}
    assert events[3]["choices"] == []
    assert events[3]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert events[4] == "[DONE]"
    assert len(events) == 5


def test_stream_merge_without_usage_ends_with_done_only() -> None:
    merge = StreamMerge(CHAT_COMPLETIONS, 2, 2)
    out = merge.feed(0, _chunk("c", "x")) + merge.feed(1, _chunk("d", "y"))
    out += merge.finish(include_usage=False)
    events = _events(out)
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    assert events[2:] == ["[DONE]"]


def test_stream_merge_passes_an_error_event() -> None:
    merge = StreamMerge(COMPLETIONS, 1, 1)
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    assert merge.feed(0, error) == error
