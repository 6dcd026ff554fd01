"""Decode alone: the client's own request on a decode backend, without ``kv_transfer_params``.

vLLM's decode then prefills the prompt itself, as a single instance would. The way for shapes a
decode reading remote KV cannot serve (``prompt_logprobs``, beam search:
pd_proxy.routing.shapes) and for prompts whose uncached tokens are within
``--local-prefill-max-tokens`` (pd_proxy.routing.decider).
"""

from __future__ import annotations

from aiohttp import web

from pd_proxy.backends.route import LOCAL, Route
from pd_proxy.call import Call
from pd_proxy.legs import Lease, Legs
from pd_proxy.tracing import Trace


class DecodeAloneMode:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def __call__(
        self, call: Call, route: Route, trace: Trace, lease: Lease
    ) -> web.StreamResponse:
        trace.path = LOCAL
        return await self.legs.decode_leg(
            call,
            call.body,
            trace=trace,
            lease=lease,
            want=route.decode,
            tokens=route.uncached_tokens or 0,
        )
