"""The one way the proxy learns a prompt's token ids: from the request itself (completions with
token ids), from the local tokenizer (``--tokenizer``, trusted per request shape once its canary
matched a decode's ``/tokenize``: pd_proxy.routing.tokenizer_check), else from a decode's
``POST /tokenize`` (vLLM renders the chat template first), bounded by ``--tokenize-timeout``.

Any failure gives None, never an error: an uncounted request takes P/D, the path that serves
every prompt. The pure parts (the ``/tokenize`` body, reading its answer, ids in the request) are
module functions; ``TokenCounter`` does the I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pd_proxy import scheduler
from pd_proxy.http.exchange import read_whole
from pd_proxy.protocol.codec import dumps, loads
from pd_proxy.protocol.endpoints import COMPLETIONS, Endpoint
from pd_proxy.protocol.errors import ProxyError
from pd_proxy.routing.token_ids import is_token_ids

if TYPE_CHECKING:
    from pd_proxy.backends.pool import BackendPool
    from pd_proxy.call import Call
    from pd_proxy.http.exchange import Exchange
    from pd_proxy.routing.cache.metrics import CacheMetrics
    from pd_proxy.tracing import Trace

log = logging.getLogger("pd_proxy.request")

TOKENIZE = "/tokenize"  # vLLM's; for messages it renders the chat template first
# Chat fields that change the rendered prompt: /tokenize takes them as the chat endpoint does.
CHAT_RENDER_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


def direct_ids(body: Mapping[str, Any], endpoint: Endpoint) -> list[int] | None:
    """The prompt's ids when the request gives them (completions with token ids)."""
    prompt = body.get("prompt")
    if endpoint != COMPLETIONS or not isinstance(prompt, list) or not prompt:
        return None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if is_token_ids(prompt):
        return prompt  # read, never changed: no copy of a long prompt
    return None


def tokenize_body(body: Mapping[str, Any], endpoint: Endpoint) -> dict[str, Any] | None:
    """The ``/tokenize`` request for the request's prompt as the model will see it, or None when
    the prompt is not one text (those take P/D: the decision needs one count)."""
    out: dict[str, Any] = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    out["messages"] = messages
    for key in CHAT_RENDER_FIELDS:
        if key in body:
            out[key] = body[key]
    return out


def ids_from_answer(data: bytes) -> list[int]:
    """The ``tokens`` of a ``/tokenize`` answer; ``ValueError`` when it has none."""
    obj = loads(data)
    tokens = obj.get("tokens") if isinstance(obj, dict) else None
    if not is_token_ids(tokens):
        raise ValueError("/tokenize answer without token ids")
    return tokens


class LocalIds(Protocol):
    """The local tokenizer where it is trusted (pd_proxy.routing.tokenizer_check)."""

    def local_ids(self, body: Mapping[str, Any], endpoint: Endpoint) -> list[int] | None: ...


class TokenCounter:
    """Token ids for one request, by the cheapest source that can be trusted."""

    def __init__(
        self,
        exchange: Exchange,
        decode: BackendPool,
        timeout: float,
        check: LocalIds | None = None,
        metrics: CacheMetrics | None = None,
    ) -> None:
        self.exchange = exchange
        self.decode_pool = decode
        self.timeout = timeout  # --tokenize-timeout
        self.check = check  # the local tokenizer and the shapes it is trusted for
        self.metrics = metrics

    async def ids(self, call: Call, trace: Trace) -> list[int] | None:
        ids = direct_ids(call.client_body, call.endpoint)
        if ids is not None:
            self._count("ids")
            return ids
        check = self.check
        if check is not None:
            start = time.perf_counter()
            ids = check.local_ids(call.client_body, call.endpoint)
            if ids is not None:
                self._count("local", time.perf_counter() - start)
                return ids
        start = time.perf_counter()
        ids = await self.server_ids(call, trace)
        if ids is None:
            self._count("none")
            return None
        self._count("server", time.perf_counter() - start)
        return ids

    def _count(self, source: str, seconds: float | None = None) -> None:
        m = self.metrics
        if m is None:
            return
        m.tokenizer.labels(source).inc()
        if seconds is not None:
            m.tokenizer_seconds.labels(source).observe(seconds)

    async def server_ids(self, call: Call, trace: Trace) -> list[int] | None:
        """A decode's ``/tokenize`` ids within ``--tokenize-timeout``; None on any failure."""
        request = tokenize_body(call.client_body, call.endpoint)
        if request is None:
            return None

        # The least busy decode, without moving the pool's round-robin (pd_proxy.scheduler).
        least = scheduler.least_busy(self.decode_pool)
        try:
            _, status, data, _ = await self.exchange(
                self.decode_pool,
                TOKENIZE,
                dumps(request),
                call.headers,
                trace=trace,
                consume=read_whole,
                total=self.timeout,
                want=least,
            )
            return ids_from_answer(data) if status == 200 else None
        except ProxyError as exc:
            log.warning("rid=%s counting the prompt failed, P/D: %s", trace.rid, exc.message)
        except (ValueError, UnicodeDecodeError):
            log.warning("rid=%s /tokenize answered without token ids", trace.rid)
        return None
