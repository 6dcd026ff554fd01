"""The normal P/D mode: a ``max_tokens=1`` prefill leg for the KV, then the client's own request
on a decode backend with the KV handles the prefill returned, its answer relayed as it comes;
the prompt as the prefill's token ids where vLLM can take them (``reuses_prompt_ids``)."""

from __future__ import annotations

from aiohttp import web

from pd_proxy.backends.route import Route
from pd_proxy.call import Call
from pd_proxy.legs import Lease, Legs
from pd_proxy.protocol.codec import dumps
from pd_proxy.protocol.pd_bodies import (
    decode_payload,
    prefill_answer,
    prefill_body,
    prompt_ids_from_prefill,
    reuses_prompt_ids,
)
from pd_proxy.tracing import Trace


class NormalMode:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def __call__(
        self, call: Call, route: Route, trace: Trace, lease: Lease
    ) -> web.StreamResponse:
        legs = self.legs
        reuse = reuses_prompt_ids(call.endpoint, call.client_body)
        prefill = dumps(prefill_body(call.client_body, prompt_ids=reuse))
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
            answer = prefill_answer(data)
        except ValueError:
            raise legs.invalid_prefill_json(backend, data) from None
        kv_params = answer.get("kv_transfer_params")
        if trace.otel is not None:
            trace.otel.kv_params(kv_params)
        ids = prompt_ids_from_prefill(call.endpoint, answer) if reuse else None
        if ids is not None and isinstance(kv_params, dict):
            self.legs.metrics.prompt_ids.labels("forwarded", "").inc()
        else:
            reason = "not_answered" if reuse else "not_eligible"
            self.legs.metrics.prompt_ids.labels("text", reason).inc()
            ids = None
        payload = decode_payload(call.body, call.client_body, kv_params, call.endpoint, ids)
        return await legs.decode_leg(call, payload, trace=trace, lease=lease, want=route.decode)
