"""The proxy's listening sockets: the one error both serving modes raise, and the port reservation
the ``--workers`` supervisor makes before it starts its workers.

Its own module so that pd_proxy.serve (one process) and pd_proxy.workers.supervisor (the
supervisor) can share
them without importing each other.
"""

from __future__ import annotations

import socket


class ListenError(Exception):
    """The listening socket could not be opened (port in use, bad address): a one-line error."""


def reserve_port(host: str, port: int, what: str = "") -> tuple[list[socket.socket], int]:
    """Bind ``host:port`` with SO_REUSEPORT, not listening: the port is ours, and workers that
    also set SO_REUSEPORT can listen on it. Port 0 becomes the port the kernel chose."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port}{what}: {exc}") from None
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _name, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio does
            sock.bind((addr[0], port, *addr[2:]))
            port = sock.getsockname()[1]
    except OSError as exc:
        for sock in socks:
            sock.close()
        raise ListenError(f"cannot listen on {host}:{port}{what}: {exc}") from None
    return socks, port
