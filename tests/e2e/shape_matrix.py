"""The request-shape matrix of pd_proxy/routing/shapes.yaml as live requests: each row's example on
each
of its endpoints, streamed and not, and the answer reduced to what must equal a single
instance's (status, each choice's text and finish reason, usage)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from pd_proxy.protocol.endpoints import COMPLETIONS
from pd_proxy.routing.shapes import FANOUT, LOCAL, PD, REFUSE, TABLE, Shape, fanout_size

PROMPT = "James has 3 apples and buys 5 more. How many"
MESSAGES = [{"role": "user", "content": "Mary has 12 cookies and gives half away. How many left?"}]
MAX_TOKENS = 12
# Shapes vLLM itself answers with a 400 (the tiny model is text only; greedy n > 1).
VLLM_REFUSES = ("multimodal_content", "greedy_n")


@dataclass(frozen=True)
class MatrixCase:
    shape: Shape
    endpoint: str
    stream: bool

    @property
    def name(self) -> str:
        kind = "stream" if self.stream else "json"
        return f"{self.shape.name}-{'chat' if 'chat' in self.endpoint else 'completions'}-{kind}"

    def body(self, model: str) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        if self.endpoint == COMPLETIONS:
            base["prompt"] = PROMPT
        else:
            base["messages"] = MESSAGES
        if self.stream:
            base["stream"] = True
        return {**base, **self.shape.example}  # an example's own stream wins

    @property
    def prefill_legs(self) -> int:
        """How many requests the prefill should hold (and free) for this case."""
        if self.shape.route in (REFUSE, LOCAL) or self.shape.name in VLLM_REFUSES:
            return 0  # vLLM's prefill refuses them before allocating KV
        if self.shape.route == FANOUT:
            return fanout_size(self.body("m"), self.endpoint)
        assert self.shape.route == PD
        return 1


def cases() -> list[MatrixCase]:
    return [
        MatrixCase(row, endpoint, stream)
        for row in TABLE.shapes
        for endpoint in row.endpoints
        for stream in (False, True)
        # vLLM answers streamed beam search with its own 400 on any server
        if not (stream and row.name == "beam_search")
    ]


@dataclass(frozen=True)
class Reply:
    status: int
    choices: dict[int, tuple[str, str | None]]  # index -> (text, finish_reason)
    usage: dict[str, int] | None
    error_param: str | None = None


def send(base_url: str, endpoint: str, body: dict[str, Any], timeout_s: float = 120.0) -> Reply:
    request = urllib.request.Request(
        f"{base_url}{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read() or b"{}").get("error")
        param = error.get("param") if isinstance(error, dict) else None
        return Reply(exc.code, {}, None, param)
    return parse(endpoint, raw, bool(body.get("stream")), status)


def parse(endpoint: str, raw: bytes, stream: bool, status: int = 200) -> Reply:
    chat = endpoint != COMPLETIONS
    if not stream:
        answer = json.loads(raw)
        choices = {
            c["index"]: (c["message"]["content"] if chat else c["text"], c["finish_reason"])
            for c in answer["choices"]
        }
        return Reply(status, choices, answer.get("usage"))
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    if events[-1:] != ["[DONE]"] or events.count("[DONE]") != 1:
        raise AssertionError(f"stream does not end with one [DONE]: {events[-3:]}")
    for event in events[:-1]:
        obj = json.loads(event)
        if "error" in obj:
            raise AssertionError(f"error event: {obj}")
        if not obj["choices"] and obj.get("usage"):
            usage = obj["usage"]
        for c in obj["choices"]:
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return Reply(status, {i: (t, finish.get(i)) for i, t in texts.items()}, usage)


def reference_replies(base_url: str, model: str) -> dict[str, Reply]:
    """A single instance's reply to every case the proxy does not refuse."""
    return {
        case.name: send(base_url, case.endpoint, case.body(model))
        for case in cases()
        if case.shape.route != REFUSE
    }
