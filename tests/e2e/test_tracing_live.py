"""One trace per request on the real CPU stack: pd-proxy, the prefill and the decode export to the
OTLP/HTTP receiver the e2e package runs (conftest ``otlp``; the shared stack's settings point every
server and the proxy at it, protocol http/protobuf), each vLLM server under its own service name.

- a P/D completion sent with a ``traceparent`` is one trace under it: pd-proxy's request span
  (its parent the client's span), the plan, the admission wait, both legs and the relay, and under
  each leg the server's own ``llm_request`` span (vllm-prefill-1, vllm-decode-1);
- a request only decode serves (``prompt_logprobs``) has a decode leg and decode's span, no
  prefill;
- a refused request is traced too: one admission refuses (its queue full) ends at the
  ``admission queue`` span naming the reason, with the 429 on the request span; a shape pd-proxy
  refuses is a request span with its 400.

Exporters send in batches (every ~5 s), so each check waits on the spans it needs, with a deadline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pcp_pd_kit.localstack.commands import proxy_spec
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.stack import Stack
from tests.support.otlp_receiver import Received, Receiver
from tests.support.otlp_thread import wait_for_spans

pytestmark = pytest.mark.e2e

PROXY = "pd-proxy"
PREFILL, DECODE = "vllm-prefill-1", "vllm-decode-1"
REFUSING_PROXY_PORT = 18543  # apart from the other e2e proxies (18540-18549)
SPANS_WITHIN_S = 60.0  # the exporters' batch delay (~5 s) on a loaded 2-core machine


@dataclasses.dataclass(frozen=True)
class Client:
    """A client's own span: the ``traceparent`` it sends."""

    trace_id: str
    span_id: str

    @classmethod
    def new(cls) -> Client:
        return cls(os.urandom(16).hex(), os.urandom(8).hex())

    @property
    def header(self) -> dict[str, str]:
        return {"traceparent": f"00-{self.trace_id}-{self.span_id}-01"}


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    return urllib.request.urlopen(request, timeout=120)


def status_of(url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    try:
        with post(url, body, headers) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def tree(spans: list[Received]) -> str:
    """The trace as indented lines, parents first: ``name [service] {attributes}``."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[Received]] = {}
    for span in spans:
        children.setdefault(span.parent_id if span.parent_id in ids else "", []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            lines.append(f"{'  ' * depth}{span.name} [{span.service}] {span.attributes}")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def one(spans: list[Received], service: str, name: str) -> Received:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{len(found)} {name!r} spans of {service}:\n{tree(spans)}"
    return found[0]


def services(spans: list[Received]) -> set[str]:
    return {s.service for s in spans}


def test_a_pd_completion_is_one_trace_through_proxy_prefill_and_decode(
    pd_stack: Stack, otlp: Receiver
) -> None:
    client = Client.new()
    body = {
        "model": pd_stack.served_model_name,
        "prompt": f"Trace {client.trace_id}: the farmer sold seven eggs at the market",
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": True,
    }
    with post(pd_stack.urls["proxy"], body, {**pd_stack.proxy_headers, **client.header}) as r:
        assert r.status == 200
        assert b"[DONE]" in r.read()

    def complete(spans: list[Received]) -> bool:
        mine = [s for s in spans if s.trace_id == client.trace_id]
        names = {(s.service, s.name) for s in mine}
        return {(PREFILL, "llm_request"), (DECODE, "llm_request"), (PROXY, "relay")} <= names

    spans = [
        s for s in wait_for_spans(otlp, complete, SPANS_WITHIN_S) if s.trace_id == client.trace_id
    ]
    shown = tree(spans)
    print(f"\nthe P/D trace as received:\n{shown}")
    assert services(spans) == {PROXY, PREFILL, DECODE}, shown
    request = one(spans, PROXY, "POST /v1/completions")
    assert request.parent_id == client.span_id, shown  # the client's traceparent continued
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["pd.path"] == "pd"
    for name in ("plan", "admission queue", "prefill leg", "decode leg", "relay"):
        assert one(spans, PROXY, name).parent_id == request.span_id, shown
    assert one(spans, PROXY, "plan").attributes["pd.route.path"] == "pd"
    assert one(spans, PROXY, "admission queue").attributes["pd.admission"] == "admitted"
    prefill_leg, decode_leg = one(spans, PROXY, "prefill leg"), one(spans, PROXY, "decode leg")
    assert prefill_leg.attributes["server.address"] == pd_stack.urls["prefill"]
    assert decode_leg.attributes["server.address"] == pd_stack.urls["decode"]
    assert decode_leg.attributes.get("pd.kv.remote_request_id"), shown
    # Each leg's span is the parent of the server's own span: which replica did what.
    on_prefill, on_decode = one(spans, PREFILL, "llm_request"), one(spans, DECODE, "llm_request")
    assert on_prefill.parent_id == prefill_leg.span_id, shown
    assert on_decode.parent_id == decode_leg.span_id, shown
    assert on_prefill.attributes["gen_ai.usage.prompt_tokens"] > 8
    assert on_decode.attributes["gen_ai.usage.completion_tokens"] >= 1


def test_a_request_decode_alone_serves_is_traced_without_a_prefill(
    pd_stack: Stack, otlp: Receiver
) -> None:
    client = Client.new()
    body = {
        "model": pd_stack.served_model_name,
        "prompt": f"Trace {client.trace_id}: one two three",
        "max_tokens": 2,
        "temperature": 0.0,
        "prompt_logprobs": 1,  # a shape only decode serves (routing/shapes.yaml)
    }
    headers = {**pd_stack.proxy_headers, **client.header}
    assert status_of(pd_stack.urls["proxy"], body, headers) == 200

    def complete(spans: list[Received]) -> bool:
        mine = {(s.service, s.name) for s in spans if s.trace_id == client.trace_id}
        return {(DECODE, "llm_request"), (PROXY, "POST /v1/completions")} <= mine

    spans = [
        s for s in wait_for_spans(otlp, complete, SPANS_WITHIN_S) if s.trace_id == client.trace_id
    ]
    shown = tree(spans)
    assert services(spans) == {PROXY, DECODE}, shown
    request = one(spans, PROXY, "POST /v1/completions")
    assert (request.parent_id, request.attributes["pd.path"]) == (client.span_id, "local")
    assert not [s for s in spans if s.name == "prefill leg"], shown
    assert one(spans, DECODE, "llm_request").parent_id == one(spans, PROXY, "decode leg").span_id


@pytest.fixture
def refusing_proxy(pd_stack: Stack) -> Iterator[str]:
    """pd-proxy in front of the shared pair with room for one request on decode and no queue:
    while one request streams, the next is refused at once (429, queue_full)."""
    settings = dataclasses.replace(
        pd_stack.settings,
        proxy_port=REFUSING_PROXY_PORT,
        admission=True,
        decode_max_inflight=1,
        queue_size=0,
    )
    proc = ManagedProcess(
        dataclasses.replace(proxy_spec(settings), name="proxy-refusing"), pd_stack.log_dir
    )
    proc.start()
    try:
        wait_healthy([proc], pd_stack.settings.startup_timeout_s)
        yield settings.url(REFUSING_PROXY_PORT)
    finally:
        proc.stop()


def test_refused_requests_are_traced(pd_stack: Stack, otlp: Receiver, refusing_proxy: str) -> None:
    model = pd_stack.served_model_name
    held = {
        "model": model,
        "prompt": "Hold decode's only place: count the apples in the basket",
        # Long enough to outlast the next request on any host: 200 tokens took 150 ms on a fast
        # one, and the stream had ended before the short request arrived (200, not 429).
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    refused, shape = Client.new(), Client.new()
    with post(refusing_proxy, held, pd_stack.proxy_headers) as stream:
        assert stream.readline().startswith(b"data:")  # admitted and streaming: decode is full
        short = {"model": model, "prompt": "Hi", "max_tokens": 2}
        headers = {**pd_stack.proxy_headers, **refused.header}
        assert status_of(refusing_proxy, short, headers) == 429
    # A shape pd-proxy refuses before any backend (a client's own kv_transfer_params).
    bad = {
        "model": model,
        "prompt": "Hi",
        "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    headers = {**pd_stack.proxy_headers, **shape.header}
    assert status_of(pd_stack.urls["proxy"], bad, headers) == 400

    def complete(spans: list[Received]) -> bool:
        ended = {s.trace_id for s in spans if s.name == "POST /v1/completions"}
        return {refused.trace_id, shape.trace_id} <= ended

    spans = wait_for_spans(otlp, complete, SPANS_WITHIN_S)
    by_queue = [s for s in spans if s.trace_id == refused.trace_id]
    shown = tree(by_queue)
    assert services(by_queue) == {PROXY}, shown  # no leg, no server
    request = one(by_queue, PROXY, "POST /v1/completions")
    assert request.parent_id == refused.span_id
    assert request.attributes["http.response.status_code"] == 429, shown
    queue = one(by_queue, PROXY, "admission queue")
    assert (queue.parent_id, queue.attributes["pd.admission"]) == (request.span_id, "queue_full")
    by_shape = [s for s in spans if s.trace_id == shape.trace_id]
    assert [(s.name, s.attributes["http.response.status_code"]) for s in by_shape] == [
        ("POST /v1/completions", 400)
    ], tree(by_shape)
