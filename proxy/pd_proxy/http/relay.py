"""The decode stream's way back to the client: SSE bytes relayed as they arrive, never parsed.

This is the proxy's one loop per token, so it does as little as it can. Once the headers have
gone out, a broken or silent backend can no longer become an HTTP error: the stream then ends with
an SSE error event and ``[DONE]``, as vLLM ends its own. Only the last chunk is kept, to know
whether that event needs a separator first. ``relay_events`` is the one loop and ``_fail`` the one
failure path; ``relay_stream`` opens the client's stream first, and a stream whose first events
the proxy wrote itself (``--first-token-from-prefill``) passes each chunk through a transform that
keeps whole events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from pd_proxy.backends.pool import Backend
from pd_proxy.http.connection import Reply, UpstreamError, UpstreamTimeout
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.protocol.errors import sse_error_event

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
    backend: Backend,
    *,
    content_type: str,
    rid: str,
    metrics: ProxyMetrics,
    decode_timeout: float,
    first_byte: Callable[[], object],
    started: Callable[[], object],
) -> tuple[web.StreamResponse, bool]:
    """Relay the event stream ``resp`` from ``backend`` to the client, bytes unchanged; true
    when the client left. See ``relay_events`` for ``first_byte``, ``started`` and failures."""
    out = RelayResponse(
        headers={"Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": rid}
    )
    await out.prepare(request)
    left = await relay_events(
        out,
        resp,
        backend,
        transform=None,
        rid=rid,
        metrics=metrics,
        decode_timeout=decode_timeout,
        first_byte=first_byte,
        started=started,
    )
    return out, left


async def relay_events(
    out: web.StreamResponse,
    resp: Reply,
    backend: Backend,
    *,
    transform: Callable[[bytes], bytes] | None,
    rid: str,
    metrics: ProxyMetrics,
    decode_timeout: float,
    first_byte: Callable[[], object],
    started: Callable[[], object],
) -> bool:
    """Relay ``resp``'s event stream into ``out`` (prepared), through ``transform`` when given;
    true when the client left.

    ``first_byte`` (the trace's record), then ``started`` (the admission lease's event, handed
    over by the legs), are called once the first chunk (or a clean end) has arrived. ``transform``
    gets each chunk and returns the bytes to send (whole events; what it holds back when the
    stream breaks is dropped). A stream that breaks, or stays silent for ``decode_timeout``
    seconds, counts as a decode error and ends with an SSE error event (``_fail``).
    """
    last = b"\n\n"
    chunk = await _read_chunk(resp)
    if isinstance(chunk, bytes):
        first_byte()
        started()
    while isinstance(chunk, bytes) and chunk:
        backend.progress += 1  # alive: pd_proxy.backends.breaker tells busy from hung by this
        data = chunk if transform is None else transform(chunk)
        try:
            if resp.at_eof():
                # Last chunk: send it with the chunked terminator in one write.
                await out.write_eof(data)
                return False
            if data:
                await out.write(data)
        except CLIENT_LEFT:
            return True
        last = data
        chunk = await _read_chunk(resp)
    if not isinstance(chunk, bytes):
        # Unchanged bytes may stop mid-event: the error event then needs a separator first.
        separate = transform is None and not last.endswith(b"\n\n")
        failed = _fail(
            out,
            chunk,
            backend,
            separate=separate,
            rid=rid,
            metrics=metrics,
            decode_timeout=decode_timeout,
        )
        if await failed:
            return True
    try:
        await out.write_eof()
    except CLIENT_LEFT:
        return True
    return False


async def _fail(
    out: web.StreamResponse,
    failure: UpstreamError,
    backend: Backend,
    *,
    separate: bool,
    rid: str,
    metrics: ProxyMetrics,
    decode_timeout: float,
) -> bool:
    """The one failure path of a stream already sent: count it, log it, and write the SSE error
    event (``[DONE]`` included); true when the client left meanwhile."""
    metrics.backend_error("decode", backend.url)
    if isinstance(failure, UpstreamTimeout):
        status, message = 504, f"decode backend {backend.url} sent nothing for {decode_timeout:g}s"
    else:
        status, message = 502, f"decode backend {backend.url} broke the stream: {failure}"
    log.warning("rid=%s %s", rid, message)
    try:
        await out.write(sse_error_event(status, message, separate))
    except CLIENT_LEFT:
        return True
    return False
