"""Fail before starting anything when a port the stack needs is taken."""

from __future__ import annotations

import socket
from collections.abc import Mapping


class PortInUseError(RuntimeError):
    """One or more of the stack's ports is already bound by another process."""


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (bind test, so it also catches non-HTTP users)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ensure_ports_free(host: str, ports: Mapping[str, int]) -> None:
    """Raise PortInUseError naming every busy port and the stack part that needs it."""
    busy = [f"{name} port {port}" for name, port in ports.items() if not port_is_free(host, port)]
    if busy:
        raise PortInUseError(
            f"already in use on {host}: {', '.join(busy)}. Stop whatever holds them "
            "(e.g. `ss -ltnp`) or pick other ports in .env (LOCAL_*_PORT)."
        )
