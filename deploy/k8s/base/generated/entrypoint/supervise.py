"""vLLM as this process's child: its exit turned into the container's, stops passed on, the
network watched, its stdout relayed.

vLLM's API server exits 0 when its engine dies, so the wrapper decides what a crash is (an exit
nobody asked for, counted for the crash-loop bound) and what a stop is (SIGTERM/SIGINT passed on).
UCX binds to the network interfaces it finds at start, so one that goes away (`docker network
disconnect`, even when reconnected: it comes back under another name) leaves NIXL unable to
connect to any new peer while /health stays green; the server is then stopped and the container
exits 1, so the restart policy starts it on the interfaces it has now.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .console import log
from .crash_loop import record_exit

NETWORK_POLL_S = 2.0
RELAY_DRAIN_S = 10.0  # how long vLLM's last stdout lines may take to pass through at its exit
if TYPE_CHECKING:  # an alias for annotations only: the package keeps Python 3.8 syntax
    Interfaces = frozenset[tuple[int, str]]


def exit_status(returncode: int, stop_requested: bool) -> int:
    """The container's exit status for vLLM's ``returncode``.

    vLLM's API server shuts down with status 0 when its engine core dies (EngineDeadError), so
    `restart: on-failure` would never bring a crashed server back: a vLLM that exits without
    having been asked to stop is a failure (1). A signal death keeps the shell's 128 + signal.
    """
    if returncode < 0:
        return 128 - returncode
    if returncode == 0 and not stop_requested:
        return 1
    return returncode


def network_interfaces() -> Interfaces:
    """This container's network interfaces but loopback, as (index, name)."""
    return frozenset(i for i in socket.if_nameindex() if i[1] != "lo")


def interface_change(before: Interfaces, now: Interfaces) -> str | None:
    """What changed since vLLM started, or None. A changed set means UCX's is stale: it keeps
    the interfaces (by name) it found at start, so a removed or replaced one cannot carry a new
    NIXL connection."""
    gone = sorted(name for _, name in before - now)
    new = sorted(name for _, name in now - before)
    if not gone and not new:
        return None
    parts = [f"{label} {', '.join(names)}" for label, names in (("gone:", gone), ("new:", new))]
    return "; ".join(p for p in parts if not p.endswith(" "))


def supervise(
    cmd: Sequence[str],
    env: Mapping[str, str],
    interfaces: Callable[[], Interfaces] = network_interfaces,
    poll_s: float = NETWORK_POLL_S,
    crash_file: Path | None = None,
    pass_fds: Sequence[int] = (),
    watch: Callable[[str], None] | None = None,
) -> int:
    """Run vLLM as this process's child, pass on SIGTERM/SIGINT (compose stop, Ctrl-C, the
    engine's own shutdown), stop it when the network interfaces change under it, and return the
    container's exit status (``exit_status``; 1 after a network change). With ``crash_file``
    every exit is recorded there for the crash-loop bound (an unasked one counts). vLLM inherits
    ``pass_fds`` (the slot lease: held while any of its processes lives). With ``watch``, vLLM's
    stdout passes through here line by line (UCX prints its protocol tables there)."""
    started = time.monotonic()
    status, crashed, reason = _supervise(cmd, env, interfaces, poll_s, pass_fds, watch)
    if crash_file is not None:
        record_exit(crash_file, crashed, time.monotonic() - started, reason)
    return status


def _supervise(
    cmd: Sequence[str],
    env: Mapping[str, str],
    interfaces: Callable[[], Interfaces],
    poll_s: float,
    pass_fds: Sequence[int] = (),
    watch: Callable[[str], None] | None = None,
) -> tuple[int, bool, str]:
    """supervise()'s loop: (exit status, whether the exit was unasked, why)."""
    at_start = interfaces()
    out = subprocess.PIPE if watch else None
    child = subprocess.Popen(list(cmd), env=dict(env), pass_fds=tuple(pass_fds), stdout=out)
    relayer = None
    if watch and child.stdout is not None:
        relayer = threading.Thread(target=relay, args=(child.stdout, watch), daemon=True)
        relayer.start()
    stop_requested = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            returncode = child.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            change = None if stop_requested else interface_change(at_start, interfaces())
            if change:
                log(
                    f"network interfaces changed since start ({change}): UCX cannot open new "
                    "NIXL connections on them; stopping vLLM and exiting 1 so the restart policy "
                    "starts it on the current interfaces"
                )
                child.send_signal(signal.SIGTERM)
                child.wait()
                drain(relayer)
                return 1, True, f"network interfaces changed ({change})"
    drain(relayer)
    status = exit_status(returncode, stop_requested)
    if status != returncode:
        log(
            f"vLLM exited with {returncode} without being asked to stop (its engine died?): "
            f"exiting {status} so the restart policy restarts the container"
        )
    return status, not stop_requested, f"vLLM exited with {returncode}"


def drain(relayer: threading.Thread | None) -> None:
    """Let the relay pass on what vLLM printed last (its crash's traceback, UCX's last table)
    before the container exits; bounded, since a worker vLLM left behind may hold the pipe."""
    if relayer is not None:
        relayer.join(RELAY_DRAIN_S)


def relay(stream: IO[bytes], watch: Callable[[str], None]) -> None:
    """Copy vLLM's stdout to ours, handing each line to ``watch`` (which must not raise)."""
    for raw in iter(stream.readline, b""):
        sys.stdout.buffer.write(raw)
        sys.stdout.flush()
        try:
            watch(raw.decode(errors="replace"))
        except Exception as exc:  # a watcher bug must never stop the relay (vLLM would block)
            log(f"UCX output watcher failed ({exc.__class__.__name__}: {exc})")
            watch = _ignore


def _ignore(_line: str) -> None:
    return None
