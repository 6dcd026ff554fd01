"""pd-proxy's traces: settings from the standard OTEL_* variables, and one trace per request
through the real proxy, exported over OTLP/HTTP to a receiver in the test."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from pd_proxy.backends.route import PD, Route
from pd_proxy.protocol.endpoints import COMPLETIONS
from pd_proxy.tracing import TracingError, TracingSettings, route_attributes, settings_from
from tests.proxy.proxy_harness import pd_stack
from tests.support.otlp_receiver import otlp_receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ("http://c:4317", "grpc")),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            ("http://c:4318/v1/traces", "http/protobuf"),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            ("http://c:4318/v1/traces", "http/protobuf"),
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"},
            None,
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"},
            None,
        ),
    ],
)
def test_settings_follow_the_standard_variables(env, want) -> None:
    got = settings_from(env)
    assert (None if got is None else (got.endpoint, got.protocol)) == want


def test_an_unknown_protocol_is_named() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
    }
    with pytest.raises(TracingError, match="http/json"):
        settings_from(env)


def test_route_attributes_say_what_was_decided() -> None:
    route = Route(PD, "long", prompt_tokens=4, decode_hit=2, prefill_hit=1)
    attrs = route_attributes(route)
    assert attrs["pd.route.path"] == "pd" and attrs["pd.route.reason"] == "long"
    assert attrs["pd.route.prompt_tokens"] == 4 and attrs["pd.route.uncached_tokens"] == 3
    assert "pd.route.prefill" not in attrs  # the pool chose: nothing decided ahead


async def traced_stack(monkeypatch, receiver, **options):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pd-proxy-test")
    return pd_stack(**options)


async def flush(stack) -> None:
    """Export what the batch holds, off the loop (the receiver answers on this loop)."""
    tracing = stack.running.pipeline.tracing
    assert tracing is not None
    await asyncio.to_thread(tracing.provider.force_flush)


async def test_a_p_d_request_is_one_trace_and_each_leg_carries_its_span(monkeypatch) -> None:
    async with otlp_receiver() as receiver:
        async with await traced_stack(monkeypatch, receiver) as s:
            status, _, raw = await s.post(
                COMPLETIONS,
                {"prompt": "a b c", "max_tokens": 3, "stream": True},
                {"traceparent": TRACEPARENT},
            )
            assert status == 200, raw
            await flush(s)
            sent_prefill = s.prefill.seen[-1].headers["traceparent"]
            sent_decode = s.decode.seen[-1].headers["traceparent"]
        spans = {x.name: x for x in receiver.trace(TRACE_ID)}
    request = spans["POST /v1/completions"]
    assert request.parent_id == CLIENT_SPAN and request.service == "pd-proxy-test"
    assert request.attributes["http.response.status_code"] == 200
    for name in ("plan", "admission queue", "prefill leg", "decode leg", "relay"):
        assert name in spans, sorted(spans)
    assert spans["prefill leg"].parent_id == request.span_id
    assert spans["decode leg"].attributes["pd.kv.remote_request_id"]
    # vLLM parents its own span on what each leg sent: that leg's span.
    assert sent_prefill == f"00-{TRACE_ID}-{spans['prefill leg'].span_id}-01"
    assert sent_decode == f"00-{TRACE_ID}-{spans['decode leg'].span_id}-01"
    assert spans["plan"].attributes["pd.route.path"] == "pd"


async def test_a_refused_request_and_a_local_one_are_traced(monkeypatch, tmp_path: Path) -> None:
    async with otlp_receiver() as receiver:
        async with await traced_stack(monkeypatch, receiver) as s:
            s.proxy.prefill_pool.backends[0].healthy = False  # admission: 503 for P/D
            status, _, _ = await s.post(
                COMPLETIONS, {"prompt": "a b", "max_tokens": 2}, {"traceparent": TRACEPARENT}
            )
            assert status == 503
            other = "11111111111111111111111111111111"
            s.proxy.prefill_pool.backends[0].healthy = True
            s.decode.knobs.plain_requests = True
            status, _, raw = await s.post(  # prompt_logprobs: a shape only decode alone serves
                COMPLETIONS,
                {"prompt": "a b", "max_tokens": 2, "prompt_logprobs": 1},
                {"traceparent": f"00-{other}-{CLIENT_SPAN}-01"},
            )
            assert status == 200, raw
            await flush(s)
        refused = {x.name: x for x in receiver.trace(TRACE_ID)}
        local = {x.name: x for x in receiver.trace(other)}
    assert refused["POST /v1/completions"].attributes["http.response.status_code"] == 503
    assert refused["admission queue"].attributes["pd.admission"] == "no_backend"
    assert "prefill leg" not in refused
    assert local["POST /v1/completions"].attributes["pd.path"] == "local"
    assert "decode leg" in local and "prefill leg" not in local


async def test_without_an_endpoint_there_is_no_tracer(monkeypatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    async with pd_stack() as s:
        assert s.running.pipeline.tracing is None
        status, _, _ = await s.post(COMPLETIONS, {"prompt": "a", "max_tokens": 1})
        assert status == 200 and "traceparent" not in s.prefill.seen[-1].headers


def test_settings_value_is_frozen() -> None:
    settings = TracingSettings("e", "grpc")
    assert hash(settings) == hash(TracingSettings("e", "grpc"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.endpoint = "other"
