"""Where the local stack lives on this host: its run directory and its loopback ports.

Port checks run before anything starts, so a taken port is one clear error instead of a server
that dies half-way through start-up.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from pcp_pd_kit import repo_root


class PortInUseError(RuntimeError):
    """One or more of the stack's ports is already bound by another process."""


def run_dir(root: Path | None = None) -> Path:
    """The gitignored directory for logs, generated configs and Prometheus data."""
    return (root or repo_root()) / "run"


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel has just given out on ``host``: free unless taken again meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
