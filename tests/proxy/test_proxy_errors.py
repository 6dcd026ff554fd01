"""Every error path ends in an OpenAI-style answer (or a terminated SSE stream), never a hang."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.proxy.proxy_harness import pd_stack, sse_events


def error_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", b"{oops", "not valid JSON"),
        ("/v1/completions", b'{"model": "m"}', "'prompt' is required"),
        ("/v1/chat/completions", b'{"prompt": "x"}', "'messages' is required"),
        ("/v1/chat/completions", b'"just a string"', "JSON object"),
    ],
)
async def test_bad_requests_get_400_and_reach_no_backend(path, body, message):
    async with pd_stack() as s:
        status, headers, raw = await s.post(path, body)
        assert status == 400
        err = error_of(raw)
        assert message in err["message"] and err["code"] == 400
        assert headers["X-Request-Id"]
        assert s.prefill.seen == [] and s.decode.seen == []


async def test_body_over_the_limit_gets_413_with_and_without_content_length():
    async with pd_stack(max_body_bytes=1024) as s:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        status, _, raw = await s.post("/v1/completions", big)
        assert status == 413
        assert error_of(raw)["code"] == 413

        async def chunks():
            for i in range(0, len(big), 100):
                yield big[i : i + 100]

        async with s.session.post(s.url + "/v1/completions", data=chunks()) as r:
            assert r.status == 413
            assert error_of(await r.read())["code"] == 413
        assert s.prefill.seen == []
        # Just under the limit still works.
        status, _, _ = await s.post("/v1/completions", {"prompt": "x" * 900, "max_tokens": 1})
        assert status == 200


@pytest.mark.parametrize("stage", ["prefill", "decode"])
async def test_backend_4xx_is_passed_through_with_its_body(stage):
    async with pd_stack() as s:
        fake = s.prefill if stage == "prefill" else s.decode
        fake.knobs.fail_status = 422
        fake.knobs.fail_body = b'{"error": {"message": "prompt too long", "code": 422}}'
        status, _, raw = await s.post("/v1/completions", {"prompt": "x", "stream": True})
        assert status == 422
        assert raw == fake.knobs.fail_body
        assert (
            s.sample("pd_proxy_backend_errors_total", {"stage": stage, "backend": fake.url}) is None
        )


@pytest.mark.parametrize("stage", ["prefill", "decode"])
async def test_backend_5xx_becomes_502(stage):
    async with pd_stack() as s:
        fake = s.prefill if stage == "prefill" else s.decode
        fake.knobs.fail_status = 500
        status, _, raw = await s.post("/v1/completions", {"prompt": "x", "stream": True})
        assert status == 502
        err = error_of(raw)
        assert f"{stage} backend {fake.url} returned 500" in err["message"]
        assert s.sample("pd_proxy_backend_errors_total", {"stage": stage, "backend": fake.url}) == 1
        assert (
            s.sample(
                "pd_proxy_requests_total",
                {"endpoint": "/v1/completions", "status": "502", "path": "pd"},
            )
            == 1
        )


async def test_prefill_answering_garbage_is_502():
    async with pd_stack() as s:
        s.prefill.knobs.fail_status = 200
        s.prefill.knobs.fail_body = b"<html>oops</html>"
        status, _, raw = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 502
        assert "invalid JSON" in error_of(raw)["message"]
        assert s.decode.seen == []


async def test_unreachable_prefill_is_502_then_503_while_marked_down():
    async with pd_stack(prefills=0, dead_prefills=1) as s:
        s.revive_dead()
        status, _, raw = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 502
        assert "unreachable" in error_of(raw)["message"]
        status, _, raw = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 503
        assert s.dead[0] in error_of(raw)["message"]
        status, raw = await s.get("/health")
        assert status == 503
        health = json.loads(raw)
        assert health["down"] == [s.dead[0]]
        assert "no healthy prefill backend" in health["error"]["message"]
        labels = {"role": "prefill", "backend": s.dead[0]}
        assert s.sample("pd_proxy_backend_healthy", labels) == 0


async def test_unreachable_decode_is_502():
    async with pd_stack(decodes=0, dead_decodes=1) as s:
        s.revive_dead()
        status, _, raw = await s.post("/v1/completions", {"prompt": "x", "stream": True})
        assert status == 502
        assert "decode backend" in error_of(raw)["message"]


async def test_slow_prefill_is_504():
    # The limit bounds the leg's connect too; 1 s, not less, so that a stalled (loaded) host
    # cannot end it there (a 502 "unreachable") before the request was sent.
    async with pd_stack(prefill_timeout=1.0) as s:
        s.prefill.knobs.delay = 30
        status, _, raw = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 504
        assert error_of(raw)["code"] == 504
        assert s.decode.seen == []


async def test_silent_decode_is_504_before_the_first_byte():
    async with pd_stack(decode_timeout=0.2) as s:
        s.decode.knobs.delay = 30
        status, _, raw = await s.post("/v1/completions", {"prompt": "x", "stream": True})
        assert status == 504
        assert "decode backend" in error_of(raw)["message"]


async def test_decode_dying_mid_stream_ends_with_an_error_event_and_a_clean_close():
    async with pd_stack() as s:
        s.decode.knobs.die_after = 3
        async with s.session.post(
            s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True}
        ) as r:
            assert r.status == 200
            raw = await r.read()  # raises ClientPayloadError unless the proxy closes cleanly
        events = sse_events(raw)
        assert [json.loads(e)["choices"][0]["text"] for e in events[:3]] == [" t0", " t1", " t2"]
        assert events[3] == '{"id":"broken'  # the half event, closed off by the proxy
        error = json.loads(events[4])["error"]
        assert error["code"] == 502 and "broke the stream" in error["message"]
        assert events[5] == "[DONE]" and len(events) == 6
        assert s.decode.cancelled == []  # the backend broke the stream; nobody cancelled it
        labels = {"stage": "decode", "backend": s.decode.url}
        assert s.sample("pd_proxy_backend_errors_total", labels) == 1


async def test_decode_going_silent_mid_stream_ends_with_a_504_event():
    # The first token must beat the limit (the fake's turn on this loop comes first): 1 s, so
    # that a stalled (loaded) host cannot fire it before " t0".
    async with pd_stack(decode_timeout=1.0) as s:
        s.decode.knobs.token_delay = 30
        async with s.session.post(
            s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}
        ) as r:
            raw = await r.read()
        events = sse_events(raw)
        assert json.loads(events[0])["choices"][0]["text"] == " t0"
        assert json.loads(events[1])["error"]["code"] == 504
        assert events[2] == "[DONE]"


async def test_unknown_routes_and_methods_get_json_errors():
    async with pd_stack() as s:
        status, raw = await s.get("/v2/nothing")
        assert status == 404 and error_of(raw)["code"] == 404
        status, raw = await s.get("/v1/completions")
        assert status == 405 and error_of(raw)["code"] == 405


async def test_models_with_no_healthy_decode_is_503():
    async with pd_stack(decodes=0, dead_decodes=1) as s:
        s.revive_dead()
        status, raw = await s.get("/v1/models")
        assert status == 502
        status, raw = await s.get("/v1/models")
        assert status == 503
        assert s.dead[0] in error_of(raw)["message"]


async def test_client_library_sees_no_payload_error_on_success():
    """Guards the happy path of the stream terminator (chunked EOF written exactly once)."""
    async with pd_stack() as s:
        async with s.session.post(
            s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        ) as r:
            try:
                await r.read()
            except aiohttp.ClientPayloadError as exc:  # pragma: no cover - the failure case
                pytest.fail(f"stream not terminated cleanly: {exc}")


async def test_an_internal_bug_still_answers_openai_json(monkeypatch):
    async with pd_stack() as s:

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr("pd_proxy.modes.normal.prefill_body", broken)
        status, headers, raw = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 500
        assert error_of(raw)["message"] == "internal proxy error"
        assert "boom" not in raw.decode()
        assert s.sample("pd_proxy_in_flight_requests") == 0
