"""Free loopback ports for servers a test starts.

One range, away from the kernel's ephemeral ports, so a port chosen here is not taken a moment
later by some client socket's local end.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator

from pcp_pd_kit.localstack.host import port_is_free

PORT_RANGE = (17000, 17999)


def free_ports(count: int, skip: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct ports in PORT_RANGE that nothing listens on right now."""
    candidates = [p for p in range(*PORT_RANGE) if p not in skip]
    random.shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        if port_is_free("127.0.0.1", port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports in {PORT_RANGE}")


def free_port(skip: tuple[int, ...] = ()) -> int:
    return free_ports(1, skip)[0]


def closed_port_url() -> str:
    """An http URL where nothing listens: a backend that is down."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port something listens on (but never answers) until the block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])
