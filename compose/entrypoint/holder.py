"""The namespace holder's process: sleep until stopped, then drain the servers before exiting.

Why: prefill and decode join the holder's PID namespace (CUDA IPC needs it), and when the
holder's init exits the kernel SIGKILLs every process left in that namespace. With `sleep
infinity` a holder stop (an engine restart, `docker compose restart holder`, a reboot) killed
both servers mid-request. Here SIGTERM is passed on to the servers' entrypoints (the processes
whose parent lies outside the namespace: each joined container's first process), which pass it
to vLLM (it drains for --shutdown-timeout), and the holder exits only once they are gone or
KIT_HOLDER_DRAIN_S has passed. compose's stop_grace_period for the holder is longer than that.
It runs as root without capabilities: signalling the servers' root processes needs the same uid.
Standard library only (it runs in the pd-proxy image).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

DRAIN_ENV = "KIT_HOLDER_DRAIN_S"
DEFAULT_DRAIN_S = 75.0
PROC = Path("/proc")
POLL_S = 0.5


def parent_of(status_text: str) -> int | None:
    """PPid from a /proc/<pid>/status text."""
    for line in status_text.splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None


def joined_processes(proc: Path = PROC, own: Iterable[int] = ()) -> list[int]:
    """Processes whose parent is outside this PID namespace (PPid 0), but PID 1 and ``own``:
    the first process of every container that joined it."""
    skip = {1, *own}
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if parent_of((entry / "status").read_text()) == 0:
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return sorted(found)


def drain(
    targets: Callable[[], list[int]],
    kill: Callable[[int, int], None],
    limit_s: float,
    log: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[int]:
    """SIGTERM every target, then wait up to ``limit_s`` for them all to exit; the ones left."""
    first = targets()
    log(f"holder: stopping; passing SIGTERM to {len(first)} server process(es) {first}")
    for pid in first:
        try:
            kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError) as exc:
            log(f"holder: cannot signal {pid} ({exc.__class__.__name__})")
    deadline = clock() + limit_s
    left = [pid for pid in targets() if pid in first]
    while left and clock() < deadline:
        sleep(POLL_S)
        left = [pid for pid in targets() if pid in first]
    if left:
        log(f"holder: {left} still running after {limit_s:g}s: exiting (the kernel kills them)")
    else:
        log("holder: every server exited: done")
    return left


def drain_limit(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{DRAIN_ENV}={raw!r}: want seconds >= 0")
    return value


def main() -> None:
    limit = drain_limit(os.environ.get(DRAIN_ENV, str(DEFAULT_DRAIN_S)))
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    signal.sigwait(stops)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    drain(lambda: joined_processes(own=[os.getpid()]), os.kill, limit, log)


if __name__ == "__main__":
    main()
