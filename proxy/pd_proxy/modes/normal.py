"""The normal P/D mode: a ``max_tokens=1`` prefill leg for the KV, then the client's own request
on a decode backend with the KV handles the prefill returned, its answer relayed as it comes."""

from __future__ import annotations

from aiohttp import web

from pd_proxy.backends.route import Route
from pd_proxy.call import Call
from pd_proxy.legs import Lease, Legs
from pd_proxy.protocol.codec import dumps
from pd_proxy.protocol.pd_bodies import decode_payload, kv_params_from_prefill, prefill_body
from pd_proxy.tracing import Trace


class NormalMode:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def __call__(
        self, call: Call, route: Route, trace: Trace, lease: Lease
    ) -> web.StreamResponse:
        legs = self.legs
        prefill = dumps(prefill_body(call.client_body))
        backend, data = await legs.prefill_leg(
            call.endpoint,
            prefill,
            call.headers,
            trace=trace,
            lease=lease,
            want=route.prefill,
            tokens=route.uncached_tokens or 0,
        )
        try:
            kv_params = kv_params_from_prefill(data)
        except ValueError:
            raise legs.invalid_prefill_json(backend, data) from None
        if trace.otel is not None:
            trace.otel.kv_params(kv_params)
        payload = decode_payload(call.body, call.client_body, kv_params)
        return await legs.decode_leg(call, payload, trace=trace, lease=lease, want=route.decode)
