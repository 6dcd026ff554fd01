"""``--first-token-from-prefill`` end to end, against the fake vLLM.

The fake's model is deterministic in the token context (pd_proxy.testing.fake_vllm), so every
request is also sent through a proxy in the normal mode and the two answers must be equal: text,
finish and stop reasons, usage. The legs are checked as vLLM 0.32 would receive them.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from pd_proxy.config import ConfigError, load_config
from pd_proxy.modes.first_token import FirstTokenMode
from pd_proxy.testing.fake_model import GEN_BASE, render_chat, tokenize
from tests.proxy.proxy_harness import EXPECTED_PREFILL_KV, Stack, pd_stack, sse_events

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FIRST = {"first_token_from_prefill": True}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = (
        {"model": "fake-model", "messages": MESSAGES}
        if path == CHAT
        else {"model": "fake-model", "prompt": "The capital of France is"}
    )
    return {**base, **fields}


def prompt_ids(path: str, body: dict[str, Any]) -> list[int]:
    return tokenize(render_chat(body)) if path == CHAT else tokenize(body["prompt"])


def outcome(s: Stack, outcome: str, reason: str = "") -> float:
    labels = {"outcome": outcome, "reason": reason}
    return s.sample("pd_proxy_first_token_requests_total", labels) or 0.0


def summary(path: str, stream: bool, raw: bytes) -> dict[str, Any]:
    """What the client can tell apart: text, finish, stop reason, usage, chunk shapes."""
    if not stream:
        obj = json.loads(raw)
        choice = obj["choices"][0]
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        return {
            "text": text,
            "finish": choice["finish_reason"],
            "stop_reason": choice.get("stop_reason"),
            "usage": obj["usage"],
            "kv": obj.get("kv_transfer_params"),
        }
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    out: dict[str, Any] = {"text": "", "finish": None, "stop_reason": None, "usage": None}
    roles = 0
    continuous = []
    for chunk in chunks:
        if chunk.get("usage") is not None:
            continuous.append(chunk["usage"])
        if not chunk["choices"]:
            out["usage"] = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        if path == CHAT:
            delta = choice["delta"]
            roles += "role" in delta
            out["text"] += delta.get("content") or ""
        else:
            out["text"] += choice["text"]
        if choice.get("finish_reason") is not None:
            out["finish"] = choice["finish_reason"]
            out["stop_reason"] = choice.get("stop_reason")
    out["roles"] = roles
    out["continuous"] = continuous
    return out


async def both_modes(path: str, body: dict[str, Any], **knobs: Any) -> tuple[dict, dict, Stack]:
    """The same request through a normal proxy and a first-token one; their summaries."""
    async with AsyncExitStack() as stack:
        normal = await stack.enter_async_context(pd_stack())
        first = await stack.enter_async_context(pd_stack(**FIRST))
        results = []
        for s in (normal, first):
            for fake in s.prefills + s.decodes:
                for name, value in knobs.items():
                    setattr(fake.knobs, name, value)
            status, _, raw = await s.post(path, body)
            assert status == 200, raw
            results.append(summary(path, bool(body.get("stream")), raw))
        await first.decode.wait_for(lambda: first.decode.completed == 1)
        assert first.decode.crashes == 0
        return results[0], results[1], first


# ---------------------------------------------------------------- token 1 now, decode continues
async def test_completion_stream_sends_token_1_before_decode_answers():
    body = body_for(COMPLETIONS, max_tokens=6, stream=True, temperature=0)
    async with pd_stack(**FIRST) as s:
        # Decode holds its answer back, long enough that a stalled (loaded) host still gets
        # token 1 out before it: the bound below stays under it.
        s.decode.knobs.delay = 2.0
        async with s.session.post(s.url + COMPLETIONS, json=body) as resp:
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 1.5)
            assert s.decode.completed == 0  # token 1 came from the prefill
            rest = await resp.read()
        events = sse_events(first + rest)
        assert json.loads(events[0])["choices"][0]["text"] == " t0"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[1:-1]]
        assert texts == [f" t{k}" for k in range(1, 6)]
        rid = resp.headers["X-Request-Id"]
        [p], [d] = s.prefill.seen, s.decode.seen
        assert p.body == {
            **body,
            "max_tokens": 1,
            "stream": False,
            "return_token_ids": True,
            "kv_transfer_params": EXPECTED_PREFILL_KV,
        }
        # Decode continues from the prompt's token ids plus token 1, one token fewer.
        assert d.body == {
            **body,
            "prompt": [*prompt_ids(COMPLETIONS, body), GEN_BASE],
            "max_tokens": 5,
            "kv_transfer_params": s.prefill.issued[rid],
        }
        assert d.headers["X-Request-Id"] == rid == p.headers["X-Request-Id"]
        assert outcome(s, "continued") == 1
        assert s.sample("pd_proxy_time_to_first_byte_seconds_count", {"path": "pd"}) == 1
        assert s.sample("pd_proxy_decode_ttfb_seconds_count") == 1


async def test_chat_stream_keeps_one_role_chunk_and_reuses_the_prompt_ids():
    body = body_for(CHAT, max_completion_tokens=4, stream=True)
    async with pd_stack(**FIRST) as s:
        status, headers, raw = await s.post(CHAT, body)
        assert status == 200
        assert headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(e) for e in sse_events(raw)[:-1]]
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[0]["object"] == "chat.completion.chunk"
        deltas = [e["choices"][0]["delta"] for e in events[1:]]
        assert deltas == [{"content": f" t{k}"} for k in range(4)]  # decode's role chunk dropped
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        rid = headers["X-Request-Id"]
        assert {e["id"] for e in events} == {f"chatcmpl-{rid}"}
        [d] = s.decode.seen
        assert d.path == CHAT
        assert d.body == {
            **body,
            "max_completion_tokens": 3,
            "kv_transfer_params": {
                **s.prefill.issued[rid],
                "prompt_token_ids": [*prompt_ids(CHAT, body), GEN_BASE],
            },
        }


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fields", "knobs"),
    [
        ({"max_tokens": 2}, {}),
        ({"max_tokens": 16, "temperature": 0}, {}),
        ({}, {}),  # completions: vLLM's default 16; chat: the context (max_model_len below)
        ({"max_tokens": 9, "min_tokens": 2}, {"eos_at": 3}),  # EOS at token 4
        ({"max_tokens": 9, "min_tokens": 1}, {"eos_at": 0}),  # EOS at token 1 banned
        ({"max_tokens": 9, "stop": ["4"]}, {}),  # a one-character stop string, on decode
        ({"max_tokens": 9, "stop": "3", "include_stop_str_in_output": True}, {}),
        ({"max_tokens": 9, "stop_token_ids": [GEN_BASE + 5]}, {}),
        ({"max_tokens": 9, "ignore_eos": True}, {"eos_at": 2}),
        ({"max_tokens": 5, "seed": 7, "temperature": 0}, {}),
        ({"max_tokens": 4, "stream_options": {"include_usage": True}}, {}),
        (
            {
                "max_tokens": 4,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            {},
        ),
    ],
)
async def test_first_token_mode_answers_what_the_normal_flow_answers(path, stream, fields, knobs):
    if "stream_options" in fields and not stream:
        pytest.skip("stream_options need a stream")
    body = body_for(path, stream=stream, **fields)
    normal, first, s = await both_modes(path, body, max_model_len=40, **knobs)
    assert first == normal
    assert outcome(s, "continued") == 1
    if stream and "include_usage" in str(fields):
        assert first["usage"]["prompt_tokens"] == len(prompt_ids(path, body))
    if "continuous_usage_stats" in str(fields):
        counts = [u["completion_tokens"] for u in first["continuous"]]
        assert counts == sorted(counts) and counts[-1] == 4


async def test_json_answers_merge_token_1_and_count_usage():
    async with pd_stack(**FIRST) as s:
        for path in (COMPLETIONS, CHAT):
            body = body_for(path, max_tokens=5)
            status, headers, raw = await s.post(path, body)
            assert status == 200, raw
            assert headers["Content-Type"].startswith("application/json")
            obj = json.loads(raw)
            choice = obj["choices"][0]
            text = choice["message"]["content"] if path == CHAT else choice["text"]
            assert text == " t0 t1 t2 t3 t4"
            n = len(prompt_ids(path, body))
            assert obj["usage"] == {
                "prompt_tokens": n,
                "total_tokens": n + 5,
                "completion_tokens": 5,
            }
            assert obj["kv_transfer_params"] is None
        assert outcome(s, "continued") == 2


# ---------------------------------------------------------------- token 1 ends the request
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fields", "knobs", "finish", "stop_reason", "text"),
    [
        ({"max_tokens": 1}, {}, "length", None, " t0"),
        ({"max_completion_tokens": 1, "max_tokens": 8}, {}, "length", None, " t0"),
        ({"max_tokens": 8}, {"eos_at": 0}, "stop", None, ""),
        ({"max_tokens": 8, "stop": ["0"]}, {}, "stop", "0", " t"),
        ({"max_tokens": 8, "stop_token_ids": [GEN_BASE]}, {}, "stop", GEN_BASE, ""),
    ],
)
async def test_token_1_that_ends_the_request_is_the_whole_answer(
    path, stream, fields, knobs, finish, stop_reason, text
):
    if path == COMPLETIONS and "max_completion_tokens" in fields:
        fields = {"max_tokens": 1}
    body = body_for(path, stream=stream, **fields)
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with AsyncExitStack() as stack:
        normal = await stack.enter_async_context(pd_stack())
        s = await stack.enter_async_context(pd_stack(**FIRST))
        answers = []
        for stack_ in (normal, s):
            for fake in stack_.prefills + stack_.decodes:
                for name, value in knobs.items():
                    setattr(fake.knobs, name, value)
            status, headers, raw = await stack_.post(path, body)
            assert status == 200, raw
            answers.append(summary(path, stream, raw))
        assert answers[1] == answers[0]
        got = answers[1]
        assert (got["finish"], got["stop_reason"], got["text"]) == (finish, stop_reason, text)
        assert got["usage"]["completion_tokens"] == 1
        if not stream:
            obj = json.loads(raw)
            assert obj["kv_transfer_params"] is None
            assert obj["choices"][0]["token_ids"] is None
        assert outcome(s, "finished") == 1
        # The decode still takes the KV (in the background), so the prefill frees it now.
        await s.decode.wait_for(lambda: s.decode.completed == 1)
        [release] = s.decode.seen
        rid = headers["X-Request-Id"]
        assert release.headers["X-Request-Id"] == rid
        assert release.body["kv_transfer_params"] == s.prefill.issued[rid]
        assert (release.body["max_tokens"], release.body["stream"]) == (1, False)
        assert "stream_options" not in release.body


# ---------------------------------------------------------------- the normal flow, by request
# (n, prompt lists, use_beam_search and prompt_logprobs never get here: their shape routes them
# first, see test_shape_routes_come_before_the_mode)
@pytest.mark.parametrize(
    ("path", "fields", "reason"),
    [
        (COMPLETIONS, {"echo": True}, "echo"),
        (COMPLETIONS, {"logprobs": 0}, "logprobs"),
        (COMPLETIONS, {"return_token_ids": True}, "return_token_ids"),
        (COMPLETIONS, {"suffix": "x"}, "suffix"),
        (COMPLETIONS, {"stop": ["\n\n"]}, "stop"),
        (COMPLETIONS, {"stop": "ab"}, "stop"),
        (COMPLETIONS, {"seed": 1, "temperature": 0.7}, "seed"),
        (COMPLETIONS, {"seed": 1}, "seed"),
        (COMPLETIONS, {"frequency_penalty": 0.5}, "frequency_penalty"),
        (COMPLETIONS, {"presence_penalty": -1}, "presence_penalty"),
        (COMPLETIONS, {"bad_words": ["a b"]}, "bad_words"),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
        (COMPLETIONS, {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        (COMPLETIONS, {"vllm_xargs": {"k": 1}}, "vllm_xargs"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": 4, "min_tokens": 6}, "min_tokens"),
        (CHAT, {"logprobs": True}, "logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"echo": True}, "echo"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"return_prompt_text": True}, "return_prompt_text"),
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this"},
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                        ],
                    }
                ]
            },
            "messages",
        ),
        (CHAT, {"max_completion_tokens": 0, "max_tokens": 3}, "max_completion_tokens"),
    ],
)
async def test_requests_the_continuation_cannot_reproduce_take_the_normal_flow(
    path, fields, reason
):
    body = body_for(path, **{"max_tokens": 3, **fields})
    async with pd_stack(**FIRST) as s:
        for fake in s.decodes:
            fake.role = "plain"  # some bodies are ones a real decode would refuse; not the point
        status, headers, raw = await s.post(path, body)
        assert status == 200, raw
        [p], [d] = s.prefill.seen, s.decode.seen
        assert "return_token_ids" not in p.body or fields.get("return_token_ids")
        assert d.body == {**body, "kv_transfer_params": s.prefill.issued[headers["X-Request-Id"]]}
        assert outcome(s, "normal", reason) == 1
        assert outcome(s, "continued") == 0


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (COMPLETIONS, {"seed": 3, "temperature": 0.0}),
        (COMPLETIONS, {"frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1.2}),
        (COMPLETIONS, {"logit_bias": {"5": 1.0}, "top_k": 1, "bad_words": []}),
        (COMPLETIONS, {"prompt": ["one prompt"], "stop": ["x", "y"]}),
        (COMPLETIONS, {"prompt": [5, 6, 7]}),
        (COMPLETIONS, {"prompt": [[5, 6, 7]]}),
        (CHAT, {"logprobs": False, "top_logprobs": 0, "tools": []}),
        (CHAT, {"response_format": {"type": "text"}, "n": 1}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ],
)
async def test_parameters_that_do_not_change_token_2_keep_the_mode(path, fields):
    body = body_for(path, **{"max_tokens": 3, **fields})
    async with pd_stack(**FIRST) as s:
        status, _, raw = await s.post(path, body)
        assert status == 200, raw
        assert outcome(s, "continued") == 1, s.metrics.render().decode()


# ---------------------------------------------------------------- the normal flow, by answer
async def test_prompt_that_fills_its_last_block_takes_the_normal_flow():
    """Decode would need one block more than the prefill sent: vLLM's engine dies on that."""
    async with pd_stack(**FIRST) as s:
        body = body_for(COMPLETIONS, prompt="a b c d e f g", max_tokens=3)  # 8 tokens with BOS
        for fake in s.prefills + s.decodes:
            fake.knobs.block_size = 8
        status, _, raw = await s.post(COMPLETIONS, body)
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["text"] == " t0 t1 t2"
        assert outcome(s, "normal", "kv_blocks") == 1
        assert s.decode.crashes == 0
        assert s.decode.seen[0].body["prompt"] == body["prompt"]  # the normal decode leg
        # One token shorter fits: 7 + token 1 = 8 slots in the one block.
        body["prompt"] = "a b c d e f"
        status, _, raw = await s.post(COMPLETIONS, body)
        assert status == 200, raw
        assert outcome(s, "continued") == 1
        assert s.decode.crashes == 0


async def test_the_fake_decode_dies_where_vllm_would():
    """The guard above is needed: a continuation past the prefill's blocks kills the engine."""
    async with pd_stack() as s:
        s.prefill.knobs.block_size = s.decode.knobs.block_size = 8
        prompt = tokenize("a b c d e f g")
        async with aiohttp.ClientSession() as session:
            headers = {"X-Request-Id": "r1"}
            prefill = {**body_for(COMPLETIONS, prompt=prompt), "max_tokens": 1}
            prefill["kv_transfer_params"] = EXPECTED_PREFILL_KV
            async with session.post(
                s.prefill.url + COMPLETIONS, json=prefill, headers=headers
            ) as r:
                kv = (await r.json())["kv_transfer_params"]
            assert kv["remote_block_ids"] == [[kv["remote_block_ids"][0][0]]]
            cont = {"prompt": [*prompt, GEN_BASE], "max_tokens": 2, "kv_transfer_params": kv}
            async with session.post(s.decode.url + COMPLETIONS, json=cont, headers=headers) as r:
                assert r.status == 500
        assert s.decode.crashes == 1


async def test_block_size_is_read_once_per_prefill_and_its_absence_means_the_normal_flow():
    async with pd_stack(prefills=2, **FIRST) as s:
        body = body_for(COMPLETIONS, max_tokens=3)
        for _ in range(4):
            status, _, _ = await s.post(COMPLETIONS, body)
            assert status == 200
        assert outcome(s, "continued") == 4
        assert [p.metrics_reads for p in s.prefills] == [1, 1]  # both fetched at the first one
    async with pd_stack(**FIRST) as s:
        s.prefill.knobs.metrics = False
        status, _, raw = await s.post(COMPLETIONS, body)
        assert status == 200
        assert json.loads(raw)["choices"][0]["text"] == " t0 t1 t2"
        assert outcome(s, "normal", "block_size") == 1


def prefill_answer(**choice: Any) -> bytes:
    """A prefill's answer with null KV params (decode then computes the prompt itself)."""
    base = {"index": 0, "text": " t0", "finish_reason": "length", "stop_reason": None}
    base.update(token_ids=[GEN_BASE], prompt_token_ids=[1, 2, 3])
    base.update(choice)
    return json.dumps(
        {
            "id": "cmpl-x",
            "choices": [base],
            "usage": {"prompt_tokens": 3},
            "kv_transfer_params": None,
        }
    ).encode()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (prefill_answer(text=""), "first_token_text"),  # half a UTF-8 character, or special
        (prefill_answer(token_ids=None), "prefill_answer"),  # a vLLM without return_token_ids
        (prefill_answer(prompt_token_ids=None), "prefill_answer"),
        (prefill_answer(finish_reason="abort"), "prefill_answer"),
    ],
)
async def test_prefill_answers_that_cannot_give_token_1_take_the_normal_flow(answer, reason):
    async with pd_stack(**FIRST) as s:
        s.prefill.knobs.fail_status = 200
        s.prefill.knobs.fail_body = answer
        s.decode.role = "plain"
        status, _, raw = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3))
        assert status == 200, raw
        assert s.decode.seen[0].body["prompt"] == "The capital of France is"
        assert outcome(s, "normal", reason) == 1


async def test_chat_output_a_parser_took_takes_the_normal_flow():
    answer = {
        "id": "chatcmpl-x",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "reasoning": "Hmm"},
                "token_ids": [GEN_BASE],
                "finish_reason": "length",
            }
        ],
        "kv_transfer_params": None,
    }
    async with pd_stack(**FIRST) as s:
        s.prefill.knobs.fail_status = 200
        s.prefill.knobs.fail_body = json.dumps(answer).encode()
        s.decode.role = "plain"
        status, _, raw = await s.post(CHAT, body_for(CHAT, max_tokens=3))
        assert status == 200, raw
        assert outcome(s, "normal", "parsed_output") == 1


async def test_prefill_that_computed_less_than_the_prompt_takes_the_normal_flow():
    """A prefill that leaves the last tokens to decode (Mamba, MTP) sampled no real token 1."""
    async with pd_stack(**FIRST) as s:
        real = s.prefill._prefill_params

        def short(rid: str, prompt_len: int) -> dict[str, Any]:
            params = real(rid, prompt_len)
            params["remote_num_tokens"] = prompt_len - 1
            return params

        s.prefill._prefill_params = short  # type: ignore[method-assign]
        status, _, raw = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3))
        assert status == 200, raw
        assert outcome(s, "normal", "kv_tokens") == 1


# ---------------------------------------------------------------- failures after token 1
@pytest.mark.parametrize(
    ("knobs", "status", "needle"),
    [
        ({"fail_status": 500}, 502, "returned 500"),
        ({"fail_status": 400}, 400, "refused the continuation (400): injected failure 400"),
        ({"die_after": 2}, 502, "broke the stream"),
    ],
)
async def test_decode_failing_after_token_1_ends_the_stream_with_an_error_event(
    knobs, status, needle
):
    async with pd_stack(**FIRST) as s:
        for name, value in knobs.items():
            setattr(s.decode.knobs, name, value)
        code, _, raw = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=6, stream=True))
        assert code == 200
        events = sse_events(raw)
        assert json.loads(events[0])["choices"][0]["text"] == " t0"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == status and needle in error["message"], error
        assert s.sample(
            "pd_proxy_backend_errors_total", {"stage": "decode", "backend": s.decode.url}
        ) == (None if status == 400 else 1)


async def test_decode_failing_a_json_continuation_is_an_error_as_in_the_normal_flow():
    async with pd_stack(**FIRST) as s:
        s.decode.knobs.fail_status = 503
        status, _, raw = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=4))
        assert status == 502 and b"returned 503" in raw


async def test_no_healthy_decode_is_refused_before_the_prefill_leg():
    """Admission (on by default) sees no decode to take the KV: a 503 with Retry-After, and the
    prefill never hears of the request."""
    async with pd_stack(**FIRST) as s:
        s.decode.knobs.healthy = False
        s.proxy.decode_pool.backends[0].healthy = False
        code, headers, raw = await s.post(CHAT, body_for(CHAT, max_tokens=4, stream=True))
        assert code == 503 and int(headers["Retry-After"]) >= 1, raw
        assert json.loads(raw)["error"]["code"] == "no_backend"
        assert s.prefill.seen == []


async def test_no_decode_after_token_1_is_an_error_event():
    """Without admission the prefill leg runs, and the missing decode shows after token 1."""
    async with pd_stack(**FIRST, admission=False) as s:
        s.decode.knobs.healthy = False
        s.proxy.decode_pool.backends[0].healthy = False
        code, _, raw = await s.post(CHAT, body_for(CHAT, max_tokens=4, stream=True))
        assert code == 200
        events = sse_events(raw)
        assert json.loads(events[1])["choices"][0]["delta"] == {"content": " t0"}
        assert json.loads(events[-2])["error"]["code"] == 503


# ---------------------------------------------------------------- settings
def test_flag_and_environment():
    base = {"PD_PROXY_PREFILL": "http://127.0.0.1:1", "PD_PROXY_DECODE": "http://127.0.0.1:2"}
    assert load_config([], base).first_token_from_prefill is False
    assert load_config(["--first-token-from-prefill"], base).first_token_from_prefill is True
    env = {**base, "PD_PROXY_FIRST_TOKEN_FROM_PREFILL": "true"}
    assert load_config([], env).first_token_from_prefill is True
    with pytest.raises(ConfigError, match="PD_PROXY_FIRST_TOKEN_FROM_PREFILL"):
        load_config([], {**base, "PD_PROXY_FIRST_TOKEN_FROM_PREFILL": "maybe"})


async def test_off_by_default_the_legs_are_the_normal_ones():
    async with pd_stack() as s:
        status, _, _ = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=2))
        assert status == 200
        assert "return_token_ids" not in s.prefill.seen[0].body
        assert not isinstance(s.running.pipeline.pd, FirstTokenMode)
        text = s.metrics.render().decode()
        assert "# TYPE pd_proxy_first_token_requests_total counter" in text
        assert "pd_proxy_first_token_requests_total{" not in text


async def test_prefill_answer_that_is_not_json_is_a_502_as_in_the_normal_flow():
    async with pd_stack(**FIRST) as s:
        s.prefill.knobs.fail_status = 200
        s.prefill.knobs.fail_body = b"[1, 2]"
        status, _, raw = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3))
        assert status == 502 and b"invalid JSON" in raw
        assert s.decode.seen == []


async def test_client_leaving_after_token_1_cancels_the_continuation():
    async with pd_stack(**FIRST) as s:
        s.decode.knobs.token_delay = 0.05
        body = body_for(COMPLETIONS, max_tokens=200, stream=True)
        headers = {"X-Request-Id": "leaver"}
        async with aiohttp.ClientSession() as session:
            async with session.post(s.url + COMPLETIONS, json=body, headers=headers) as resp:
                assert b" t0" in await resp.content.readuntil(b"\n\n")
                await s.decode.wait_for(lambda: len(s.decode.seen) == 1)
                await resp.content.readuntil(b"\n\n")  # decode's stream is flowing
        await s.decode.wait_for(lambda: "leaver" in s.decode.cancelled)
        await s.decode.wait_for(lambda: s.sample("pd_proxy_in_flight_requests") == 0)
        labels = {"endpoint": COMPLETIONS, "status": "499", "path": "pd"}
        assert s.sample("pd_proxy_requests_total", labels) == 1


async def test_backend_key_on_every_leg_of_the_mode(tmp_path):
    keys = tmp_path / "backend_keys"
    keys.write_text("sk-backend\n")
    async with pd_stack(backend_key="sk-backend", backend_api_key_file=str(keys), **FIRST) as s:
        for path in (COMPLETIONS, CHAT):
            status, _, raw = await s.post(path, body_for(path, max_tokens=3, stream=True))
            assert status == 200, raw
        status, _, _ = await s.post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1))
        assert status == 200
        await s.decode.wait_for(lambda: s.decode.completed == 3)  # two continuations, a release
        assert outcome(s, "continued") == 2 and outcome(s, "finished") == 1
        for fake in (s.prefill, s.decode):
            assert all(h["Authorization"] == "Bearer sk-backend" for _, _, h in fake.received)


@pytest.mark.parametrize(
    ("fields", "legs"),
    [({"n": 2}, 2), ({"prompt": ["one", "two", "three"]}, 3), ({"prompt_logprobs": 1}, 0)],
)
async def test_shape_routes_come_before_the_mode(fields, legs):
    """A fan-out's legs and decode alone take the normal legs, never the mode's."""
    body = body_for(COMPLETIONS, **{"max_tokens": 3, **fields})
    async with pd_stack(**FIRST) as s:
        s.decode.knobs.plain_requests = True
        status, _, raw = await s.post(COMPLETIONS, body)
        assert status == 200, raw
        assert len(s.prefill.seen) == legs
        assert all("return_token_ids" not in p.body for p in s.prefill.seen)
        assert outcome(s, "continued") == 0
