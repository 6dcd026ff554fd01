"""Malformed values are refused as vLLM refuses them, and lax ones read as vLLM reads them."""

from __future__ import annotations

import json
import time

import pytest

from pd_proxy.protocol.client_fields import lax_bool, read_fields
from pd_proxy.protocol.errors import ProxyError
from tests.proxy.proxy_harness import pd_stack, sse_events


def error_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (b'{"prompt": "x", "stream": "maybe"}', "stream", "'stream' must be a boolean"),
        (b'{"prompt": "x", "stream": [true]}', "stream", "'stream' must be a boolean"),
        (b'{"prompt": "x", "stream": 2}', "stream", "'stream' must be a boolean"),
        (b'{"prompt": "x", "n": "two"}', "n", "'n' must be an integer"),
        (b'{"prompt": "x", "n": 2.5}', "n", "'n' must be an integer"),
        (b'{"prompt": "x", "stream_options": "yes"}', "stream_options", "must be an object"),
        (
            b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "often"}}',
            "include_usage",
            "'include_usage' must be a boolean",
        ),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "nested too deeply"),
    ],
    ids=[
        "stream-word",
        "stream-list",
        "stream-2",
        "n-word",
        "n-fraction",
        "options-string",
        "include-usage-word",
        "100k-brackets",
        "deep-prompt",
    ],
)
async def test_malformed_values_are_fast_400s_naming_the_parameter(body, param, message):
    async with pd_stack() as s:
        start = time.perf_counter()
        status, _, raw = await s.post("/v1/completions", body)
        elapsed = time.perf_counter() - start
        assert status == 400, raw[:200]
        err = error_of(raw)
        assert message in err["message"] and err.get("param") == param
        assert elapsed < 1.0
        assert s.prefill.seen == [] and s.decode.seen == []


async def test_a_lax_n_fans_out_as_vllm_counts_it():
    """``"n": "2"`` is two samples to vLLM: two P/D requests, never a prefill asked for two."""
    async with pd_stack() as s:
        status, _, raw = await s.post("/v1/completions", {"prompt": "x", "n": "2", "max_tokens": 2})
        assert status == 200, raw
        assert len(json.loads(raw)["choices"]) == 2
        prefills = [seen.body for seen in s.prefill.seen]
        assert len(prefills) == 2 and all("n" not in body for body in prefills)


async def test_a_lax_stream_flag_is_read_as_vllm_reads_it():
    async with pd_stack() as s:
        body = {"prompt": "x", "max_tokens": 2, "n": 2, "stream": "yes"}
        status, headers, raw = await s.post("/v1/completions", body)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        assert sse_events(raw)[-1] == "[DONE]"
        body["stream"] = "false"
        status, headers, raw = await s.post("/v1/completions", body)
        assert status == 200 and headers["Content-Type"].startswith("application/json"), raw


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), ("YES", True), ("on", True), (1, True), ("n", False), (0.0, False)],
)
def test_lax_booleans_are_pydantics(value, expected):
    assert lax_bool(value, "stream") is expected


def test_read_fields_writes_json_types_back():
    body = {"stream": "true", "n": "3", "stream_options": {"include_usage": "1"}}
    read_fields(body)
    assert body == {"stream": True, "n": 3, "stream_options": {"include_usage": True}}
    with pytest.raises(ProxyError):
        read_fields({"stream": ""})
