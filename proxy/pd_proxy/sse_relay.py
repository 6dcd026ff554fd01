"""The decode stream's way back to the client: SSE bytes relayed as they arrive, never parsed.

This is the proxy's one loop per token, so it does as little as it can. Once the headers have
gone out, a broken or silent backend can no longer become an HTTP error: the stream then ends with
an SSE error event and ``[DONE]``, as vLLM ends its own. Only the last chunk is kept, to know
whether that event needs a separator first. ``relay_events`` is the variant for a stream whose
first events the proxy wrote itself (``--first-token-from-prefill``): each chunk passes through a
transform that keeps whole events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from pd_proxy.errors import sse_error_event
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.pool import Backend
from pd_proxy.upstream import Reply, UpstreamError, UpstreamTimeout

log = logging.getLogger("pd_proxy.request")

# What writing to a client that hung up raises.
CLIENT_LEFT = (ConnectionResetError, aiohttp.ClientConnectionError)


class RelayResponse(web.StreamResponse):
    """A stream whose headers leave with its first chunk: one send instead of two.

    aiohttp's own ``Response`` opts into this buffering; for a relay it costs nothing, since the
    client cannot act on the headers before the first token anyway.
    """

    _send_headers_immediately = False


async def _read_chunk(resp: Reply) -> bytes | UpstreamError:
    """Next upstream chunk, b"" at a clean end, or the exception that broke the stream."""
    try:
        return await resp.readany()
    except UpstreamError as exc:
        return exc


async def relay_stream(
    request: web.Request,
    resp: Reply,
    content_type: str,
    rid: str,
    backend: Backend,
    metrics: ProxyMetrics,
    decode_timeout: float,
    first_byte: Callable[[], object],
) -> tuple[web.StreamResponse, bool]:
    """Relay the event stream ``resp`` from ``backend`` to the client; true when the client left.

    ``first_byte`` is called once the first chunk (or a clean end) has arrived. A stream that
    breaks, or that stays silent for ``decode_timeout`` seconds, counts as a decode error.
    """
    out = RelayResponse(
        headers={"Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": rid}
    )
    await out.prepare(request)
    last = b"\n\n"
    failure: BaseException | None = None
    chunk = await _read_chunk(resp)
    if isinstance(chunk, bytes):
        first_byte()
    while isinstance(chunk, bytes) and chunk:
        try:
            if resp.at_eof():
                # Last chunk: send it with the chunked terminator in one write.
                await out.write_eof(chunk)
                return out, False
            await out.write(chunk)
        except CLIENT_LEFT:
            return out, True
        last = chunk
        chunk = await _read_chunk(resp)
    if not isinstance(chunk, bytes):
        failure = chunk
        metrics.backend_error("decode", backend.url)
        if isinstance(failure, UpstreamTimeout):
            status, message = (
                504,
                f"decode backend {backend.url} sent nothing for {decode_timeout:g}s",
            )
        else:
            status, message = 502, f"decode backend {backend.url} broke the stream: {failure}"
        log.warning("rid=%s %s", rid, message)
        try:
            await out.write(sse_error_event(status, message, not last.endswith(b"\n\n")))
        except CLIENT_LEFT:
            return out, True
    try:
        await out.write_eof()
    except CLIENT_LEFT:
        return out, True
    return out, False


async def relay_events(
    out: web.StreamResponse,
    resp: Reply,
    transform: Callable[[bytes], bytes],
    rid: str,
    backend: Backend,
    metrics: ProxyMetrics,
    decode_timeout: float,
    first_byte: Callable[[], object],
) -> bool:
    """Relay ``resp``'s event stream into ``out``, already sent to the client (its first events
    came from elsewhere), through ``transform``; true when the client left.

    ``transform`` gets each chunk and returns the bytes to send (whole events); what it holds back
    when the stream breaks is dropped, so the error event needs no separator. Failures end the
    stream as ``relay_stream``'s do.
    """
    chunk = await _read_chunk(resp)
    if isinstance(chunk, bytes):
        first_byte()
    while isinstance(chunk, bytes) and chunk:
        data = transform(chunk)
        if data:
            try:
                await out.write(data)
            except CLIENT_LEFT:
                return True
        chunk = await _read_chunk(resp)
    if not isinstance(chunk, bytes):
        metrics.backend_error("decode", backend.url)
        if isinstance(chunk, UpstreamTimeout):
            status = 504
            message = f"decode backend {backend.url} sent nothing for {decode_timeout:g}s"
        else:
            status, message = 502, f"decode backend {backend.url} broke the stream: {chunk}"
        log.warning("rid=%s %s", rid, message)
        try:
            await out.write(sse_error_event(status, message, False))
        except CLIENT_LEFT:
            return True
    try:
        await out.write_eof()
    except CLIENT_LEFT:
        return True
    return False
