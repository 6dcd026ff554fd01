"""A fake vLLM OpenAI server that enforces the NIXL P/D ``kv_transfer_params`` protocol.

Used by the proxy tests and the benchmark. A ``prefill`` fake rejects requests that do not ask for a
remote decode (or that stream, or generate more than one token) and returns signed
``kv_transfer_params``; a ``decode`` fake rejects requests whose params were not signed by a prefill
fake for the same ``X-Request-Id``. Knobs (mutable at run time through ``fake.knobs``) add delay,
per-token delay, failures and a stream that dies mid-way. With ``api_key`` set it guards ``/v1/*``
like ``vllm serve --api-key`` (401 ``{"error": "Unauthorized"}``); with ``record`` every ``/v1``
request, rejected ones included, lands in ``received``. Run standalone with
``python -m pd_proxy.testing.fake_vllm --role decode --port 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import itertools
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

DEFAULT_SECRET = b"pd-proxy-fake-vllm"
PREFILL, DECODE, PLAIN = "prefill", "decode", "plain"


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
    engine_id: str = ""
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
        """Why the request breaks the P/D protocol for this role, or None."""
        kv = body.get("kv_transfer_params")
        if self.role == PREFILL:
            if not isinstance(kv, dict) or kv.get("do_remote_decode") is not True:
                return "prefill needs kv_transfer_params.do_remote_decode=true"
            if kv.get("do_remote_prefill") is not False:
                return "prefill needs kv_transfer_params.do_remote_prefill=false"
            if body.get("stream"):
                return "prefill must not stream"
            if body.get("max_tokens") != 1:
                return "prefill needs max_tokens=1"
        elif self.role == DECODE:
            if not isinstance(kv, dict) or kv.get("do_remote_prefill") is not True:
                return "decode needs the kv_transfer_params a prefill returned"
            if kv.get("remote_request_id") != rid:
                return "decode X-Request-Id differs from the prefill's"
            if not hmac.compare_digest(str(kv.get("fake_signature")), self.sign(kv)):
                return "decode kv_transfer_params were not issued by a prefill"
        return None

    def _prefill_params(self, rid: str) -> dict[str, Any]:
        first = next(self._blocks)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [first, first + 1],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }
        params["fake_signature"] = self.sign(params)
        return params

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

    async def _models(self, request: web.Request) -> web.Response:
        data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        return web.json_response(data)

    def _error(self, status: int, message: str) -> web.Response:
        body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
        return web.json_response(body, status=status)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        try:
            return await self._serve_completion(request, rid)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(rid)
            self._notify()
            raise

    async def _serve_completion(self, request: web.Request, rid: str) -> web.StreamResponse:
        knobs = self.knobs
        try:
            body = json.loads(await request.read())
        except ValueError:
            return self._error(400, "invalid JSON")
        if self.record:
            self.seen.append(Seen(request.path, CIMultiDict(request.headers), body))
            self._notify()
        if knobs.delay:
            await asyncio.sleep(knobs.delay)
        if knobs.fail_status is not None and knobs.fail_times != 0:
            if knobs.fail_times is not None:
                knobs.fail_times -= 1
            if knobs.fail_body is not None:
                return web.Response(
                    status=knobs.fail_status, body=knobs.fail_body, content_type="application/json"
                )
            return self._error(knobs.fail_status, f"injected failure {knobs.fail_status}")
        problem = self._check(body, rid)
        if problem:
            return self._error(400, problem)
        chat = request.path.endswith("/chat/completions")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        n = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else knobs.tokens
        if self.role == PREFILL:
            n = 1
        kv = self._prefill_params(rid) if self.role == PREFILL else None
        if kv is not None and self.record:
            self.issued[rid] = kv
        if body.get("stream"):
            resp = await self._stream(request, rid, chat, n)
        else:
            resp = self._json(rid, chat, n, kv)
        self.completed += 1
        self._notify()
        return resp

    def _json(self, rid: str, chat: bool, n: int, kv: dict[str, Any] | None) -> web.Response:
        text = "".join(f" t{i}" for i in range(n))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = "length"
        data = {
            "id": ("chatcmpl-" if chat else "cmpl-") + rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n},
            "kv_transfer_params": kv,
        }
        payload = json.dumps(data).encode()
        if self.record:
            self.sent[rid] = payload
        return web.Response(body=payload, content_type="application/json")

    async def _stream(
        self, request: web.Request, rid: str, chat: bool, n: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        if chat:
            head = (
                f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                f'"created":{int(time.time())},"model":"{self.model}","choices":[{{"index":0,'
                '"delta":{"content":"'
            )
        else:
            head = (
                f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                f'"created":{int(time.time())},"model":"{self.model}","choices":[{{"index":0,'
                '"text":"'
            )
        close = '"},"finish_reason":' if chat else '","finish_reason":'
        knobs = self.knobs
        sent: list[bytes] | None = [] if self.record else None
        for i in range(n):
            if knobs.die_after is not None and i == knobs.die_after:
                # Half an event, then the connection drops without the closing chunk.
                await resp.write(b'data: {"id":"broken')
                if sent is not None:
                    self.sent[rid] = b"".join(sent) + b'data: {"id":"broken'
                assert request.transport is not None
                request.transport.close()
                return resp
            finish = '"length"' if i == n - 1 else "null"
            chunk = f"{head} t{i}{close}{finish}}}]}}\n\n".encode()
            await resp.write(chunk)
            if sent is not None:
                sent.append(chunk)
            if knobs.token_delay:
                await asyncio.sleep(knobs.token_delay)
        await resp.write(b"data: [DONE]\n\n")
        if sent is not None:
            self.sent[rid] = b"".join(sent) + b"data: [DONE]\n\n"
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=(PREFILL, DECODE, PLAIN), default=PLAIN)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--api-key-file", help="require the first line of this file as a bearer key on /v1/*"
    )
    args = parser.parse_args(argv)
    api_key = None
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            api_key = f.readline().strip()
    fake = FakeVLLM(
        role=args.role,
        record=False,
        api_key=api_key,
        knobs=Knobs(delay=args.delay, token_delay=args.token_delay, tokens=args.tokens),
    )

    async def run() -> None:
        url = await fake.start(args.host, args.port)
        print(f"listening on {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await fake.stop()

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())
    sys.exit(0)


if __name__ == "__main__":
    main()
