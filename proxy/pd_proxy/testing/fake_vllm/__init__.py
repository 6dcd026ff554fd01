"""A fake vLLM OpenAI server that enforces the NIXL P/D ``kv_transfer_params`` protocol.

Used by the proxy tests, the benchmark and the GSM8K eval tests, so that they run the proxy against
vLLM's HTTP behaviour without a GPU; this module holds the server, its knobs and what it recorded.
A ``prefill`` fake rejects requests that do not ask for a remote decode (or that stream, or
generate more than one token) and returns signed ``kv_transfer_params``; a ``decode`` fake rejects
requests whose params were not signed by a prefill fake for the same ``X-Request-Id`` (nor, with
``prefill_engine_id``, by that engine). Knobs (mutable at run time through ``fake.knobs``) add
delay, per-token delay, failures, a stream that dies mid-way, a prefill serving requests without
``kv_transfer_params`` in full (``plain_requests``, as vLLM does) and a decode answering wrong text
with HTTP 200 (``corrupt``). With ``api_key`` set it guards ``/v1/*`` like ``vllm serve --api-key``
(401 ``{"error": "Unauthorized"}``); with ``record`` every ``/v1`` request, rejected ones included,
lands in ``received``.

With ``answers`` (``--gsm8k-data DIR``, DIR/test.jsonl) it plays the server an eval harness
drives: it rejects a request for another model or with more than one prompt, and a decode (or
plain) fake answers the prompt's last ``Question: ...`` with ``#### <number>``, right or wrong by
``knobs.gsm8k_mode`` (``POST /fake/mode {"mode": ...}`` switches it). ``/version`` and a
vLLM-looking ``/metrics`` give the eval's topology probe something real to read. Run standalone
with ``python -m pd_proxy.testing.fake_vllm --role decode --port 0`` (``__main__``).

What it generates, and the checks it applies, are ``fake_model``'s pure functions. It adds
``return_token_ids``, ``stream_options`` (``include_usage``, ``continuous_usage_stats``) and a
chat stream's first role-only chunk. A prefill answers ``remote_block_ids`` per KV group and
``remote_num_tokens`` for ``knobs.block_size`` (also its ``/metrics``
``vllm:cache_config_info``), and a decode enforces vLLM's NIXL invariant that its prompt fits the
blocks it pulls: where vLLM's engine would die on an assertion, it answers 500 and counts
``crashes``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from pd_proxy.testing.fake_model import (
    DECODE,
    DEFAULT_SECRET,
    GEN_BASE,
    GSM8K_MODES,
    PLAIN,
    PREFILL,
    UNKNOWN_ANSWER,
    VERSION,
    Answer,
    Answers,
    Generation,
    authorized,
    block_mismatch,
    completion_body,
    completion_limit,
    decode_problem,
    eval_problem,
    generate,
    gsm8k_reply,
    json_copy,
    metrics_text,
    prefill_problem,
    prompt_ids_of,
    prompt_text,
    render_chat,
    sign,
    tokenize,
)


@dataclass
class Knobs:
    """Behaviour that tests flip while the server runs."""

    delay: float = 0.0  # seconds before a completion answers (decode: before headers)
    token_delay: float = 0.0  # seconds between streamed tokens
    tokens: int = 16  # tokens generated when the request has no max_tokens
    fail_status: int | None = None  # answer completions with this status ...
    fail_times: int | None = None  # ... for this many requests (None: until cleared)
    fail_body: bytes | None = None  # body for fail_status (default: an OpenAI error)
    die_after: int | None = None  # streaming decode: drop the connection after N tokens
    healthy: bool = True  # GET /health answers 200 or 503
    gsm8k_mode: str = "mixed"  # with answers: correct | wrong | mixed (see is_right)
    eos_at: int | None = None  # generated token k = eos_at is EOS (min_tokens, ignore_eos apply)
    block_size: int = 128  # KV block size: prefill's remote_block_ids, decode's check, /metrics
    max_model_len: int | None = None  # chat without a limit: generate up to this (None: tokens)
    metrics: bool = True  # serve /metrics (False: 404, as a server without Prometheus metrics)
    # prefill or decode: serve a request without kv_transfer_params in full, as vLLM's
    # kv_producer (the canary's reference) and kv_consumer (decode alone) do; off, such a
    # request is rejected as a broken leg.
    plain_requests: bool = False
    tokenize_down: bool = False  # POST /tokenize answers 500
    tokenize_delay: float = 0.0  # seconds before POST /tokenize answers
    # decode: answer with other text than the model's (as from another request's KV), still 200.
    corrupt: bool = False
    # close this many completion requests that arrive on a reused keep-alive connection, unread
    # and unanswered, as a server whose idle timeout crossed the request does
    close_reused: int = 0


@dataclass
class Seen:
    """One completion request as the backend received it."""

    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]


@dataclass
class FakeVLLM:
    role: str = PLAIN
    model: str = "fake-model"
    secret: bytes = DEFAULT_SECRET
    record: bool = True
    knobs: Knobs = field(default_factory=Knobs)
    seen: list[Seen] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # request ids cut short by the caller
    issued: dict[str, dict[str, Any]] = field(default_factory=dict)  # prefill: rid -> kv params
    sent: dict[str, bytes] = field(default_factory=dict)  # rid -> response body bytes (record)
    completed: int = 0
    rejected: int = 0  # answered 400: bad JSON or a broken protocol
    closed_reused: int = 0  # requests dropped by knobs.close_reused
    _connections: set[int] = field(default_factory=set)  # ids of the transports seen
    tokenize_requests: int = 0  # POST /tokenize
    unknown_questions: int = 0  # completed, but the question was not in ``answers``
    crashes: int = 0  # decode requests a real vLLM engine would have died on (block mismatch)
    metrics_reads: int = 0  # GET /metrics answered
    engine_id: str = ""
    prefill_engine_id: str | None = None  # decode: accept only this prefill's handles
    answers: Answers | None = None  # answer GSM8K questions (see load_answers)
    api_key: str | None = None  # like vLLM's --api-key: /v1/* needs "Authorization: Bearer" it
    # Every /v1 request as it arrived, before the key check: (method, path, headers).
    received: list[tuple[str, str, CIMultiDict[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.role not in (PREFILL, DECODE, PLAIN):
            raise ValueError(f"role must be prefill, decode or plain, not {self.role!r}")
        self._blocks = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._changed: asyncio.Event | None = None
        self.url = ""
        if not self.engine_id:
            self.engine_id = f"fake-{self.role}-{id(self):x}"

    # ------------------------------------------------------------------ lifecycle
    def build_app(self) -> web.Application:
        middlewares = [self._guard] if self.record or self.api_key is not None else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/fake/mode", self._set_mode)
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0 = ephemeral) and return the base URL."""
        self._runner = web.AppRunner(
            self.build_app(), access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=2048)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_for(self, predicate, timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; a safety net, not a timing assertion."""

        async def poll() -> None:
            while not predicate():
                await self._event().wait()
                self._event().clear()

        await asyncio.wait_for(poll(), timeout)

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # ------------------------------------------------------------------ protocol
    def sign(self, params: dict[str, Any]) -> str:
        return sign(self.secret, params)

    def _check(self, body: dict[str, Any], rid: str) -> str | None:
        """Why the request breaks the P/D protocol for this role (or, answering, is not what an
        eval harness sends), or None."""
        kv = body.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else {}
        if self.answers is not None and (problem := eval_problem(body, self.model)):
            return problem
        if self.role == PREFILL and not self._plain(body):
            return prefill_problem(body, kv)
        if self.role == DECODE and not self._plain(body):
            if body.get("prompt_logprobs") is not None:
                return "decode reading remote KV computes no prompt logprobs (vLLM hangs)"
            return decode_problem(kv, rid, self.secret, self.prefill_engine_id)
        return None

    def _plain(self, body: dict[str, Any]) -> bool:
        """A request without kv_transfer_params served in full (knobs.plain_requests)."""
        return self.knobs.plain_requests and body.get("kv_transfer_params") is None

    def _prefill_params(self, rid: str, prompt_len: int) -> dict[str, Any]:
        """The KV handles of a prefilled prompt: its blocks (one KV cache group), as vLLM 0.32."""
        count = max(1, -(-prompt_len // self.knobs.block_size))
        first = next(self._blocks)
        for _ in range(count - 1):
            next(self._blocks)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(first, first + count))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": prompt_len,
        }
        params["fake_signature"] = self.sign(params)
        return params

    def _generate(self, body: dict[str, Any], prompt_ids: list[int], chat: bool) -> Generation:
        """The fake model: a GSM8K answer when answering (a prefill's one token is thrown away,
        so it never answers), else numbered tokens, continuing the prompt's own, up to a stop."""
        if self.answers is not None and self.role != PREFILL:
            text = gsm8k_reply(self.answers, self.knobs.gsm8k_mode, prompt_text(body) or "")
            if text is None:
                self.unknown_questions += 1
                text = UNKNOWN_ANSWER
            return Generation([GEN_BASE], [text], "stop")
        knobs = self.knobs
        if self.role == PREFILL and not self._plain(body):
            limit = 1
        else:
            limit = completion_limit(body, chat, len(prompt_ids), knobs.tokens, knobs.max_model_len)
        corrupt = knobs.corrupt and self.role == DECODE
        return generate(body, prompt_ids, limit, knobs.eos_at, corrupt)

    # ------------------------------------------------------------------ handlers
    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith("/v1"):
            return await handler(request)
        if self.record:
            self.received.append((request.method, request.path, CIMultiDict(request.headers)))
            self._notify()
        if self.api_key is not None and not authorized(self.api_key, request.headers):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.knobs.healthy else 503)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.knobs.metrics:
            return web.Response(status=404)
        self.metrics_reads += 1
        ok = self.completed - self.unknown_questions
        text = metrics_text(
            self.role, ok, self.rejected, self.unknown_questions, self.knobs.block_size
        )
        return web.Response(text=text)

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "root": self.model, "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a prompt, or chat messages through the (fake) chat template."""
        self.tokenize_requests += 1
        if self.knobs.tokenize_delay:
            await asyncio.sleep(self.knobs.tokenize_delay)
        if self.knobs.tokenize_down:
            return self._error(500, "tokenize is down")
        try:
            body = json.loads(await request.read())
        except ValueError:
            return self._reject("invalid JSON")
        if isinstance(body.get("messages"), list):
            ids = tokenize(render_chat(body))
        elif isinstance(body.get("prompt"), str):
            ids = tokenize(body["prompt"])
        else:
            return self._reject("prompt or messages required")
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def _set_mode(self, request: web.Request) -> web.Response:
        """Switch the GSM8K answers between eval runs without restarting the server."""
        try:
            mode = (await request.json()).get("mode")
        except (ValueError, AttributeError):
            mode = None
        if mode not in GSM8K_MODES:
            return self._error(400, f"mode must be one of {', '.join(GSM8K_MODES)}")
        self.knobs.gsm8k_mode = mode
        return web.json_response({"mode": mode})

    def _reused(self, request: web.Request) -> bool:
        """Whether an earlier completion request came on the same connection."""
        key = id(request.transport)
        seen = key in self._connections
        self._connections.add(key)
        return seen

    def _error(self, status: int, message: str) -> web.Response:
        body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
        return web.json_response(body, status=status)

    def _reject(self, message: str) -> web.Response:
        self.rejected += 1
        return self._error(400, message)

    def _injected_failure(self) -> web.Response | None:
        """The answer ``knobs.fail_*`` asks for, counting down ``fail_times``; None: no failure."""
        knobs = self.knobs
        if knobs.fail_status is None or knobs.fail_times == 0:
            return None
        if knobs.fail_times is not None:
            knobs.fail_times -= 1
        if knobs.fail_body is None:
            return self._error(knobs.fail_status, f"injected failure {knobs.fail_status}")
        return web.Response(
            status=knobs.fail_status, body=knobs.fail_body, content_type="application/json"
        )

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        if self._reused(request) and self.knobs.close_reused:
            self.knobs.close_reused -= 1
            self.closed_reused += 1
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # nothing is answered on an aborted connection
        try:
            return await self._serve_completion(request, rid)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(rid)
            self._notify()
            raise

    async def _serve_completion(self, request: web.Request, rid: str) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return self._reject("invalid JSON")
        if self.record:
            self.seen.append(Seen(request.path, CIMultiDict(request.headers), json_copy(body)))
            self._notify()
        if self.knobs.delay:
            await asyncio.sleep(self.knobs.delay)
        failure = self._injected_failure()
        if failure is not None:
            return failure
        n, temperature = body.get("n"), body.get("temperature")
        if isinstance(n, int) and n > 1 and temperature == 0:  # vLLM's own validation
            return self._error(400, f"n must be 1 when using greedy sampling, got {n}.")
        problem = self._check(body, rid)
        if problem:
            return self._reject(problem)
        chat = request.path.endswith("/chat/completions")
        try:
            prompt_ids = prompt_ids_of(body, chat)
        except ValueError as exc:
            return self._reject(str(exc))
        crash = None
        if self.role == DECODE:
            crash = block_mismatch(body, len(prompt_ids), self.knobs.block_size)
        if crash is not None:
            self.crashes += 1
            self._notify()
            return self._error(500, f"EngineCore died: {crash}")
        if self.knobs.max_model_len is not None and len(prompt_ids) >= self.knobs.max_model_len:
            return self._reject(f"prompt of {len(prompt_ids)} tokens leaves no room")
        gen = self._generate(body, prompt_ids, chat)
        full = self.role != PREFILL or self._plain(body)
        kv = None if full else self._prefill_params(rid, len(prompt_ids))
        if kv is not None and self.record:
            self.issued[rid] = kv
        answer = Answer(rid, chat, body, prompt_ids, gen)
        if body.get("stream"):
            resp = await self._stream(request, answer)
        else:
            resp = self._json(answer, kv)
        self.completed += 1
        self._notify()
        return resp

    def _json(self, a: Answer, kv: dict[str, Any] | None) -> web.Response:
        payload = json.dumps(completion_body(a, kv, self.model)).encode()
        if self.record:
            self.sent[a.rid] = payload
        return web.Response(body=payload, content_type="application/json")

    async def _stream(self, request: web.Request, a: Answer) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if a.chat else "text_completion"
        head = (
            f'data: {{"id":"{"chatcmpl-" if a.chat else "cmpl-"}{a.rid}","object":"{kind}",'
            f'"created":{int(time.time())},"model":"{self.model}","choices":['
        )
        options = a.body.get("stream_options") or {}
        usage = bool(options.get("include_usage"))
        continuous = usage and bool(options.get("continuous_usage_stats"))
        knobs = self.knobs
        sent: list[bytes] | None = [] if self.record else None

        def event(choice: str, completion_tokens: int | None) -> bytes:
            tail = ""
            if completion_tokens is not None:
                tail = ',"usage":' + json.dumps(a.usage(completion_tokens))
            return f"{head}{choice}]{tail}}}\n\n".encode()

        async def send(data: bytes) -> None:
            await resp.write(data)
            if sent is not None:
                sent.append(data)

        if a.chat:  # vLLM's first chat chunk: the role alone
            role = '{"index":0,"delta":{"role":"assistant","content":""}}'
            await send(event(role, 0 if continuous else None))
        pieces = a.gen.pieces
        key = '{"index":0,"delta":{"content":' if a.chat else '{"index":0,"text":'
        close = "}," if a.chat else ","
        for i, piece in enumerate(pieces):
            if knobs.die_after is not None and i == knobs.die_after:
                # Half an event, then the connection drops without the closing chunk.
                await resp.write(b'data: {"id":"broken')
                if sent is not None:
                    self.sent[a.rid] = b"".join(sent) + b'data: {"id":"broken'
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == len(pieces) - 1:
                end = f'"finish_reason":"{a.gen.finish}","stop_reason":'
                end += json.dumps(a.gen.stop_reason) + "}"
            else:
                end = '"finish_reason":null}'
            choice = f"{key}{json.dumps(piece)}{close}{end}"
            await send(event(choice, i + 1 if continuous else None))
            if knobs.token_delay:
                await asyncio.sleep(knobs.token_delay)
        if usage:
            await send(event("", len(pieces)))
        await send(b"data: [DONE]\n\n")
        if sent is not None:
            self.sent[a.rid] = b"".join(sent)
        await resp.write_eof()
        return resp
