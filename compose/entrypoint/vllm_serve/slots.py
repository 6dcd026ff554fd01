"""A replica's slot (its share of the role's GPUs) by lease, not by compose's container number.

Why: compose numbers a new container max+1 (a `docker rm` then `up` gives number 3 of 2), keeps the
old number on `--force-recreate`, and a replica-count change recreates an arbitrary subset, so a
slot taken from the number can be out of range or shared. Here each replica takes an exclusive
``flock`` on ``<role>-slot-<i>`` in a folder every replica of the project mounts (compose's
``kit-slots`` volume) and keeps it for the server's life: the kernel releases it on any death,
SIGKILL included, and the vLLM process inherits the descriptor, so a server whose entrypoint died
still holds its GPUs until it is gone too. The container number is only the first slot tried, so
names and slots usually match. When every slot is held, the replica waits and says by whom; a
wait is not a crash, so it never reaches the entrypoint's crash-loop hold.
take_slot() is the entrypoint's step: the lease, or None without KIT_SLOT_DIR (Kubernetes: the
scheduler places pods). Standard library only (it runs before vLLM is imported).
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from .console import log
from .gpus import REPLICA_INDEX_ENV, role_knobs
from .kv_config import KV_ENV
from .replica import replica_index
from .stop_flag import StopFlag

SLOT_DIR_ENV = "KIT_SLOT_DIR"  # compose: the kit-slots volume; unset (Kubernetes): no lease
WAIT_LOG_EVERY_S = 30.0
POLL_S = 2.0
# KIT_KV_ROLE -> the word in the slot file names (the compose services' names).
ROLE_NAMES = {"kv_producer": "prefill", "kv_consumer": "decode"}


class Lease(NamedTuple):
    """Slot ``slot`` (1-based) held through the open descriptor ``fd`` on ``path``."""

    slot: int
    fd: int
    path: Path


def slot_path(folder: Path, role: str, index: int) -> Path:
    return folder / f"{ROLE_NAMES.get(role, role)}-slot-{index}"


def slot_order(replicas: int, preferred: int | None, pinned: int | None = None) -> list[int]:
    """The slots to try: only ``pinned`` (KIT_REPLICA_INDEX, set by hand) when given, else
    1..replicas with the preferred one (the container number) first when it is one of them."""
    if pinned is not None:
        return [pinned]
    order = list(range(1, replicas + 1))
    if preferred in order:
        order.remove(preferred)
        order.insert(0, preferred)
    return order


def try_slot(path: Path, owner: str) -> int | None:
    """An exclusive lock on ``path`` without waiting: its descriptor (the file then names
    ``owner``, for a waiting replica's message), or None while another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner.encode(), 0)
    return fd


def holder_of(path: Path) -> str:
    """Who wrote the slot file last (the holder while it is locked)."""
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def try_lease(folder: Path, role: str, order: Sequence[int], owner: str) -> Lease | None:
    """The first free slot of ``order``, leased; None when every one is held."""
    for index in order:
        path = slot_path(folder, role, index)
        fd = try_slot(path, owner)
        if fd is not None:
            return Lease(index, fd, path)
    return None


def waiting_message(folder: Path, role: str, order: Sequence[int], replicas: int, knob: str) -> str:
    """Why a replica waits, naming each held slot's holder and the way out."""
    held = ", ".join(f"slot {i} by {holder_of(slot_path(folder, role, i))}" for i in sorted(order))
    name = ROLE_NAMES.get(role, role)
    if len(order) < replicas:  # pinned by KIT_REPLICA_INDEX
        return (
            f"{name} slot {order[0]} (KIT_REPLICA_INDEX) is held ({held}): waiting for it to "
            "free instead of starting on GPUs another replica uses"
        )
    return (
        f"every {name} slot is held ({held}): {knob}={replicas}, so this container is one too "
        f"many. Waiting for a slot to free (a replica stopped or removed) instead of starting on "
        f"GPUs another replica uses; raise {knob} (and the GPU list) to run more, or scale this "
        "service back down"
    )


def lease_slot(
    folder: Path,
    role: str,
    order: Sequence[int],
    replicas: int,
    knob: str,
    wait: Callable[[float], bool],
    log: Callable[[str], None],
    owner: str | None = None,
    poll_s: float = POLL_S,
    log_every_s: float = WAIT_LOG_EVERY_S,
) -> Lease | None:
    """Lease the first free slot of ``order`` (slot_order()); while none is free, log why every
    ``log_every_s`` and poll. ``wait(seconds)`` sleeps and returns True when the
    container was asked to stop (then None: exit cleanly, nothing to release)."""
    folder.mkdir(parents=True, exist_ok=True)
    owner = owner or f"{socket.gethostname()} (pid {os.getpid()})"
    since_log = log_every_s
    while True:
        lease = try_lease(folder, role, order, owner)
        if lease is not None:
            return lease
        if since_log >= log_every_s:
            log(waiting_message(folder, role, order, replicas, knob))
            since_log = 0.0
        if wait(poll_s):
            return None
        since_log += poll_s


def preferred_slot(env: Mapping[str, str], replicas: int, lookup: Callable[[], int]) -> int | None:
    """The slot to try first: the container number (so names and slots usually match); None
    when it cannot be looked up (then any free slot: a lookup never decides alone)."""
    if replicas == 1:
        return 1
    try:
        return lookup()
    except ValueError as exc:
        log(f"container number unknown ({exc}): taking the first free slot")
        return None


def pinned_slot(env: Mapping[str, str]) -> int | None:
    """KIT_REPLICA_INDEX, the override: lease exactly that slot."""
    raw = env.get(REPLICA_INDEX_ENV, "").strip()
    return replica_index(env, 1) if raw else None


def take_slot(
    env: Mapping[str, str], replicas: int, stop: StopFlag, lookup: Callable[[], int]
) -> Lease | None:
    """This replica's slot lease, waiting while every slot is held; None
    without KIT_SLOT_DIR (Kubernetes: the scheduler places pods). SystemExit(0) when stopped
    while waiting."""
    folder = env.get(SLOT_DIR_ENV, "").strip()
    if not folder:
        return None
    pinned = pinned_slot(env)
    preferred = None if pinned else preferred_slot(env, replicas, lookup)
    order = slot_order(replicas, preferred, pinned)
    lease = lease_slot(
        Path(folder),
        env.get(KV_ENV["role"], "").strip(),
        order,
        replicas,
        role_knobs(env).replicas,
        wait=stop.wait,
        log=log,
    )
    if lease is None:
        log("stopped while waiting for a slot")
        raise SystemExit(0)
    return lease
