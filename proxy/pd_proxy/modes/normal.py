"""The normal P/D mode: a ``max_tokens=1`` prefill leg for the KV, then the client's own request
on a decode backend with the KV handles the prefill returned, its answer relayed as it comes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pd_proxy.legs import Legs, Trace
from pd_proxy.rewrite import decode_payload, dumps, kv_params_from_prefill, prefill_body
from pd_proxy.upstream import Fields


class NormalMode:
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
        legs = self.legs
        prefill = dumps(prefill_body(client_body))
        backend, data = await legs.prefill_leg(endpoint, prefill, headers, trace)
        try:
            kv_params = kv_params_from_prefill(data)
        except ValueError:
            raise legs.invalid_prefill_json(backend, data) from None
        payload = decode_payload(body, client_body, kv_params)
        return await legs.decode_leg(request, endpoint, payload, headers, trace)
