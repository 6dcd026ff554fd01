"""pd_proxy.http.upstream, the legs' HTTP/1.1 client, on scripted servers: framing, reuse,
errors."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest

from pd_proxy.backends.pool import Backend
from pd_proxy.http.connection import (
    HIGH_WATER,
    ConnectFailed,
    Connection,
    Reply,
    StaleConnection,
    UpstreamBroken,
    UpstreamTimeout,
)
from pd_proxy.http.upstream import Upstream
from tests.support.net import free_port, unaccepting_port
from tests.support.waits import until

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
            # After the script: count a client that closes the connection.
            if not writer.is_closing():
                if await reader.read() == b"":
                    self.closed_by_client += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_client += 1
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request (head and Content-Length body), or None when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body


@asynccontextmanager
async def serving(make_script: Callable[[Server], Script], **upstream_options):
    server = Server(None)  # type: ignore[arg-type]
    server.script = make_script(server)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = srv.sockets[0].getsockname()[1]
    upstream = Upstream(
        upstream_options.pop("connect_timeout", 2.0),
        upstream_options.pop("keepalive", 30.0),
        **upstream_options,
    )
    try:
        yield server, upstream
    finally:
        upstream.close()
        srv.close()


def request_bytes(port: int, body: bytes = b'{"prompt": "x"}') -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body)
    )


def answering(*answers: bytes, close: bool = False) -> Callable[[Server], Script]:
    """A server that answers each request with the next of ``answers`` (then the last again)."""

    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            i = 0
            while await server.read_request(reader) is not None:
                writer.write(answers[min(i, len(answers) - 1)])
                await writer.drain()
                i += 1
                if close:
                    writer.close()
                    return

        return script

    return make


JSON_200 = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'


async def call(server: Server, upstream: Upstream, read: str = "read", **kw) -> tuple[int, bytes]:
    address = ("127.0.0.1", server.port, False)
    conn = await upstream.request(address, request_bytes(server.port), **kw)
    try:
        if read == "read":
            body = await conn.read()
        else:
            pieces = []
            while piece := await conn.readany():
                pieces.append(piece)
            body = b"".join(pieces)
            assert conn.at_eof()
        return conn.status, body
    finally:
        conn.release()


async def test_content_length_answers_reuse_one_connection():
    async with serving(answering(JSON_200)) as (server, upstream):
        for _ in range(3):
            assert await call(server, upstream) == (200, b'{"a":1}')
        assert server.connections == 1 and upstream.opened == 1
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        conn = await upstream.request(("127.0.0.1", server.port, False), request_bytes(server.port))
        assert conn.headers["content-type"] == "application/json"  # names in lower case
        await conn.read()
        conn.release()


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"7\r\ndata: a\r\n"
    b"A;ext=1\r\n\n\ndata: bb\r\n"
    b"1\r\n\n\r\n"
    b"0\r\nX-Trailer: yes\r\n\r\n"
)
CHUNKED_BODY = b"data: a\n\ndata: bb\n"


@pytest.mark.parametrize("read", ["read", "readany"])
async def test_chunked_answers_split_at_every_byte_decode_the_same(read):
    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            while await server.read_request(reader) is not None:
                for i in range(len(CHUNKED)):  # one byte per segment
                    writer.write(CHUNKED[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(0)

        return script

    async with serving(make) as (server, upstream):
        for _ in range(2):
            assert await call(server, upstream, read) == (200, CHUNKED_BODY)
        assert server.connections == 1  # trailers read to the end: reusable


async def test_chunked_answer_in_one_piece_and_interim_1xx_skipped():
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED
    async with serving(answering(answer)) as (server, upstream):
        assert await call(server, upstream, "readany") == (200, CHUNKED_BODY)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end",  # no framing
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 13\r\n\r\nuntil the end",
        b"HTTP/1.0 200 OK\r\nContent-Length: 13\r\n\r\nuntil the end",
    ],
)
async def test_answers_that_end_the_connection_are_read_and_not_reused(answer):
    async with serving(answering(answer, close=True)) as (server, upstream):
        for _ in range(2):
            assert await call(server, upstream) == (200, b"until the end")
        assert server.connections == 2


async def test_no_content_answer():
    async with serving(answering(b"HTTP/1.1 204 No Content\r\n\r\n")) as (server, upstream):
        assert await call(server, upstream) == (204, b"")
        assert await call(server, upstream) == (204, b"")
        assert server.connections == 1


async def test_bytes_after_the_answer_make_the_connection_single_use():
    async with serving(answering(JSON_200 + b"junk")) as (server, upstream):
        assert await call(server, upstream) == (200, b'{"a":1}')
        assert await call(server, upstream) == (200, b'{"a":1}')
        assert server.connections == 2


async def test_a_stream_cut_short_gives_its_bytes_then_broken():
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b"
    async with serving(answering(answer, close=True)) as (server, upstream):
        conn = await upstream.request(("127.0.0.1", server.port, False), request_bytes(server.port))
        try:
            assert await conn.readany() == b"only ten b"
            with pytest.raises(UpstreamBroken, match="before the end"):
                await conn.readany()
        finally:
            conn.release()
        assert upstream.idle_count() == 0


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"", "before the end"),  # closed without an answer
        (b"hello there\r\n\r\n", "not an HTTP/1.x answer"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "conflicting"),
    ],
)
async def test_broken_heads_raise(answer, message):
    async with serving(answering(answer, close=True)) as (server, upstream):
        with pytest.raises(UpstreamBroken, match=message):
            await call(server, upstream)


@pytest.mark.parametrize(
    "body",
    [b"zz\r\nab\r\n0\r\n\r\n", b"-1\r\nab\r\n0\r\n\r\n", b"2\r\nabXX0\r\n\r\n", b"0x2\r\nab\r\n"],
)
async def test_broken_chunked_bodies_raise(body):
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    async with serving(answering(answer)) as (server, upstream):
        with pytest.raises(UpstreamBroken):
            await call(server, upstream, "readany")
        assert upstream.idle_count() == 0


async def test_refused_connection_is_connect_failed():
    port = free_port()
    upstream = Upstream(1.0, 30.0)
    with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
        await upstream.request(("127.0.0.1", port, False), request_bytes(port))


async def test_a_connect_the_legs_deadline_cuts_short_is_a_timeout_not_unreachable():
    """The leg running out of time during the connect (a loaded host) is the leg's timeout: a
    ConnectFailed there would take a healthy backend out of rotation. The connect's own limit
    running out is still ConnectFailed."""
    with unaccepting_port() as port:
        address = ("127.0.0.1", port, False)
        upstream = Upstream(30.0, 30.0)
        with pytest.raises(UpstreamTimeout, match="while connecting"):
            await upstream.request(
                address, request_bytes(port), deadline=upstream.loop.time() + 0.3
            )
        upstream.close()
        upstream = Upstream(0.3, 30.0)
        with pytest.raises(ConnectFailed, match="timed out after 0.3s"):
            await upstream.request(
                address, request_bytes(port), deadline=upstream.loop.time() + 30.0
            )
        upstream.close()


def hanging(server: Server) -> Script:
    async def script(reader, writer) -> None:
        await server.read_request(reader)
        await reader.read()  # never answers; returns when the client closes

    return script


async def test_deadline_times_out_and_closes_the_connection():
    async with serving(hanging) as (server, upstream):
        # It bounds the connect too: 1 s, so a stalled (loaded) host cannot make it a
        # ConnectFailed before the request is even sent.
        deadline = upstream.loop.time() + 1.0
        with pytest.raises(UpstreamTimeout, match="in time"):
            await call(server, upstream, deadline=deadline)
        await until(lambda: server.closed_by_client == 1, "the server to see the close", timeout=30)
        assert server.closed_by_client == 1 and upstream.idle_count() == 0


async def test_silence_between_chunks_times_out():
    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
            await writer.drain()
            await reader.read()

        return script

    async with serving(make) as (server, upstream):
        # The head and first chunk must beat the limit though they need the server's turn on
        # this loop first: 1 s, not 0.2 s, so a stalled (loaded) host cannot fire it early.
        conn = await upstream.request(
            ("127.0.0.1", server.port, False), request_bytes(server.port), silence=1.0
        )
        try:
            assert await conn.readany() == b"one"
            with pytest.raises(UpstreamTimeout, match="sent nothing for 1s"):
                await conn.readany()
        finally:
            conn.release()


async def test_cancelled_request_closes_its_connection():
    async with serving(hanging) as (server, upstream):
        task = asyncio.create_task(call(server, upstream))
        while not server.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: server.closed_by_client == 1, "the server to see the close", timeout=30)
        assert server.closed_by_client == 1 and upstream.idle_count() == 0


async def test_a_body_not_read_to_its_end_closes_instead_of_pooling():
    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            while await server.read_request(reader) is not None:
                writer.write(JSON_200[:-3])
                await writer.drain()
                await asyncio.sleep(0.2)
                writer.write(JSON_200[-3:])
                await writer.drain()

        return script

    async with serving(make) as (server, upstream):
        conn = await upstream.request(("127.0.0.1", server.port, False), request_bytes(server.port))
        conn.release()  # the rest of the body has not arrived: never reuse
        assert await call(server, upstream) == (200, b'{"a":1}')
        assert upstream.opened == 2
        # A body that arrived whole may be left unread: the connection is clean.
        conn = await upstream.request(("127.0.0.1", server.port, False), request_bytes(server.port))
        await until(lambda: conn._done, "the rest of the body to arrive", timeout=30)
        conn.release()
        assert await call(server, upstream) == (200, b'{"a":1}')
        assert upstream.opened == 2


async def test_idle_connections_expire():
    async with serving(answering(JSON_200), keepalive=0.1) as (server, upstream):
        await call(server, upstream)
        assert upstream.idle_count() == 1
        await asyncio.sleep(0.35)  # the sweeper closed it
        assert upstream.idle_count() == 0
        await call(server, upstream)
        assert server.connections == 2


async def test_a_backend_closing_an_idle_connection_is_noticed():
    async with serving(answering(JSON_200, close=True)) as (server, upstream):
        await call(server, upstream)
        # closed by the server: not offered again
        await until(
            lambda: upstream.idle_count() == 0, "the server's close to be noticed", timeout=30
        )
        await call(server, upstream)


async def test_slow_reader_pauses_the_socket_and_loses_nothing():
    piece = bytes(range(256)) * 256  # 64 KiB
    count = 4 * HIGH_WATER // len(piece)

    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(count):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()

        return script

    async with serving(make) as (server, upstream):
        conn = await upstream.request(("127.0.0.1", server.port, False), request_bytes(server.port))
        received: list[bytes] = []
        paused = False
        try:
            while data := await conn.readany():
                received.append(data)
                await asyncio.sleep(0.02)  # slower than the server
                paused = paused or conn._paused
        finally:
            conn.release()
        assert b"".join(received) == piece * count
        assert paused


async def test_large_bodies_go_out_whole():
    body = b'{"prompt": "' + b"x" * 300_000 + b'"}'
    async with serving(answering(JSON_200)) as (server, upstream):
        head = request_bytes(server.port, body)[: -len(body)]
        conn = await upstream.request(("127.0.0.1", server.port, False), [head, body])
        try:
            assert await conn.read() == b'{"a":1}'
        finally:
            conn.release()
        assert server.requests[0].endswith(body)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_https_backend(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server = Server(None)  # type: ignore[arg-type]
    server.script = answering(JSON_200)(server)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.sockets[0].getsockname()[1]
    try:
        trusting = Upstream(2.0, 30.0, ssl_context=ssl.create_default_context(cafile=str(cert)))
        for _ in range(2):
            conn = await trusting.request(("localhost", port, True), request_bytes(port))
            assert await conn.read() == b'{"a":1}'
            conn.release()
        assert trusting.opened == 1
        trusting.close()
        default = Upstream(2.0, 30.0)  # the system's CAs: the self-signed cert fails
        with pytest.raises(ConnectFailed):
            await default.request(("localhost", port, True), request_bytes(port))
    finally:
        srv.close()


class FakeTransport:
    def __init__(self) -> None:
        self.paused = False
        self.aborted = False
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


async def test_a_paused_connection_whose_answer_completed_reads_again_when_pooled():
    upstream = Upstream(1.0, 30.0)
    conn = Connection(upstream, ("h", 1, False))
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.start(b"request", None, None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    reading = asyncio.create_task(conn.readany())
    await asyncio.sleep(0)
    conn.data_received(b"1\r\na\r\n")
    assert await reading == b"a"
    big = b"x" * (HIGH_WATER + 1)
    conn.data_received(b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))  # ends the answer, pauses
    assert transport.paused and not conn.at_eof()
    conn.release()  # the handler left without the last bytes (its client went away)
    assert not transport.paused and not transport.aborted
    assert upstream.idle_count() == 1
    upstream.close()
    assert transport.aborted


async def test_eof_from_the_backend_retires_the_connection_at_once():
    upstream = Upstream(1.0, 30.0)
    conn = Connection(upstream, ("h", 1, False))
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    conn.start(b"request", None, None)
    conn.data_received(JSON_200)
    assert await conn.read() == b'{"a":1}'
    conn.release()
    assert upstream.idle_count() == 1
    assert conn.eof_received() is False  # the transport closes; connection_lost comes later
    assert upstream.idle_count() == 0


def _decode_in_pieces(wire: bytes, cuts: list[int]) -> tuple[bytes, Connection]:
    upstream = Upstream(1.0, 30.0, loop=asyncio.new_event_loop())
    conn = Connection(upstream, ("h", 1, False))
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    conn.start(b"request", None, None)
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        conn.data_received(wire[a:b])
    body = b"".join(conn._pieces)
    upstream.loop.close()
    return body, conn


def test_chunked_decoding_of_random_chunks_cut_anywhere():
    import random

    rng = random.Random(7)
    for _ in range(300):
        body_parts = [rng.randbytes(rng.choice([1, 2, 15, 16, 17, 255, 4096])) for _ in range(5)]
        wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        for part in body_parts:
            ext = rng.choice([b"", b";a=1", b" ;x"])
            wire += b"%s%s\r\n%s\r\n" % (format(len(part), rng.choice("xX")).encode(), ext, part)
        wire += b"0\r\n" + rng.choice([b"", b"T: 1\r\n", b"A: b\r\nC: d\r\n"]) + b"\r\n"
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randint(0, min(12, len(wire) - 1))))
        body, conn = _decode_in_pieces(wire, cuts)
        assert body == b"".join(body_parts)
        assert conn.at_eof() is False and conn._done and conn._reusable  # pieces not taken yet


# ----------------------------------------------------------------------------- the gaps closed
async def test_transfer_encoding_with_content_length_is_broken_and_not_kept():
    """RFC 9112 section 6.3: both framings in one answer is an error, and the connection goes."""
    both = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'7\r\n{"a":1}\r\n0\r\n\r\n'
    )

    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            while await server.read_request(reader) is not None:
                writer.write(both if server.connections == 1 else JSON_200)
                await writer.drain()

        return script

    async with serving(make) as (server, upstream):
        with pytest.raises(UpstreamBroken, match="both Transfer-Encoding and Content-Length"):
            await call(server, upstream)
        assert await call(server, upstream) == (200, b'{"a":1}')
        assert server.connections == 2 and upstream.opened == 2


async def test_trailers_have_a_total_limit():
    """Each trailer line is short, but together they never end: broken, not a hang."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    line = b"X-Pad: " + b"p" * 1000 + b"\r\n"

    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            await server.read_request(reader)
            writer.write(head)
            for _ in range(200):  # about 200 kB of trailer lines, no end
                writer.write(line)
                await writer.drain()
            await asyncio.sleep(30)

        return script

    async with serving(make) as (server, upstream):
        with pytest.raises(UpstreamBroken, match="trailers too large"):
            await asyncio.wait_for(call(server, upstream, silence=20.0), 10)


async def test_read_has_a_body_size_limit():
    body = b"x" * 5000
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with serving(answering(answer), max_body=4096) as (server, upstream):
        with pytest.raises(UpstreamBroken, match="over 4096 bytes"):
            await call(server, upstream)
    async with serving(answering(answer), max_body=8192) as (server, upstream):
        assert await call(server, upstream) == (200, body)


async def test_a_reused_connection_closed_before_any_answer_is_stale():
    """The backend read the second request and closed the connection without a byte: that is
    ``StaleConnection`` (the request may go again), and the idle connections to it are dropped."""

    def make(server: Server) -> Script:
        async def script(reader, writer) -> None:
            await server.read_request(reader)
            writer.write(JSON_200)
            await writer.drain()
            await server.read_request(reader)
            writer.close()  # unanswered

        return script

    async with serving(make) as (server, upstream):
        assert await call(server, upstream) == (200, b'{"a":1}')
        with pytest.raises(StaleConnection):
            await call(server, upstream)
        assert upstream.idle_count() == 0
        assert await call(server, upstream) == (200, b'{"a":1}')  # a new connection
        assert server.connections == 2


# ------------------------------------------------------------------ the client against aiohttp's
class AiohttpReply:
    """aiohttp's client behind the ``Reply`` protocol: a second client to compare with, never
    used by the proxy."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.headers.items()}

    async def read(self) -> bytes:
        return await self._resp.read()

    async def readany(self) -> bytes:
        return await self._resp.content.readany()

    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    def release(self) -> None:
        self._resp.release()


async def drain(reply: Reply, read: str) -> tuple[int, str | None, bytes]:
    try:
        if read == "read":
            body = await reply.read()
        else:
            pieces = []
            while piece := await reply.readany():
                pieces.append(piece)
            body = b"".join(pieces)
        return reply.status, reply.headers.get("content-type"), body
    finally:
        reply.release()


@pytest.mark.parametrize("read", ["read", "readany"])
@pytest.mark.parametrize(
    "answer",
    [
        JSON_200,
        CHUNKED,
        b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED,
        b"HTTP/1.1 503 Busy\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nbusy",
        b"HTTP/1.1 204 No Content\r\n\r\n",
    ],
)
async def test_the_client_and_aiohttp_read_the_same_answers(answer, read):
    """Both clients behind the one ``Reply`` protocol, on the same scripted answers."""
    async with serving(answering(answer)) as (server, upstream):
        backend = Backend("decode", f"http://127.0.0.1:{server.port}")
        ours = await drain(await upstream.post(backend, "/v1/completions", {}, b"{}"), read)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(backend.endpoint("/v1/completions"), data=b"{}")
            theirs = await drain(AiohttpReply(resp), read)
    assert ours == theirs
    assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
