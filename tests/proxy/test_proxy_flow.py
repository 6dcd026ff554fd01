"""End to end through a real proxy app and fake vLLM backends: both legs, relay, request ids."""

from __future__ import annotations

import json

from pd_proxy.metrics import METRIC_NAMES
from tests.proxy.proxy_harness import EXPECTED_PREFILL_KV, pd_stack, sse_events


async def test_streaming_completion_legs_and_byte_exact_relay():
    client = {
        "model": "fake-model",
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "min_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    headers = {"X-Request-Id": "client-rid-1", "Authorization": "Bearer sk-test"}
    async with pd_stack() as s:
        status, resp_headers, raw = await s.post("/v1/completions", client, headers)
        assert status == 200, raw
        assert resp_headers["Content-Type"].startswith("text/event-stream")
        assert resp_headers["X-Request-Id"] == "client-rid-1"

        [p] = s.prefill.seen
        [d] = s.decode.seen
        assert p.path == d.path == "/v1/completions"
        assert p.body == {
            "model": "fake-model",
            "prompt": "The capital of France is",
            "max_tokens": 1,
            "stream": False,
            "temperature": 0,
            "kv_transfer_params": EXPECTED_PREFILL_KV,
        }
        assert d.body == {**client, "kv_transfer_params": s.prefill.issued["client-rid-1"]}
        for leg in (p, d):
            assert leg.headers["X-Request-Id"] == "client-rid-1"
            assert "Authorization" not in leg.headers  # the client's key is for the proxy only
        # Relayed byte for byte: 16 tokens, the usage chunk and [DONE].
        assert raw == s.decode.sent["client-rid-1"]
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        assert texts == [f" t{i}" for i in range(16)]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 16


async def test_chat_completion_streaming_and_json():
    messages = [{"role": "user", "content": "hi"}]
    async with pd_stack() as s:
        body = {"messages": messages, "max_completion_tokens": 5, "stream": True}
        status, _, raw = await s.post("/v1/chat/completions", body)
        assert status == 200, raw
        [p] = s.prefill.seen
        assert p.path == "/v1/chat/completions"
        assert p.body == {
            "messages": messages,
            "max_completion_tokens": 1,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": EXPECTED_PREFILL_KV,
        }
        rid = p.headers["X-Request-Id"]
        assert s.decode.seen[0].body == {**body, "kv_transfer_params": s.prefill.issued[rid]}
        assert raw == s.decode.sent[rid]
        role, *chunks = sse_events(raw)[:-1]
        assert json.loads(role)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [json.loads(e)["choices"][0]["delta"]["content"] for e in chunks]
        assert deltas == [f" t{i}" for i in range(5)]

        status, headers, raw = await s.post(
            "/v1/chat/completions", {"messages": messages, "max_tokens": 3}
        )
        assert status == 200
        assert headers["Content-Type"].startswith("application/json")
        rid = headers["X-Request-Id"]
        assert raw == s.decode.sent[rid]
        assert json.loads(raw)["choices"][0]["message"]["content"] == " t0 t1 t2"


async def test_chat_with_odd_bodies_reaches_decode_as_the_semantic_rewrite():
    """Unicode, escaped quotes, nested objects and a client-sent null kv_transfer_params (any
    other value is refused: test_proxy_shapes): the decode leg (spliced from the client's bytes,
    or re-encoded) parses to the client body plus the prefill's params."""
    bodies = [
        '{"messages": [{"role": "user", "content": "h\u00e9 \\"}\\" ☃ 😀"}], "max_tokens": 2, '
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": '
        '"object", "properties": {"a": {"type": ["string", "null"]}}}}}], "stream": true}',
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], '
        '"max_tokens": 2, "kv_transfer_params": null}',
    ]
    async with pd_stack() as s:
        for i, text in enumerate(bodies):
            raw = text.encode()
            status, headers, out = await s.post(
                "/v1/chat/completions", raw, {"Content-Type": "application/json"}
            )
            assert status == 200, out
            rid = headers["X-Request-Id"]
            client = json.loads(raw)
            assert s.decode.seen[i].body == {**client, "kv_transfer_params": s.prefill.issued[rid]}
            assert out == s.decode.sent[rid]


async def test_generated_request_ids_are_shared_by_both_legs_and_unique():
    async with pd_stack() as s:
        ids = []
        for _ in range(3):
            status, headers, _ = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200
            ids.append(headers["X-Request-Id"])
        assert len(set(ids)) == 3 and all(ids)
        assert [x.headers["X-Request-Id"] for x in s.prefill.seen] == ids
        assert [x.headers["X-Request-Id"] for x in s.decode.seen] == ids
        assert all("Authorization" not in x.headers for x in s.prefill.seen + s.decode.seen)


async def test_prefill_returning_null_params_is_forwarded_as_null():
    """vLLM returns null kv_transfer_params when the one prefill token is EOS; decode recomputes."""
    async with pd_stack() as s:
        s.prefill.knobs.fail_status = 200
        s.prefill.knobs.fail_body = b'{"choices": [], "kv_transfer_params": null}'
        s.decode.role = "plain"  # a plain decode accepts a request without params
        status, _, raw = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200, raw
        assert s.decode.seen[0].body["kv_transfer_params"] is None


async def test_models_comes_from_decode():
    async with pd_stack() as s:
        s.decode.model = "decode-model"
        status, raw = await s.get("/v1/models")
        assert status == 200
        assert json.loads(raw)["data"][0]["id"] == "decode-model"


async def test_metrics_expose_every_family_and_count_traffic():
    async with pd_stack() as s:
        for _ in range(3):
            await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
        await s.post("/v1/chat/completions", b"{")
        status, raw = await s.get("/metrics")
        assert status == 200
        text = raw.decode()
        for name in METRIC_NAMES:
            assert f"# TYPE {name} " in text
        labels = {"endpoint": "/v1/completions", "status": "200", "path": "pd"}
        assert s.sample("pd_proxy_requests_total", labels) == 3
        bad = {"endpoint": "/v1/chat/completions", "status": "400", "path": "pd"}
        assert s.sample("pd_proxy_requests_total", bad) == 1
        assert s.sample("pd_proxy_prefill_duration_seconds_count") == 3
        assert s.sample("pd_proxy_decode_ttfb_seconds_count") == 3
        assert (
            s.sample("pd_proxy_time_to_first_byte_seconds_count", {"path": "pd"}) == 3
        )  # not the 400
        assert s.sample("pd_proxy_request_duration_seconds_count") == 4
        assert s.sample("pd_proxy_in_flight_requests") == 0
        healthy = {"role": "decode", "backend": s.decode.url}
        assert s.sample("pd_proxy_backend_healthy", healthy) == 1


async def test_no_metrics_flag_hides_the_endpoint():
    async with pd_stack(metrics=False) as s:
        status, raw = await s.get("/metrics")
        assert status == 404
        assert json.loads(raw)["error"]["code"] == 404


async def test_prefill_leg_goes_again_when_a_reused_connection_closes_before_any_answer():
    """A backend's idle close crossing the request (the connection reused, the backend read the
    request and closed without a byte): the prefill leg goes once more, on a new connection, and
    the client never sees it. Decode's leg is not sent twice (its work may have begun)."""
    async with pd_stack() as s:
        body = {"prompt": "x", "max_tokens": 2}
        status, _, raw = await s.post("/v1/completions", body)
        assert status == 200, raw
        s.prefill.knobs.close_reused = 1
        status, _, raw = await s.post("/v1/completions", body)
        assert status == 200, raw
        assert s.prefill.closed_reused == 1
        assert len(s.prefill.seen) == 2  # the dropped request was not read
        assert s.sample(
            "pd_proxy_backend_errors_total", {"stage": "prefill", "backend": s.prefill.url}
        ) in (None, 0.0)

        s.decode.knobs.close_reused = 1
        status, _, raw = await s.post("/v1/completions", body)
        assert status == 502, raw
        assert s.decode.closed_reused == 1
