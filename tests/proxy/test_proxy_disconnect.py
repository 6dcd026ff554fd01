"""A client that leaves cancels the upstream leg in progress (and the decode never starts)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

from tests.proxy.proxy_harness import Stack, pd_stack


async def open_request(
    s: Stack, rid: str, body: dict
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a raw HTTP request so the test controls exactly when the socket goes away."""
    url = urlsplit(s.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"X-Request-Id: {rid}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    return reader, writer


async def wait_gauge_zero(s: Stack) -> None:
    while s.sample("pd_proxy_in_flight_requests") != 0:
        await asyncio.sleep(0.01)


async def test_disconnect_during_prefill_cancels_it_and_skips_decode():
    async with pd_stack() as s:
        s.prefill.knobs.delay = 30
        _, writer = await open_request(s, "gone-1", {"prompt": "x", "stream": True})
        await s.prefill.wait_for(lambda: len(s.prefill.seen) == 1)
        writer.close()
        await s.prefill.wait_for(lambda: "gone-1" in s.prefill.cancelled)
        await wait_gauge_zero(s)
        assert s.decode.seen == []
        labels = {"endpoint": "/v1/completions", "status": "499", "path": "pd"}
        assert s.sample("pd_proxy_requests_total", labels) == 1


async def test_disconnect_during_decode_stream_cancels_the_decode():
    async with pd_stack() as s:
        s.decode.knobs.token_delay = 0.02
        reader, writer = await open_request(
            s, "gone-2", {"prompt": "x", "max_tokens": 100000, "stream": True}
        )
        await reader.readuntil(b"data: ")  # the stream is flowing
        writer.close()
        await s.decode.wait_for(lambda: "gone-2" in s.decode.cancelled)
        await wait_gauge_zero(s)
        assert s.prefill.cancelled == []
        assert s.decode.completed == 0
        labels = {"endpoint": "/v1/completions", "status": "499", "path": "pd"}
        assert s.sample("pd_proxy_requests_total", labels) == 1
        # The proxy is still fine afterwards.
        status, _, _ = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200


async def wait_outstanding_zero(s: Stack) -> None:
    """Bounded poll: every backend's outstanding count settles back to 0."""
    backends = s.proxy.prefill_pool.backends + s.proxy.decode_pool.backends
    for _ in range(1000):
        if all(b.outstanding == 0 for b in backends):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"outstanding never returned to 0: {backends}")


async def test_disconnect_before_decode_headers_releases_the_decode_backend():
    """A client leaving while decode works on a non-stream answer must not leak ``outstanding``.

    A leaked count skews least-outstanding picks towards the other backends for good.
    """
    async with pd_stack() as s:
        s.decode.knobs.delay = 30  # decode holds its headers back: the proxy waits in post()
        _, writer = await open_request(s, "gone-3", {"prompt": "x", "stream": False})
        await s.decode.wait_for(lambda: len(s.decode.seen) == 1)
        assert s.proxy.decode_pool.backends[0].outstanding == 1
        writer.close()
        await s.decode.wait_for(lambda: "gone-3" in s.decode.cancelled)
        await wait_gauge_zero(s)
        await wait_outstanding_zero(s)
        labels = {"endpoint": "/v1/completions", "status": "499", "path": "pd"}
        assert s.sample("pd_proxy_requests_total", labels) == 1
