"""The request-shape matrix (pd_proxy/routing/shapes.yaml) through a real proxy and the fake
backends.

The fakes enforce what vLLM would get wrong: a prefill leg with ``n`` above 1 or several prompts
(KV held nobody reads) and a decode leg with ``prompt_logprobs`` on remote KV (a hang) are
rejected, and every KV handle a prefill issues must be read by exactly one decode request.
"""

from __future__ import annotations

import json
import time

import pytest

from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.routing.shapes import FANOUT, LOCAL, PD, REFUSE, TABLE, Shape, fanout_size
from tests.proxy.proxy_harness import pd_stack, sse_events


def base(endpoint: str) -> dict:
    if endpoint == COMPLETIONS:
        return {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 4}
    messages = [{"role": "user", "content": "Hi there"}]
    return {"model": "fake-model", "messages": messages, "max_tokens": 4}


CASES = [
    pytest.param(
        row,
        endpoint,
        stream,
        id=f"{row.name}-{'chat' if 'chat' in endpoint else 'completions'}-{stream}",
    )
    for row in TABLE.shapes
    for endpoint in row.endpoints
    for stream in (False, True)
]


def _texts(endpoint: str, raw: bytes, stream: bool) -> tuple[dict[int, str], list]:
    """Each choice's text by index, and the usage chunks/objects seen."""
    texts: dict[int, str] = {}
    usages = []
    key = "text" if endpoint == COMPLETIONS else None
    if not stream:
        answer = json.loads(raw)
        for choice in answer["choices"]:
            texts[choice["index"]] = choice[key] if key else choice["message"]["content"]
        return texts, [answer["usage"]]
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    for event in events[:-1]:
        obj = json.loads(event)
        if not obj["choices"]:
            usages.append(obj["usage"])
        for choice in obj["choices"]:
            piece = choice.get(key) if key else choice["delta"].get("content")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts, usages


@pytest.mark.parametrize(("row", "endpoint", "stream"), CASES)
async def test_matrix_on_fakes(row: Shape, endpoint: str, stream: bool) -> None:
    body = {**base(endpoint), "stream": stream, **row.example}  # an example's stream wins
    stream = bool(body["stream"])
    async with pd_stack() as stack:
        stack.decode.knobs.plain_requests = True  # decode alone, as vLLM's decode serves it
        status, _, raw = await stack.post(endpoint, body)
        prefill, decode = stack.prefill, stack.decode
        assert prefill.rejected == 0 and decode.rejected == 0, raw
        refused = stack.sample("pd_proxy_refused_total", {"reason": row.name})
        if row.route == REFUSE:
            assert status == 400
            error = json.loads(raw)["error"]
            assert error["param"] == row.param
            assert row.param in error["message"]
            assert not prefill.seen and not decode.seen  # no backend touched
            assert refused == 1
            return
        assert refused is None
        if row.name == "greedy_n":  # vLLM's own 400 from the prefill leg, relayed
            assert status == 400 and b"greedy" in raw
            assert not decode.seen and not prefill.issued
            return
        assert status == 200, raw
        # Every KV handle the prefill issued was read by one decode request: nothing held.
        pulled = [
            s.body["kv_transfer_params"]["remote_request_id"]
            for s in decode.seen
            if isinstance(s.body.get("kv_transfer_params"), dict)
        ]
        assert sorted(pulled) == sorted(prefill.issued)
        texts, usages = _texts(endpoint, raw, stream)
        if row.route == LOCAL:
            assert not prefill.seen
            assert [s.body.get("kv_transfer_params") for s in decode.seen] == [None]
        elif row.route == FANOUT:
            size = fanout_size(body, endpoint)
            assert len(prefill.issued) == size == len(texts)
            assert sorted(texts) == list(range(size))
            legs = len({s.headers["X-Request-Id"] for s in decode.seen})
            assert legs == size
            assert stack.sample("pd_proxy_fanout_requests_total", {"shape": row.name}) == 1
            assert stack.sample("pd_proxy_fanout_legs_total", {"shape": row.name}) == size
        else:
            assert row.route == PD
            assert len(prefill.issued) == 1 and len(texts) == 1
        if not stream or body.get("stream_options"):
            assert len(usages) == 1


async def _one(stack, endpoint: str, body: dict) -> dict:
    status, _, raw = await stack.post(endpoint, {**body, "stream": False})
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("stream", [False, True])
async def test_fanout_equals_one_request_per_prompt_and_sums_usage(stream: bool) -> None:
    prompts = ["one two three", "four five", "six"]
    body = {**base(COMPLETIONS), "prompt": prompts, "n": 2, "stream": stream}
    body["stream_options"] = {"include_usage": True} if stream else None
    async with pd_stack() as stack:
        singles = [
            await _one(stack, COMPLETIONS, {**base(COMPLETIONS), "prompt": p}) for p in prompts
        ]
        status, _, raw = await stack.post(COMPLETIONS, body)
        assert status == 200, raw
    texts, usages = _texts(COMPLETIONS, raw, stream)
    want = {i: singles[i // 2]["choices"][0]["text"] for i in range(6)}
    assert texts == want
    prompt_tokens = sum(s["usage"]["prompt_tokens"] for s in singles)
    completion_tokens = 2 * sum(s["usage"]["completion_tokens"] for s in singles)
    assert usages == [
        {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
    ]


async def test_fanout_first_failing_leg_ends_the_request_at_once_with_its_own_error() -> None:
    """One prefill refuses its leg (400) while the other legs' decodes take seconds: the client
    gets that 400 with the backend's own message at once, and every other leg is cut short: at
    its prefill, or with its KV taken by a one-token decode (after its own decode, if it had
    started, was cancelled)."""
    body = {**base(CHAT_COMPLETIONS), "n": 3}
    async with pd_stack() as stack:
        prefill, decode = stack.prefill, stack.decode
        prefill.knobs.fail_status = 400
        prefill.knobs.fail_times = 1
        decode.knobs.delay = 5.0
        start = time.perf_counter()
        status, _, raw = await stack.post(CHAT_COMPLETIONS, body)
        elapsed = time.perf_counter() - start
        assert status == 400, raw
        assert json.loads(raw)["error"]["message"] == "injected failure 400"
        assert elapsed < 3.0  # not the decodes' 5 s
        failed = prefill.seen[0].headers["X-Request-Id"]  # the first prefill leg got the 400
        others = {seen.headers["X-Request-Id"] for seen in prefill.seen} - {failed}
        assert len(others) == 2

        def settled() -> bool:
            released = {s.headers["X-Request-Id"] for s in decode.seen if s.body["max_tokens"] == 1}
            return all(rid in prefill.cancelled or rid in released for rid in others)

        await decode.wait_for(settled)


async def test_fanout_stream_ends_at_once_when_a_decode_leg_fails() -> None:
    body = {**base(COMPLETIONS), "n": 3, "max_tokens": 20, "stream": True}
    async with pd_stack() as stack:
        stack.decode.knobs.token_delay = 0.25
        stack.decode.knobs.fail_status = 500
        stack.decode.knobs.fail_times = 1
        start = time.perf_counter()
        status, _, raw = await stack.post(COMPLETIONS, body)
        elapsed = time.perf_counter() - start
        assert elapsed < 3.0, elapsed  # not the 5 s of the other legs' 20 tokens
        text = raw.decode()
        assert "injected failure 500" in text
        if status == 200:  # the other legs' first events went out before the failure
            assert sse_events(raw)[-1] == "[DONE]" and '"code": 502' in text
        else:
            assert status == 502
        await stack.decode.wait_for(lambda: len(stack.decode.cancelled) == 2)


async def test_fanout_seeds_each_sample_as_vllm_does() -> None:
    body = {**base(CHAT_COMPLETIONS), "n": 3, "seed": 40}
    async with pd_stack() as stack:
        status, _, raw = await stack.post(CHAT_COMPLETIONS, body)
        assert status == 200, raw
        seeds = sorted(s.body["seed"] for s in stack.decode.seen)
    assert seeds == [40, 41, 42]


async def test_local_route_streams_decode_bytes_unchanged() -> None:
    body = {**base(COMPLETIONS), "prompt_logprobs": 1, "stream": True}
    async with pd_stack() as stack:
        stack.decode.knobs.plain_requests = True
        status, headers, raw = await stack.post(COMPLETIONS, body)
        assert status == 200
        rid = headers["X-Request-Id"]
        assert raw == stack.decode.sent[rid]
