"""The mode in front of every other: a request's shape (pd_proxy.shapes) decides its way before
any backend is touched.

- refuse: a 400 naming the parameter, counted in ``pd_proxy_refused_total{reason}``;
- local: decode alone (pd_proxy.modes.decode_alone);
- fanout: one P/D request per choice (pd_proxy.modes.fanout);
- pd: the P/D mode the settings chose (normal or first token), unless
  ``--local-prefill-max-tokens`` sends a short prompt to decode alone. Its tokens are counted
  with the served model's tokenizer and chat template by a decode's ``/tokenize``
  (pd_proxy.local_prefill); a count that fails takes P/D, never an error.

With cache-aware routing or a local tokenizer (pd_proxy.cache), a ``CacheRouter`` plans the
request instead: token ids (local tokenizer, else ``/tokenize``), the decode and prefill chosen by
cost, and the limit applied to the tokens the chosen decode does not hold.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from pd_proxy import local_prefill
from pd_proxy.cache.setup import cache_router
from pd_proxy.errors import ProxyError
from pd_proxy.legs import Legs, Mode, Trace
from pd_proxy.modes.decode_alone import DecodeAloneMode
from pd_proxy.modes.fanout import FanoutMode
from pd_proxy.pool import Backend
from pd_proxy.rewrite import dumps
from pd_proxy.shapes import FANOUT, LOCAL, REFUSE, classify
from pd_proxy.upstream import Fields, Reply

log = logging.getLogger("pd_proxy.request")
TOKENIZE = "/tokenize"  # vLLM's; for messages it renders the chat template first


class ByShapeMode:
    def __init__(self, legs: Legs, pd: Mode) -> None:
        self.legs = legs
        self.pd = pd
        self.local = DecodeAloneMode(legs)
        self.fanout = FanoutMode(legs, legs.metrics)
        self.local_max = legs.config.local_prefill_max_tokens
        self._refused = legs.metrics.refused
        self.cache = cache_router(legs)

    async def __call__(
        self,
        request: web.Request,
        endpoint: str,
        body: bytes,
        client_body: dict[str, Any],
        headers: Fields,
        trace: Trace,
    ) -> web.StreamResponse:
        decision = classify(client_body, endpoint)
        route = decision.route
        if route == REFUSE:
            self._refused.labels(decision.shape.name).inc()
            raise ProxyError(400, decision.refusal(), decision.shape.param)
        if route == LOCAL:
            return await self.local(request, endpoint, body, client_body, headers, trace)
        if route == FANOUT:
            return await self.fanout(request, endpoint, client_body, headers, trace, decision.shape)
        if self.cache is not None:
            plan = await self.cache.plan(endpoint, client_body, trace=trace, headers=headers)
            path, _ = self.cache.decide(plan, self.local_max)
            trace.want = {"decode": plan.decode, "prefill": plan.prefill}
            if path == LOCAL:
                return await self.local(request, endpoint, body, client_body, headers, trace)
            return await self.pd(request, endpoint, body, client_body, headers, trace)
        if self.local_max > 0:
            count = await self._prompt_tokens(endpoint, client_body, headers, trace)
            if local_prefill.goes_local(count, self.local_max):
                return await self.local(request, endpoint, body, client_body, headers, trace)
        return await self.pd(request, endpoint, body, client_body, headers, trace)

    async def _prompt_tokens(
        self, endpoint: str, client_body: dict[str, Any], headers: Fields, trace: Trace
    ) -> int | None:
        """The prompt's length in the served model's tokens; None when it cannot be known."""
        count = local_prefill.direct_count(client_body, endpoint)
        if count is not None:
            return count
        body = local_prefill.tokenize_body(client_body, endpoint)
        if body is None:
            return None

        async def read(backend: Backend, resp: Reply) -> tuple[int, bytes]:
            return resp.status, await resp.read()

        try:
            status, data = await self.legs.side_call(TOKENIZE, dumps(body), headers, trace, read)
        except ProxyError as exc:
            log.warning("rid=%s counting the prompt failed, P/D: %s", trace.rid, exc.message)
            return None
        try:
            return local_prefill.count_from_answer(data) if status == 200 else None
        except (ValueError, UnicodeDecodeError):
            return None
