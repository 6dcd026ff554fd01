"""One keep-alive HTTP/1.1 connection to a backend, and the errors and answer it gives.

The wire half of pd_proxy.http.upstream (the pool of these connections and the request heads).

aiohttp's client spends 150-200 us of CPU on each request in Python (request and response objects,
header multidicts, payload wrappers, timers, tracing hooks), and the proxy makes two of them per
client request: most of its CPU. The legs need far less: POST a body with a few fixed headers on a
pooled keep-alive connection, read the status line and headers, and hand over the body whole
(``read``) or as it arrives (``readany``), framed by Content-Length, chunked encoding or the end of
the connection. That is all this module does, at a tenth of the cost. Health checks and
``/v1/models`` stay on aiohttp.

It is the one module of the proxy that writes HTTP/1.1 bytes: callers give a backend, a path, a
mapping of extra header fields and the body (``Upstream.post``, ``Upstream.get``) and get a
``Reply``; each backend's fixed request head (request line, Host, Accept, Content-Type) is built
once per path and cached here.

Limits: the head (``MAX_HEAD_BYTES``), a chunk-size or trailer line (``MAX_LINE_BYTES``), all
trailer lines together (``MAX_TRAILER_BYTES``), and a body not yet taken by the caller
(``max_body``, ``MAX_BODY_BYTES`` by default): past one the answer is broken. An answer with both
Transfer-Encoding and Content-Length is broken too (RFC 9112 section 6.3: a sign of smuggling),
and its connection is closed.

Errors: ``ConnectFailed`` (refused, unreachable, DNS, TLS handshake, connect timeout: the request
never reached the backend, so another backend may take it), ``UpstreamTimeout`` (the leg's time
limit, also when it runs out during the connect, or the backend silent for the silence limit
while the proxy waits for it) and ``UpstreamBroken`` (the connection broke, or the answer is not
HTTP/1.x; ``StaleConnection`` when a reused keep-alive connection closed before any byte of the
answer came back: the backend most likely closed it as idle, and the same request may go again
on a new connection). A connection whose answer was not read to its end, or that broke or timed
out, is closed, never reused, so a client that leaves cancels the backend's work (it sees the
connection close).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

MAX_HEAD_BYTES = 64 * 1024  # status line and headers
MAX_LINE_BYTES = 4096  # a chunk-size or trailer line
MAX_TRAILER_BYTES = 64 * 1024  # all trailer lines of a chunked body
MAX_BODY_BYTES = 256 * 1024 * 1024  # body bytes buffered and not yet taken (read() or readany())
HIGH_WATER = 256 * 1024  # streamed body bytes buffered before the socket stops being read
LARGE_BODY = 64 * 1024  # bodies from this size are sent without a copy into the head
MAX_CACHED_HEADS = 4096  # request heads kept, by method, backend and path

# Response body framing.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = 1, 2, 3
# Chunked-decoding states.
_SIZE, _DATA, _DATA_END, _TRAILER = 1, 2, 3, 4
_HEX = b"0123456789abcdefABCDEF"


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's value (any ``;extension`` ignored); ``UpstreamBroken`` if malformed."""
    if not line or line.strip(_HEX) or len(line) > 16:  # anything but plain hex: the slow path
        text = line.split(b";", 1)[0].strip(b" \t")
        if not text or text.strip(_HEX) or len(text) > 16:
            raise UpstreamBroken(f"bad chunk size: {line[:40]!r}")
        line = text
    return int(line, 16)


class UpstreamError(Exception):
    """A leg failed; the message is safe to show a client."""


class ConnectFailed(UpstreamError):
    """No connection: the request never reached the backend."""


class UpstreamTimeout(UpstreamError):
    """The leg's time limit passed, or the backend stayed silent for the silence limit."""


class UpstreamBroken(UpstreamError):
    """The connection broke before the end of the answer, or the answer is not HTTP/1.x."""


class StaleConnection(UpstreamBroken):
    """A reused connection closed before any byte of the answer came back (an idle close that
    crossed the request): the request may go again, and the idle connections to that backend
    were dropped, so it goes on a new one."""


class Reply(Protocol):
    """A backend's answer, as ``Upstream.post``/``get`` give it: the head is here, the body comes.

    ``headers`` has lower-case names. ``read()`` gives the whole body, ``readany()`` the bytes
    that arrived since the last call (``b""`` at the end); ``at_eof()`` is true once all of it has
    been taken. ``release()`` must follow: the connection goes back to the pool when the answer
    was read to its end, and is closed otherwise.
    """

    status: int
    headers: dict[str, str]

    async def read(self) -> bytes: ...

    async def readany(self) -> bytes: ...

    def at_eof(self) -> bool: ...

    def release(self) -> None: ...


Address = tuple[str, int, bool]  # host, port, TLS


class Pool(Protocol):
    """What a connection needs of the pool that made it (pd_proxy.http.upstream's ``Upstream``)."""

    loop: asyncio.AbstractEventLoop
    max_body: int

    def _park(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection; between ``Upstream.request`` and ``release`` it is the response.

    ``status`` and ``headers`` (lower-case names) are set once the head has arrived; ``read()``
    gives the whole body, ``readany()`` the next bytes of it (``b""`` at the end).
    """

    def __init__(self, upstream: Pool, address: Address) -> None:
        self._upstream = upstream
        self.address = address
        self._loop = upstream.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # it has answered a request before
        self.idle_since = 0.0
        self._max_body = upstream.max_body
        self._busy = False
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._silence: float | None = None
        self._paused = False
        self._streaming = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head_done = False
        self._head = b""
        self._framing = 0
        self._left = 0  # Content-Length bytes still due, or the current chunk's
        self._chunk_state = _SIZE
        self._rest = b""  # undecoded chunked bytes
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._trailer = 0  # trailer bytes so far
        self._got_bytes = False  # any byte of the answer arrived
        self._done = False  # the whole body has arrived
        self._reusable = True
        self._error: UpstreamError | None = None

    # ------------------------------------------------------------------ protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # nothing asked for: a backend closing an idle connection says so
            self.close()
            return
        if self._error is not None:
            return
        self._got_bytes = True
        try:
            if not self._head_done:
                data = self._feed_head(data)
                if not self._head_done:
                    return
            if data and not self._done:
                self._feed_body(data)
            elif data:
                self._reusable = False  # bytes after the answer: never reuse this connection
        except UpstreamBroken as exc:
            self._fail(exc)
            return
        if self._buffered > self._max_body:
            self._pieces.clear()
            self._buffered = 0
            self._done = False
            self._fail(UpstreamBroken(f"answer body over {self._max_body} bytes"))
            return
        if self._streaming and not self._paused and self._buffered > HIGH_WATER:
            assert self.transport is not None
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True  # never offered again, even before connection_lost runs
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._busy and not self._done and self._error is None:
            if self._head_done and self._framing == _UNTIL_CLOSE:
                self._done = True
            elif self.reused and not self._got_bytes:
                self._error = StaleConnection("reused connection closed before any answer")
            else:
                detail = f": {exc}" if exc else ""
                self._error = UpstreamBroken(
                    "connection closed before the end of the answer" + detail
                )
        self._cancel_deadline()
        self._wake()

    # ------------------------------------------------------------------ parsing
    def _feed_head(self, data: bytes) -> bytes:
        """Take the head from ``data``; the bytes after it (body) are returned."""
        buf = self._head + data if self._head else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise UpstreamBroken("answer head too large")
                self._head = buf
                return b""
            self._parse_head(buf[:end])
            buf = buf[end + 4 :]
            if self._head_done:
                self._head = b""
                return buf
            # An interim 1xx answer: the real one follows.

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise UpstreamBroken(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamBroken(f"malformed header line: {line[:80]!r}")
            name = name.strip().lower()
            value = value.strip()
            if name in headers and name == "content-length" and headers[name] != value:
                raise UpstreamBroken("conflicting Content-Length headers")
            headers[name] = value
        if 100 <= status < 200 and status != 101:
            return  # interim answer (100 Continue, 103 Early Hints): skip it
        self.status = status
        self.headers = headers
        self._head_done = True
        connection = headers.get("connection", "").lower()
        if version != "HTTP/1.1" or "close" in connection:
            self._reusable = False
        if status in (204, 304) or status == 101:
            self._reusable = status != 101
            self._done = True
            return
        coding = headers.get("transfer-encoding")
        if coding is not None and "content-length" in headers:
            raise UpstreamBroken("answer has both Transfer-Encoding and Content-Length")
        if coding is not None:
            if coding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                self._framing = _UNTIL_CLOSE
                self._reusable = False
            else:
                self._framing = _CHUNKED
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise UpstreamBroken(f"bad Content-Length: {length[:40]!r}")
            self._framing = _LENGTH
            self._left = int(length)
            self._done = self._left == 0
            return
        self._framing = _UNTIL_CLOSE
        self._reusable = False

    def _feed_body(self, data: bytes) -> None:
        if self._framing == _LENGTH:
            take = self._left
            if len(data) > take:
                self._reusable = False
                data = data[:take]
            self._add(data)
            self._left -= len(data)
            self._done = self._left == 0
        elif self._framing == _CHUNKED:
            self._feed_chunked(data)
        else:
            self._add(data)

    def _add(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self._buffered += len(data)

    def _feed_chunked(self, data: bytes) -> None:
        """Decode chunked bytes; a chunk that is here whole (the usual case) takes one step."""
        buf = self._rest + data if self._rest else data
        pos, end = 0, len(buf)
        pieces = self._pieces
        added = 0
        state = self._chunk_state
        left = self._left
        while pos < end:
            if state == _SIZE:
                line_end = buf.find(b"\r\n", pos)
                if line_end < 0:
                    if end - pos > MAX_LINE_BYTES:
                        raise UpstreamBroken("chunk line too long")
                    break
                size = _chunk_size(buf[pos:line_end])
                pos = line_end + 2
                if size == 0:
                    state = _TRAILER
                    continue
                stop = pos + size
                if stop + 2 <= end:  # the whole chunk and its CRLF
                    if buf[stop] != 13 or buf[stop + 1] != 10:
                        raise UpstreamBroken("chunk not followed by CRLF")
                    pieces.append(buf[pos:stop])
                    added += size
                    pos = stop + 2
                else:
                    state = _DATA
                    left = size
            elif state == _DATA:
                take = left if left < end - pos else end - pos
                pieces.append(buf[pos : pos + take] if pos or take < end else buf)
                added += take
                pos += take
                left -= take
                if left:
                    break
                state = _DATA_END
            elif state == _DATA_END:
                if end - pos < 2:
                    break
                if buf[pos] != 13 or buf[pos + 1] != 10:
                    raise UpstreamBroken("chunk not followed by CRLF")
                pos += 2
                state = _SIZE
            else:  # _TRAILER: header lines, then an empty line
                line_end = buf.find(b"\r\n", pos)
                if line_end < 0:
                    if end - pos > MAX_LINE_BYTES:
                        raise UpstreamBroken("chunk trailer line too long")
                    break
                done = line_end == pos
                self._trailer += line_end + 2 - pos
                if self._trailer > MAX_TRAILER_BYTES:
                    raise UpstreamBroken("chunk trailers too large")
                pos = line_end + 2
                if done:
                    self._done = True
                    if pos < end:
                        self._reusable = False  # bytes after the last chunk
                    break
        self._chunk_state = state
        self._left = left
        self._buffered += added
        self._rest = b"" if self._done or pos >= end else buf[pos:]

    # ------------------------------------------------------------------ waiting
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        """The answer cannot complete: remember why, drop the connection, wake the reader."""
        if self._error is None:
            self._error = error
        self.close()
        self._wake()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = None
        if self._silence is not None:
            timer = self._loop.call_later(self._silence, self._on_silence)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _on_silence(self) -> None:
        self._fail(UpstreamTimeout(f"sent nothing for {self._silence:g}s"))

    def _on_deadline(self) -> None:
        self._deadline = None
        self._fail(UpstreamTimeout("did not answer in time"))

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    # ------------------------------------------------------------------ the request
    def start(
        self, data: bytes | list[bytes], deadline: float | None, silence: float | None
    ) -> None:
        self._reset()
        self._busy = True
        self._streaming = False
        self._silence = silence
        if deadline is not None:
            self._deadline = self._loop.call_at(deadline, self._on_deadline)
        assert self.transport is not None
        if isinstance(data, list):
            self.transport.writelines(data)
        else:
            self.transport.write(data)

    async def wait_head(self) -> None:
        while not self._head_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take()

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the end.

        Bytes that arrived before a failure are returned first; the failure is raised after.
        """
        self._streaming = True
        while not self._pieces:
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take()

    def at_eof(self) -> bool:
        """The whole body has arrived and been taken."""
        return self._done and not self._pieces

    def _take(self) -> bytes:
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        if self._paused and not self.closed:
            assert self.transport is not None
            self.transport.resume_reading()
            self._paused = False
        return data

    def release(self) -> None:
        """Back to the pool when the answer was read to its end; otherwise closed."""
        self._cancel_deadline()
        self._busy = False
        if self._done and self._reusable and self._error is None and not self.closed:
            self._reset()
            self.reused = True
            if self._paused:  # the last bytes were left unread: read again before reuse
                assert self.transport is not None
                self.transport.resume_reading()
                self._paused = False
            self._upstream._park(self)
        else:
            self.close()

    def close(self) -> None:
        self._cancel_deadline()
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()  # no graceful close: a leg cut short must stop the backend
