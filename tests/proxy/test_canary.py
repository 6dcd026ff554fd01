"""The canary (pd_proxy.api.canary): the pure comparison, runs against fake backends (an honest
decode,
a corrupted one, failing legs), and its wiring into the app (metrics, start, stop, workers)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import CollectorRegistry

from pd_proxy.api.app import PROXY_KEY, build_app
from pd_proxy.api.canary import (
    ERROR,
    MATCH,
    METRIC_NAMES,
    MISMATCH,
    PROMPT,
    Canary,
    Leg,
    compare,
    leg_from_answer,
)
from pd_proxy.config import ConfigError, ProxyConfig, load_config
from tests.proxy.proxy_harness import Stack, pd_stack

URLS = {"prefill": ("http://127.0.0.1:1",), "decode": ("http://127.0.0.1:2",)}


# ----------------------------------------------------------------------------- comparison (pure)
def answer(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": text}]}).encode()


def test_identical_texts_match_whitespace_included() -> None:
    text = " 151, 152,\n 153,  154"
    verdict = compare(Leg(text=text), Leg(text=text))
    assert verdict.outcome == MATCH and f"{len(text)} characters" in verdict.detail


@pytest.mark.parametrize(
    ("pd", "alone", "at"),
    [
        (" 121, 122, 123", " 121, 122, 124", 13),
        (" 121, 122", " 121,  122", 6),  # whitespace only: other tokens, so a mismatch
        (" 121, 122", " 121, 122, 123", 9),  # one is a prefix of the other
        ("", " 121", 0),  # HTTP 200 with empty text where the prefill wrote some
    ],
    ids=["digit", "whitespace", "prefix", "empty"],
)
def test_any_difference_is_a_mismatch_that_says_where(pd: str, alone: str, at: int) -> None:
    verdict = compare(Leg(text=pd), Leg(text=alone))
    assert verdict.outcome == MISMATCH
    assert f"at character {at}:" in verdict.detail
    assert repr(pd[max(0, at - 10) :]) in verdict.detail


@pytest.mark.parametrize(
    ("pd", "alone", "said"),
    [
        (Leg(error="HTTP 504: decode sent nothing"), Leg(text=" 121"), "P/D: HTTP 504"),
        (Leg(text=" 121"), Leg(error="HTTP 503: no healthy prefill"), "prefill alone: HTTP 503"),
        (Leg(error="HTTP 502: x"), Leg(error="HTTP 502: y"), "P/D: HTTP 502: x; prefill alone"),
        (Leg(text=""), Leg(text=""), "nothing was compared"),
        (Leg(), Leg(text="a"), "gave no text"),
    ],
    ids=["pd-failed", "reference-failed", "both-failed", "both-empty", "no-text"],
)
def test_failures_are_errors_never_mismatches(pd: Leg, alone: Leg, said: str) -> None:
    verdict = compare(pd, alone)
    assert verdict.outcome == ERROR and said in verdict.detail


@pytest.mark.parametrize(
    ("status", "data", "leg"),
    [
        (200, answer(" 121, 122"), Leg(text=" 121, 122")),
        (200, answer(""), Leg(text="")),
        (503, b'{"error": "overloaded"}', Leg(error='HTTP 503: {"error": "overloaded"}')),
        (200, b"<html>", Leg(error="not JSON: <html>")),
        (200, b'{"choices": []}', Leg(error="no choices[0].text in the answer")),
        (200, b'{"choices": [{"text": null}]}', Leg(error="no choices[0].text in the answer")),
        (200, b"[1]", Leg(error="no choices[0].text in the answer")),
    ],
    ids=["text", "empty-text", "http-error", "not-json", "no-choices", "null-text", "not-object"],
)
def test_leg_from_answer(status: int, data: bytes, leg: Leg) -> None:
    assert leg_from_answer(status, data) == leg


def test_the_prompt_spans_several_kv_blocks() -> None:
    """More than 128 tokens even for the fake tokenizer (one per word; a real one splits each
    number and its comma further), so the GPU's block size of 128 gives decode several blocks."""
    assert len(PROMPT.split()) > 128


# ----------------------------------------------------------------------------- against fakes
def canary_for(stack: Stack, timeout: float = 10.0) -> Canary:
    for fake in stack.prefills:
        fake.knobs.plain_requests = True
    legs, proxy = stack.running.legs, stack.proxy
    return Canary(
        legs,
        legs.exchange,
        proxy.prefill_pool,
        backend_key=proxy.backend_key,
        prefill_timeout=proxy.config.prefill_timeout,
        registry=CollectorRegistry(),
        interval_s=3600.0,
        timeout_s=timeout,
    )


def counts(canary: Canary) -> tuple[float, float, float]:
    return (canary.runs._value.get(), canary.mismatches._value.get(), canary.errors._value.get())


async def test_an_honest_pd_stack_matches() -> None:
    async with pd_stack() as stack:
        canary = canary_for(stack)
        before = time.time()
        verdict = await canary.run_once()
        assert verdict.outcome == MATCH, verdict
        assert counts(canary) == (1, 0, 0)
        assert canary.last_run._value.get() >= before
        # The reference went to the prefill alone, without kv_transfer_params, for 16 tokens;
        # the P/D legs are the proxy's: prefill for one token, decode with the prefill's handles.
        alone, leg1 = stack.prefill.seen
        assert "kv_transfer_params" not in alone.body and alone.body["max_tokens"] == 16
        assert alone.body["temperature"] == 0 and alone.body["ignore_eos"] is True
        assert leg1.body["max_tokens"] == 1 and leg1.body["kv_transfer_params"]["do_remote_decode"]
        (leg2,) = stack.decode.seen
        assert leg2.body["kv_transfer_params"]["do_remote_prefill"] is True
        rid = leg1.headers["X-Request-Id"]
        assert rid.startswith("canary-") and leg2.headers["X-Request-Id"] == rid
        assert alone.headers["X-Request-Id"] == rid + "-alone"
        assert stack.decode.rejected == 0 and stack.prefill.rejected == 0
        # Not a client request.
        assert stack.sample("pd_proxy_requests_total", {"endpoint": "/v1/completions"}) is None


async def test_a_corrupted_decode_is_a_mismatch() -> None:
    async with pd_stack() as stack:
        canary = canary_for(stack)
        stack.decode.knobs.corrupt = True
        verdict = await canary.run_once()
        assert verdict.outcome == MISMATCH, verdict
        assert "x0" in verdict.detail and "t0" in verdict.detail
        assert counts(canary) == (1, 1, 0)
        stack.decode.knobs.corrupt = False
        assert (await canary.run_once()).outcome == MATCH
        assert counts(canary) == (2, 1, 0)


async def test_backend_key_goes_on_every_canary_leg(tmp_path) -> None:
    key_file = tmp_path / "vllm_api_key"
    key_file.write_text("sk-backend\n")
    async with pd_stack(backend_key="sk-backend", backend_api_key_file=str(key_file)) as stack:
        assert (await canary_for(stack).run_once()).outcome == MATCH
        seen = [s.headers for fake in (stack.prefill, stack.decode) for s in fake.seen]
        assert len(seen) == 3
        assert {h["Authorization"] for h in seen} == {"Bearer sk-backend"}
    async with pd_stack(backend_key="sk-backend") as stack:  # the proxy has no key to send
        verdict = await canary_for(stack).run_once()
        assert verdict.outcome == ERROR and "rejected the proxy's API key" in verdict.detail


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_failing_backend_is_an_error(role: str) -> None:
    async with pd_stack() as stack:
        canary = canary_for(stack)
        fake = stack.prefill if role == "prefill" else stack.decode
        fake.knobs.fail_status = 503
        verdict = await canary.run_once()
        assert verdict.outcome == ERROR, verdict
        assert "503" in verdict.detail
        assert counts(canary) == (1, 0, 1)


async def test_a_run_is_bounded_by_the_canary_timeout() -> None:
    async with pd_stack() as stack:
        # Two prefill legs must finish, and the decode leg reach its backend, within the limit
        # (the decode leg is the one cut below): 1 s, so a stalled (loaded) host cannot end
        # the run before that; the decode's 30 s delay still dwarfs it.
        canary = canary_for(stack, timeout=1.0)
        stack.decode.knobs.delay = 30.0
        start = time.monotonic()
        verdict = await canary.run_once()
        assert time.monotonic() - start < 10.0
        assert verdict == verdict.__class__(ERROR, "no verdict within 1s")
        await stack.decode.wait_for(lambda: stack.decode.cancelled)  # the decode leg was cut
        # The cut leg's backend is free again: nothing leaked in the pool's accounting.
        assert [b.outstanding for b in stack.proxy.decode_pool.backends] == [0]


async def test_requests_are_served_while_a_canary_run_waits() -> None:
    async with pd_stack(decodes=2) as stack:
        canary = canary_for(stack, timeout=10.0)  # room for the run to end in a match
        slow, fast = stack.decodes
        slow.knobs.delay = 3.0
        run = asyncio.create_task(canary.run_once())
        await slow.wait_for(lambda: slow.seen)  # the canary's decode leg sits on `slow`
        start = time.monotonic()
        status, _, _ = await stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and time.monotonic() - start < 2.0  # least-busy: `fast`
        assert fast.completed == 1
        assert (await run).outcome == MATCH


# ----------------------------------------------------------------------------- wiring
async def test_configured_canary_runs_at_start_exports_metrics_and_stops() -> None:
    async with pd_stack(canary_minutes=0.001, metrics_port=0) as stack:  # every 60 ms
        canary = stack.running.canary
        assert canary is not None
        for fake in stack.prefills:
            fake.knobs.plain_requests = True
        deadline = time.monotonic() + 10
        while canary.mismatches._value.get() == 0 and canary.runs._value.get() < 3:
            await asyncio.sleep(0.02)
        assert time.monotonic() < deadline
        stack.decode.knobs.corrupt = True
        while canary.mismatches._value.get() == 0:
            await asyncio.sleep(0.02)
        status, text = await stack.get("/metrics", base=stack.metrics_url)
        assert status == 200
        families = {
            line.split()[2] for line in text.decode().splitlines() if line.startswith("# TYPE")
        }
        assert set(METRIC_NAMES) <= {f + "_total" for f in families} | families
        task = canary._task
        assert task is not None and not task.done()
    assert canary._task is None and task.done()


def test_canary_is_off_by_default_and_off_in_workers_after_the_first() -> None:
    assert build_app(ProxyConfig(**URLS))[PROXY_KEY].canary_interval_s is None
    config = ProxyConfig(**URLS, canary_minutes=10)
    assert build_app(config)[PROXY_KEY].canary_interval_s == 600
    assert build_app(config, canary=False)[PROXY_KEY].canary_interval_s is None
    assert build_app(ProxyConfig(**URLS, canary_minutes=0))[PROXY_KEY].canary_interval_s is None


def test_canary_options() -> None:
    base = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    config = load_config(base, {"PD_PROXY_CANARY_MINUTES": "5", "PD_PROXY_CANARY_TIMEOUT": "9"})
    assert (config.canary_minutes, config.canary_timeout) == (5.0, 9.0)
    config = load_config([*base, "--canary-minutes", "0.5"], {"PD_PROXY_CANARY_MINUTES": "5"})
    assert config.canary_minutes == 0.5
    assert load_config(base, {}).canary_minutes is None
    with pytest.raises(ConfigError, match="canary_minutes must be >= 0"):
        load_config([*base, "--canary-minutes", "-1"], {})
    with pytest.raises(ConfigError, match="canary_timeout must be > 0"):
        load_config([*base, "--canary-timeout", "0"], {})
