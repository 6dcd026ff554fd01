"""A lean HTTP/1.1 client for the prefill and decode legs: pooled keep-alive connections
(pd_proxy.http.connection) and each backend's request head, built once per path.

aiohttp's client spends 150-200 us of CPU on each request in Python; the legs need far less: POST
a body with a few fixed headers on a pooled connection, read the head, and hand over the body whole
or as it arrives. Callers give a backend, a path, extra header fields (``Fields``) and the body
(``Upstream.post``, ``Upstream.get``) and get a ``Reply`` (pd_proxy.http.connection, which also
holds the errors a leg can meet). Health checks and ``/v1/models`` stay on aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from pd_proxy.http.connection import (
    LARGE_BODY,
    MAX_BODY_BYTES,
    MAX_CACHED_HEADS,
    Address,
    ConnectFailed,
    Connection,
    Reply,
    StaleConnection,
    UpstreamTimeout,
)

if TYPE_CHECKING:
    from pd_proxy.backends.pool import Backend


def _lines(headers: Mapping[str, str]) -> bytes:
    """Header lines for ``headers``; a value with a line break would split the head."""
    out = b""
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} must not contain line breaks")
        out += name.encode("ascii") + b": " + value.encode("utf-8", "surrogateescape") + b"\r\n"
    return out


class Fields(bytes):
    """Extra request header fields encoded once (``Fields.of``), for both legs of a request."""

    __slots__ = ()

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Fields:
        return cls(_lines(headers))


# What ``post`` and ``get`` take as extra header fields: a mapping, or one encoded by ``Fields``.
Headers = Mapping[str, str] | Fields


class Upstream:
    """Keep-alive connections to the backends, reused most-recent-first, dropped when idle.

    ``keepalive`` is how long an idle connection may wait for reuse; keep it under the backend's
    own idle timeout (uvicorn: 5 s), so a request never goes out on a socket the backend is closing.
    """

    def __init__(
        self,
        connect_timeout: float,
        keepalive: float,
        ssl_context: ssl.SSLContext | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        max_body: int = MAX_BODY_BYTES,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.max_body = max_body
        self._heads: dict[tuple[str, str, str], bytes] = {}  # (method, backend URL, path)
        self._ssl = ssl_context
        self._idle: dict[Address, list[Connection]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self.opened = 0  # connections opened, for tests and curiosity
        self._closed = False

    def post(
        self,
        backend: Backend,
        path: str,
        headers: Headers,
        body: bytes,
        *,
        deadline: float | None = None,
        silence: float | None = None,
    ) -> Coroutine[Any, Any, Reply]:
        """POST the JSON ``body`` to ``path`` on ``backend`` with ``headers`` added; await it for
        the ``Reply`` (see ``request`` for ``deadline`` and ``silence``). Not a coroutine itself:
        each coroutine frame costs the proxy about 1% of its CPU per request."""
        lines = headers if isinstance(headers, Fields) else _lines(headers)
        head = self._head("POST", backend, path) + lines
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        data = head + body if len(body) < LARGE_BODY else [head, body]
        return self.request(backend.address, data, deadline, silence)

    def get(
        self,
        backend: Backend,
        path: str,
        headers: Headers,
        deadline: float | None = None,
        silence: float | None = None,
    ) -> Coroutine[Any, Any, Reply]:
        """GET ``path`` on ``backend`` with ``headers`` added; await it for the ``Reply``."""
        lines = headers if isinstance(headers, Fields) else _lines(headers)
        head = self._head("GET", backend, path) + lines + b"\r\n"
        return self.request(backend.address, head, deadline, silence)

    def _head(self, method: str, backend: Backend, path: str) -> bytes:
        """The fixed start of a request: request line, Host, Accept (and Content-Type for a POST);
        cached."""
        key = (method, backend.url, path)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= MAX_CACHED_HEADS:  # backends come and go with discovery
                self._heads.clear()
            url = backend.endpoint(path)
            kind = "Accept: */*\r\nContent-Type: application/json\r\n"
            if method == "GET":
                kind = "Accept: */*\r\n"
            head = self._heads[key] = (
                f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n"
                + kind
            ).encode("ascii")
        return head

    async def request(
        self,
        address: Address,
        data: bytes | list[bytes],
        deadline: float | None = None,
        silence: float | None = None,
    ) -> Connection:
        """Send ``data`` (a whole request) and wait for the answer's head.

        ``deadline`` (a ``loop.time()``) bounds the whole leg, until ``release``; ``silence`` bounds
        each wait for the backend's bytes. The caller must ``release()`` the connection.
        """
        conn = self._acquire(address)
        if conn is None:
            conn = await self._connect(address, deadline)
        try:
            conn.start(data, deadline, silence)
            await conn.wait_head()
        except StaleConnection:
            conn.close()
            self._drop_idle(address)  # as old as the one that broke, or older
            raise
        except BaseException:
            conn.close()
            raise
        return conn

    def _drop_idle(self, address: Address) -> None:
        for conn in self._idle.pop(address, ()):
            conn.close()

    def _acquire(self, address: Address) -> Connection | None:
        idle = self._idle.get(address)
        if not idle:
            return None
        oldest = self.loop.time() - self.keepalive
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if conn.idle_since < oldest:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, address: Address, deadline: float | None) -> Connection:
        host, port, tls = address
        timeout = self.connect_timeout
        # A connect the leg's own deadline cut short says the leg ran out of time (a loaded
        # host, a short /tokenize limit), not that the backend is unreachable: that is a
        # timeout, and must not take a healthy backend out of rotation.
        cut_by_deadline = False
        if deadline is not None:
            left = max(0.0, deadline - self.loop.time())
            cut_by_deadline = left < timeout
            timeout = min(timeout, left)
        factory: Callable[[], Connection] = lambda: Connection(self, address)  # noqa: E731
        try:
            if tls:
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
                connecting = self.loop.create_connection(
                    factory, host, port, ssl=self._ssl, server_hostname=host
                )
            else:
                connecting = self.loop.create_connection(factory, host, port)
            _, conn = await asyncio.wait_for(connecting, timeout)
        except asyncio.TimeoutError:
            if cut_by_deadline:
                raise UpstreamTimeout(
                    f"the leg's time ran out in {timeout:g}s while connecting to {host}:{port}"
                ) from None
            raise ConnectFailed(
                f"cannot connect to {host}:{port}: timed out after {timeout:g}s"
            ) from None
        except OSError as exc:  # refused, unreachable, DNS (gaierror), TLS (SSLError)
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        self.opened += 1
        return conn

    def _park(self, conn: Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.address, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for longer than ``keepalive``."""
        self._sweeper = None
        oldest = self.loop.time() - self.keepalive
        for address, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if conn.closed:
                    continue
                if conn.idle_since < oldest:
                    conn.close()
                else:
                    keep.append(conn)
            if keep:
                self._idle[address] = keep
            else:
                del self._idle[address]
        if self._idle:
            self._sweeper = self.loop.call_later(self.keepalive, self._sweep)

    def idle_count(self) -> int:
        return sum(1 for idle in self._idle.values() for c in idle if not c.closed)

    def close(self) -> None:
        """Close the idle connections; those in use close when released."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
