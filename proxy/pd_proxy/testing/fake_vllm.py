"""A fake vLLM OpenAI server that enforces the NIXL P/D ``kv_transfer_params`` protocol.

Used by the proxy tests, the benchmark and the GSM8K eval tests. A ``prefill`` fake rejects
requests that do not ask for a remote decode (or that stream, or generate more than one token) and
returns signed ``kv_transfer_params``; a ``decode`` fake rejects requests whose params were not
signed by a prefill fake for the same ``X-Request-Id`` (nor, with ``prefill_engine_id``, by that
engine). Knobs (mutable at run time through ``fake.knobs``) add delay, per-token delay, failures,
a stream that dies mid-way, a prefill serving requests without ``kv_transfer_params`` in full
(``plain_requests``, as vLLM does) and a decode answering wrong text with HTTP 200 (``corrupt``).
With ``api_key`` set it guards ``/v1/*`` like ``vllm serve --api-key`` (401 ``{"error":
"Unauthorized"}``); with ``record`` every ``/v1`` request, rejected ones included, lands in
``received``.

With ``answers`` (``--gsm8k-data DIR``, DIR/test.jsonl) it plays the server an eval harness
drives: it rejects a request for another model or with more than one prompt, and a decode (or
plain) fake answers the prompt's last ``Question: ...`` with ``#### <number>``, right or wrong by
``knobs.gsm8k_mode`` (``POST /fake/mode {"mode": ...}`` switches it). ``/version`` and a
vLLM-looking ``/metrics`` give the eval's topology probe something real to read. Run standalone
with ``python -m pd_proxy.testing.fake_vllm --role decode --port 0``.

Its "model" is deterministic in the token context, so a continuation is exact the way vLLM's is:
prompts are tokenized (``tokenize``; chat messages through a small template), generated token
``k`` has id ``GEN_BASE + k`` and text `` t{k}``, and a prompt that ends in generated tokens
(prompt + token 1, as a first-token-from-prefill decode gets it) continues from the next ``k``.
``knobs.eos_at`` makes token ``k`` EOS. It honours ``stop`` (strings), ``stop_token_ids``,
``min_tokens``, ``ignore_eos``, ``max_tokens`` / ``max_completion_tokens`` (chat without either:
``knobs.max_model_len`` minus the prompt, when set), ``return_token_ids``, ``stream_options``
(``include_usage``, ``continuous_usage_stats``), a chat stream's first role-only chunk, and
vLLM 0.32's decode-side token reuse (``kv_transfer_params.prompt_token_ids`` on chat). A prefill
answers ``remote_block_ids`` per KV group and ``remote_num_tokens`` for ``knobs.block_size``
(also its ``/metrics`` ``vllm:cache_config_info``), and a decode enforces vLLM's NIXL invariant
that its prompt fits the blocks it pulls: where vLLM's engine would die on an assertion, it
answers 500 and counts ``crashes``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import itertools
import json
import re
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

DEFAULT_SECRET = b"pd-proxy-fake-vllm"
PREFILL, DECODE, PLAIN = "prefill", "decode", "plain"
VERSION = "0.32.0-fake"
PROMPT_TOKENS = 4  # prompt tokens per request in the /metrics counters
BOS_ID, EOS_ID = 1, 2
GEN_BASE = 100_000  # generated token k has id GEN_BASE + k
VOCAB = 200_000
GSM8K_MODES = ("correct", "wrong", "mixed")
UNKNOWN_ANSWER = " I do not know."
_QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.S)

Answers = dict[str, tuple[str, int]]  # GSM8K question -> (final answer, row index)


# ---------------------------------------------------------------------- GSM8K answers (pure)
def load_answers(data_dir: Path) -> Answers:
    """Every test question with the number after its answer's ``#### `` and its row index (the
    index decides which rows ``mixed`` gets right)."""
    answers = {}
    lines = (data_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        row = json.loads(line)
        answers[row["question"].strip()] = (row["answer"].rsplit("#### ", 1)[-1].strip(), index)
    return answers


def is_right(mode: str, index: int) -> bool:
    """correct: always; wrong: never; mixed: 13 of every 20 rows (0.65, the reference score)."""
    return mode == "correct" or (mode == "mixed" and index % 20 < 13)


def wrong(answer: str) -> str:
    """A number strict-match cannot mistake for ``answer``."""
    try:
        return str(int(answer.replace(",", "")) + 7)
    except ValueError:
        return "-1"


def gsm8k_reply(answers: Answers, mode: str, prompt: str) -> str | None:
    """The completion for a few-shot prompt: its last question is the one asked (the others are
    the shots). None when that question is not in the data."""
    questions = _QUESTION.findall(prompt)
    found = answers.get(questions[-1].strip()) if questions else None
    if found is None:
        return None
    answer, index = found
    final = answer if is_right(mode, index) else wrong(answer)
    return f" Let me think step by step.\n#### {final}\n\n"


def prompt_text(body: dict[str, Any]) -> str | None:
    """The request's one text prompt (a chat's messages joined), or None for a batch or token ids:
    one answer cannot serve several questions."""
    messages = body.get("messages")
    if isinstance(messages, list):
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        return "\n".join(c for c in contents if isinstance(c, str))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def tokenize(text: str) -> list[int]:
    """The fake tokenizer: BOS, then one id per whitespace-separated word (below GEN_BASE)."""
    return [BOS_ID, *(1000 + zlib.crc32(w.encode()) % 90_000 for w in text.split())]


def render_chat(body: dict[str, Any]) -> str:
    """The fake chat template."""
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        role = message.get("role") if isinstance(message, dict) else None
        parts.append(f"<|{role}|> {content or ''}\n")
    if body.get("add_generation_prompt", True):
        parts.append("<|assistant|>")
    return "".join(parts)


def token_text(token_id: int) -> str:
    return f" t{token_id - GEN_BASE}" if token_id >= GEN_BASE else ""


@dataclass
class Generation:
    """What one request generates: token ids, their texts, and how it ended."""

    token_ids: list[int]
    pieces: list[str]
    finish: str
    stop_reason: int | str | None = None


def metrics_text(role: str, ok: int, rejected: int, unknown: int, block_size: int = 128) -> str:
    """The vLLM series the eval's topology probe reads (KV arrived over NIXL on a decode), plus
    the fake's own request counts, which a test reads to prove no request was rejected."""
    source = "local_compute" if role == PREFILL else "external_kv_transfer"
    lines = [
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",engine="0",role="{role}"}} 1.0',
        f'vllm:prompt_tokens_by_source_total{{engine="0",source="{source}"}} {ok * PROMPT_TOKENS}',
        f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {ok}',
        'vllm:nixl_num_failed_transfers_total{engine="0"} 0',
        f'fake_requests_total{{result="ok"}} {ok}',
        f'fake_requests_total{{result="rejected"}} {rejected}',
        f'fake_requests_total{{result="unknown_question"}} {unknown}',
    ]
    return "\n".join(lines) + "\n"


def prefill_problem(body: dict[str, Any], kv: dict[str, Any]) -> str | None:
    """Why a request is not a P/D prefill leg (vLLM would silently run it as a normal one)."""
    if kv.get("do_remote_decode") is not True:
        return "prefill needs kv_transfer_params.do_remote_decode=true"
    if kv.get("do_remote_prefill") is not False:
        return "prefill needs kv_transfer_params.do_remote_prefill=false"
    if body.get("stream"):
        return "prefill must not stream"
    if body.get("max_tokens") != 1:
        return "prefill needs max_tokens=1"
    # vLLM runs these as several engine requests that each keep KV, and answers one handle.
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return "prefill with n > 1 would keep n-1 requests' KV nobody reads"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return "prefill with several prompts would keep KV nobody reads"
    return None


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
        fields = ("remote_engine_id", "remote_block_ids", "remote_request_id")
        msg = "|".join(str(params.get(k)) for k in fields)
        return hmac.new(self.secret, msg.encode(), hashlib.sha256).hexdigest()

    def _check(self, body: dict[str, Any], rid: str) -> str | None:
        """Why the request breaks the P/D protocol for this role (or, answering, is not what an
        eval harness sends), or None."""
        kv = body.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else {}
        if self.answers is not None and (problem := self._eval_problem(body)):
            return problem
        if self.role == PREFILL and not self._plain(body):
            return prefill_problem(body, kv)
        if self.role == DECODE and not self._plain(body):
            if body.get("prompt_logprobs") is not None:
                return "decode reading remote KV computes no prompt logprobs (vLLM hangs)"
            return self._decode_problem(kv, rid)
        return None

    def _decode_problem(self, kv: dict[str, Any], rid: str) -> str | None:
        """Why ``kv`` are not handles a prefill issued for this very request."""
        if kv.get("do_remote_prefill") is not True:
            return "decode needs the kv_transfer_params a prefill returned"
        engine = kv.get("remote_engine_id")
        if self.prefill_engine_id is not None and engine != self.prefill_engine_id:
            return f"decode kv_transfer_params name engine {engine!r}, not the prefill's"
        if kv.get("remote_request_id") != rid:
            return "decode X-Request-Id differs from the prefill's"
        if not hmac.compare_digest(str(kv.get("fake_signature")), self.sign(kv)):
            return "decode kv_transfer_params were not issued by a prefill"
        return None

    def _plain(self, body: dict[str, Any]) -> bool:
        """A request without kv_transfer_params served in full (knobs.plain_requests)."""
        return self.knobs.plain_requests and body.get("kv_transfer_params") is None

    def _eval_problem(self, body: dict[str, Any]) -> str | None:
        """A harness asking for another model, or batching prompts, would score garbage."""
        if body.get("model") != self.model:
            return f"model {body.get('model')!r} is not served here"
        if prompt_text(body) is None:
            return "one text prompt per request expected"
        return None

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

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The request's prompt as token ids; ``ValueError`` says what vLLM would refuse."""
        kv = body.get("kv_transfer_params")
        if chat:
            ids = kv.pop("prompt_token_ids", None) if isinstance(kv, dict) else None
            if ids is None:
                return tokenize(render_chat(body))
            if not isinstance(ids, list) or not ids or any(type(x) is not int for x in ids):
                raise ValueError("`kv_transfer_params['prompt_token_ids']` must be a list of ints")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: the fake answers its first prompt
            if isinstance(prompt, str):
                return tokenize(prompt)
            ids = prompt
            if not isinstance(ids, list) or not ids or any(type(x) is not int for x in ids):
                raise ValueError("prompt must be a string or token ids")
        if any(not 0 <= x < VOCAB for x in ids):
            raise ValueError(f"token id out of vocabulary (0-{VOCAB - 1})")
        return ids

    def _block_mismatch(self, body: dict[str, Any], prompt_len: int) -> str | None:
        """vLLM's NIXL decode asserts its prompt's blocks are no more than the prefill's it reads
        (``_apply_prefix_caching``); the engine dies when they are not."""
        kv = body.get("kv_transfer_params")
        if self.role != DECODE or not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            return None
        groups = kv.get("remote_block_ids") or []
        needed = -(-prompt_len // self.knobs.block_size)
        for group in groups:
            if isinstance(group, list) and needed > len(group):
                return f"AssertionError: {needed} decode blocks > {len(group)} prefill blocks"
        return None

    def _limit(self, body: dict[str, Any], chat: bool, prompt_len: int) -> int:
        if self.role == PREFILL and not self._plain(body):
            return 1
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        if isinstance(value, int) and value > 0:
            return value
        if chat and self.knobs.max_model_len is not None:
            return self.knobs.max_model_len - prompt_len
        return self.knobs.tokens

    def _generate(self, body: dict[str, Any], prompt_ids: list[int], chat: bool) -> Generation:
        """The fake model: a GSM8K answer when answering (a prefill's one token is thrown away,
        so it never answers), else numbered tokens, continuing the prompt's own, up to a stop."""
        if self.answers is not None and self.role != PREFILL:
            text = gsm8k_reply(self.answers, self.knobs.gsm8k_mode, prompt_text(body) or "")
            if text is None:
                self.unknown_questions += 1
                text = UNKNOWN_ANSWER
            return Generation([GEN_BASE], [text], "stop")
        last = prompt_ids[-1]
        k = last - GEN_BASE + 1 if last >= GEN_BASE else 0
        limit = self._limit(body, chat, len(prompt_ids))
        min_tokens = body.get("min_tokens") or 0
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        stop_ids = body.get("stop_token_ids") or []
        keep_stop = bool(body.get("include_stop_str_in_output"))
        gen = Generation([], [], "length")
        text = ""
        while len(gen.token_ids) < limit:
            count = len(gen.token_ids)  # this request's tokens so far
            token = GEN_BASE + k
            eos = k == self.knobs.eos_at and not body.get("ignore_eos")
            if count >= min_tokens and (eos or token in stop_ids):
                gen.token_ids.append(EOS_ID if eos else token)
                gen.pieces.append(token_text(token) if keep_stop and not eos else "")
                gen.finish, gen.stop_reason = "stop", None if eos else token
                break
            piece = token_text(token)
            if self.knobs.corrupt and self.role == DECODE:
                piece = piece.replace(" t", " x", 1)
            gen.token_ids.append(token)
            k += 1
            before = len(text)
            text += piece
            if count + 1 > min_tokens:
                found = [(text.find(s, max(0, before - len(s) + 1)), s) for s in stop if s]
                found = [(i, s) for i, s in found if i >= 0]
                if found:
                    i, string = min(found)
                    end = i + len(string) if keep_stop else i
                    gen.pieces.append(piece[: max(0, end - before)])
                    gen.finish, gen.stop_reason = "stop", string
                    break
            gen.pieces.append(piece)
        return gen

    # ------------------------------------------------------------------ handlers
    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith("/v1"):
            return await handler(request)
        if self.record:
            self.received.append((request.method, request.path, CIMultiDict(request.headers)))
            self._notify()
        if self.api_key is not None and not self._authorized(request.headers):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def _authorized(self, headers) -> bool:
        """vLLM's check: a bearer token whose SHA-256 matches the key's."""
        assert self.api_key is not None
        scheme, _, token = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        want = hashlib.sha256(self.api_key.encode()).digest()
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), want)

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
            prompt_ids = self._prompt_ids(body, chat)
        except ValueError as exc:
            return self._reject(str(exc))
        crash = self._block_mismatch(body, len(prompt_ids))
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
        text = "".join(a.gen.pieces)
        ids = a.body.get("return_token_ids")
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if a.chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = a.gen.finish
        choice["stop_reason"] = a.gen.stop_reason
        choice["token_ids"] = a.gen.token_ids if ids else None
        if not a.chat:
            choice["prompt_token_ids"] = a.prompt_ids if ids else None
        data: dict[str, Any] = {
            "id": ("chatcmpl-" if a.chat else "cmpl-") + a.rid,
            "object": "chat.completion" if a.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": a.usage(len(a.gen.token_ids)),
            "kv_transfer_params": kv,
        }
        if a.chat:
            data["prompt_token_ids"] = a.prompt_ids if ids else None
        payload = json.dumps(data).encode()
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


@dataclass
class Answer:
    """One request being answered."""

    rid: str
    chat: bool
    body: dict[str, Any]
    prompt_ids: list[int]
    gen: Generation

    def usage(self, completion_tokens: int) -> dict[str, int]:
        n = len(self.prompt_ids)
        return {
            "prompt_tokens": n,
            "total_tokens": n + completion_tokens,
            "completion_tokens": completion_tokens,
        }


def json_copy(obj: Any) -> Any:
    """A deep copy of a JSON value (what a request looked like before it was served)."""
    return json.loads(json.dumps(obj))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--role", choices=(PREFILL, DECODE, PLAIN), default=PLAIN)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--api-key-file", help="require the first line of this file as a bearer key on /v1/*"
    )
    parser.add_argument("--engine-id", default="", help="prefill: the engine its handles name")
    parser.add_argument("--prefill-engine-id", help="decode: accept only this engine's handles")
    parser.add_argument("--gsm8k-data", help="answer the GSM8K questions of DIR/test.jsonl")
    parser.add_argument("--gsm8k-mode", choices=GSM8K_MODES, default="mixed")
    return parser.parse_args(argv)


def from_args(args: argparse.Namespace) -> FakeVLLM:
    """The fake the command line describes; it records nothing (it may serve a benchmark)."""
    api_key = None
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            api_key = f.readline().strip()
    knobs = Knobs(
        delay=args.delay,
        token_delay=args.token_delay,
        tokens=args.tokens,
        gsm8k_mode=args.gsm8k_mode,
    )
    return FakeVLLM(
        role=args.role,
        model=args.model,
        record=False,
        knobs=knobs,
        engine_id=args.engine_id,
        prefill_engine_id=args.prefill_engine_id,
        answers=load_answers(Path(args.gsm8k_data)) if args.gsm8k_data else None,
        api_key=api_key,
    )


async def serve(fake: FakeVLLM, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT; the ``listening on URL`` line tells a parent the port."""
    url = await fake.start(host, port)
    print(f"listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fake.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = serve(from_args(args), args.host, args.port)
    try:
        import uvloop
    except ImportError:
        asyncio.run(run)
    else:
        uvloop.run(run)
    sys.exit(0)


if __name__ == "__main__":
    main()
