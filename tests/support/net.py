"""Free loopback ports for servers a test starts.

One range, away from the kernel's ephemeral ports, so a port chosen here is not taken a moment
later by some client socket's local end. A port is handed out once per test process: two calls
that each ask for "a free port" before anything binds must not both get the same one (a compose
run once published prefill and Prometheus on one port, and the stack test saw the wrong server).
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator

from pcp_pd_kit.localstack.host import port_is_free

PORT_RANGE = (17000, 17999)

_handed_out: set[int] = set()


def free_ports(count: int, skip: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct ports in PORT_RANGE that nothing listens on right now and that no
    earlier call in this process returned."""
    candidates = [p for p in range(*PORT_RANGE) if p not in skip and p not in _handed_out]
    random.shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        if port_is_free("127.0.0.1", port):
            ports.append(port)
            if len(ports) == count:
                _handed_out.update(ports)
                return ports
    raise RuntimeError(
        f"no {count} free ports left in {PORT_RANGE} ({len(_handed_out)} already handed out)"
    )


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


@contextlib.contextmanager
def unaccepting_port() -> Iterator[int]:
    """A loopback port whose accept queue is full: the kernel drops new SYNs, so a connect to it
    hangs (as to a backend whose host is saturated or whose packets are dropped)."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = full.getsockname()
        fillers: list[socket.socket] = []
        try:
            for _ in range(4):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(address)
                fillers.append(s)
            yield int(address[1])
        finally:
            for s in fillers:
                s.close()
