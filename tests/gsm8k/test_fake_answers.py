"""The fake vLLM's GSM8K answer mode, which test_eval_script drives through the real proxy: the
answers it gives, and the checks that catch a proxy skipping the prefill leg or losing its KV
handles (the eval script's test only sees that nothing was rejected)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from pd_proxy.testing import fake_model as fake_vllm
from pd_proxy.testing.fake_model import DECODE, PREFILL
from pd_proxy.testing.fake_vllm import FakeVLLM
from tests.support.paths import REPO

SLICE = REPO / "scripts" / "data" / "gsm8k_slice"
ANSWERS = fake_vllm.load_answers(SLICE)
QUESTIONS = list(ANSWERS)  # in row order
MODEL = "fake/model"


def few_shot(question: str) -> str:
    """A prompt shaped like lm-eval's: shots first, the question asked last."""
    return f"Question: {QUESTIONS[5]}\nAnswer: 42\n\nQuestion: {question}\nAnswer:"


def test_modes_score_what_they_claim() -> None:
    assert sum(fake_vllm.is_right("mixed", i) for i in range(40)) == 26
    assert all(fake_vllm.is_right("correct", i) for i in range(40))
    assert not any(fake_vllm.is_right("wrong", i) for i in range(40))
    assert (fake_vllm.wrong("1,234"), fake_vllm.wrong("3.5")) == ("1241", "-1")


def test_reply_answers_the_last_question_of_the_prompt() -> None:
    assert ANSWERS[QUESTIONS[1]] == ("3", 1)
    reply = fake_vllm.gsm8k_reply(ANSWERS, "correct", few_shot(QUESTIONS[1]))
    assert reply is not None and reply.endswith("\n#### 3\n\n")
    reply = fake_vllm.gsm8k_reply(ANSWERS, "wrong", few_shot(QUESTIONS[1]))
    assert reply is not None and reply.endswith("\n#### 10\n\n")
    assert fake_vllm.gsm8k_reply(ANSWERS, "correct", few_shot("Not in GSM8K?")) is None
    assert fake_vllm.gsm8k_reply(ANSWERS, "correct", "no question here") is None


def test_prompt_text_is_one_text_prompt() -> None:
    assert fake_vllm.prompt_text({"prompt": "a"}) == "a"
    assert fake_vllm.prompt_text({"prompt": ["a"]}) == "a"
    assert fake_vllm.prompt_text({"messages": [{"content": "a"}, {"content": "b"}]}) == "a\nb"
    for body in ({"prompt": ["a", "b"]}, {"prompt": [1, 2]}, {}):
        assert fake_vllm.prompt_text(body) is None


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str = ""
) -> tuple[int, dict[str, Any]]:
    headers = {"X-Request-Id": rid} if rid else {}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def _leg(prompt: Any, kv: dict[str, Any] | None, max_tokens: int = 256) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": kv}


PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}


async def _broken_proxies() -> None:
    prefill = FakeVLLM(role=PREFILL, model=MODEL, answers=ANSWERS, engine_id="p1")
    stranger = FakeVLLM(role=PREFILL, model=MODEL, answers=ANSWERS, engine_id="p2")
    decode = FakeVLLM(role=DECODE, model=MODEL, answers=ANSWERS, prefill_engine_id="p1")
    for fake in (prefill, stranger, decode):
        await fake.start()
    prompt = few_shot(QUESTIONS[1])
    try:
        async with aiohttp.ClientSession() as s:
            status, body = await _post(s, prefill.url, _leg(prompt, PREFILL_KV, 1), "r1")
            assert status == 200, body
            handles = body["kv_transfer_params"]
            assert handles["remote_engine_id"] == "p1"
            _, other = await _post(s, stranger.url, _leg(prompt, PREFILL_KV, 1), "r1")

            # What a proxy gets wrong: no prefill leg, another engine's handles, handles of
            # another request, the wrong model, a batch; and a prefill leg that is no prefill.
            broken = [
                (decode, _leg(prompt, None), "r1", "the kv_transfer_params a prefill returned"),
                (decode, _leg(prompt, other["kv_transfer_params"]), "r1", "'p2', not the prefill"),
                (decode, _leg(prompt, handles), "r2", "X-Request-Id differs"),
                (decode, {**_leg(prompt, handles), "model": "x"}, "r1", "'x' is not served"),
                (decode, _leg([prompt, prompt], handles), "r1", "one text prompt"),
                (prefill, _leg(prompt, None, 1), "r3", "do_remote_decode=true"),
            ]
            for fake, leg, rid, why in broken:
                status, body = await _post(s, fake.url, leg, rid)
                assert status == 400 and why in body["error"]["message"], (why, body)

            status, body = await _post(s, decode.url, _leg(prompt, handles), "r1")
            assert status == 200, body
            assert body["choices"][0]["text"].endswith("#### 3\n\n")
            async with s.post(decode.url + "/fake/mode", json={"mode": "wrong"}) as resp:
                assert resp.status == 200 and decode.knobs.gsm8k_mode == "wrong"
            async with s.post(decode.url + "/fake/mode", json={"mode": "bad"}) as resp:
                assert resp.status == 400 and decode.knobs.gsm8k_mode == "wrong"
            status, body = await _post(s, decode.url, _leg(prompt, handles), "r1")
            assert body["choices"][0]["text"].endswith("#### 10\n\n")
            unknown = _leg(few_shot("Not in GSM8K?"), handles)
            status, body = await _post(s, decode.url, unknown, "r1")
            assert (status, body["choices"][0]["text"]) == (200, fake_vllm.UNKNOWN_ANSWER)

            async with s.get(decode.url + "/metrics") as resp:
                metrics = await resp.text()
            async with s.get(decode.url + "/version") as resp:
                assert json.loads(await resp.text()) == {"version": fake_vllm.VERSION}
    finally:
        for fake in (prefill, stranger, decode):
            await fake.stop()
    assert 'fake_requests_total{result="ok"} 2\n' in metrics
    assert 'fake_requests_total{result="rejected"} 5\n' in metrics
    assert 'fake_requests_total{result="unknown_question"} 1\n' in metrics
    assert 'source="external_kv_transfer"} 8\n' in metrics
    assert 'vllm:cache_config_info{block_size="128",engine="0",role="decode"} 1.0' in metrics


def test_answering_fakes_catch_a_broken_proxy() -> None:
    asyncio.run(_broken_proxies())
