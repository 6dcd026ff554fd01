"""Decode alone: the client's own request on a decode backend, without ``kv_transfer_params``.

vLLM's decode then prefills the prompt itself, as a single instance would. The way for shapes a
decode reading remote KV cannot serve (``prompt_logprobs``, beam search: pd_proxy.shapes) and for
short prompts under ``--local-prefill-max-tokens``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pd_proxy.legs import Legs, Trace
from pd_proxy.shapes import LOCAL
from pd_proxy.upstream import Fields


class DecodeAloneMode:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def __call__(
        self,
        request: web.Request,
        endpoint: str,
        body: bytes,
        client_body: dict[str, Any],
        headers: Fields,
        trace: Trace,
    ) -> web.StreamResponse:
        trace.path = LOCAL
        return await self.legs.decode_leg(request, endpoint, body, headers, trace)
