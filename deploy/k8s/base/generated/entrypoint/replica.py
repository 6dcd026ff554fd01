"""Which replica of its role this server is: KIT_REPLICA_INDEX when set, else compose's container
number, which Docker's embedded DNS names (a PTR query for the container's own address answers
``<project>-<service>-<n>.<network>``), and the GPUs that index gives it (placement()).

The number is only a preference for the slot lease (slots.py); placement() then follows the slot
that was leased. Standard library only at import (dnspython, which vLLM brings, is imported when
the lookup runs).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from .gpus import (
    REPLICA_INDEX_ENV,
    ROLE_GPUS_ENV,
    gpus_per_replica,
    replica_count,
    replica_gpus,
    role_knobs,
    split_ids,
)

# Compose's container name ends in its number: <project>-<service>-<n> (v1: underscores).
_CONTAINER_NUMBER = re.compile(r"[-_]([0-9]+)$")
# Docker's embedded DNS server, the nameserver of containers on user-defined networks.
DOCKER_DNS = "127.0.0.11"
RESOLV_CONF = Path("/etc/resolv.conf")
PTR_TIMEOUT_S = 5.0


def index_from_name(name: str) -> int | None:
    """The container number in a PTR answer of Docker's DNS: ``pcp-pd-kit-prefill-2.
    pcp-pd-kit_pd.`` gives 2 (the first label is the container's name); None without one."""
    label = name.strip().split(".", 1)[0]
    match = _CONTAINER_NUMBER.search(label)
    return int(match.group(1)) if match else None


def nameservers(resolv_conf: str) -> list[str]:
    """The nameservers of a resolv.conf text, in order."""
    found = []
    for line in resolv_conf.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            found.append(words[1])
    return found


def ptr_names(
    address: str, servers: Sequence[str], port: int = 53, timeout: float = PTR_TIMEOUT_S
) -> list[str]:
    """The PTR names of ``address`` asked of ``servers`` (not /etc/hosts, whose entry for the
    container's own address is its short id). dnspython comes with vLLM (fastapi[standard]),
    imported here so the module itself stays standard library only."""
    try:
        import dns.exception
        import dns.resolver
        import dns.reversename
    except ImportError:
        raise ValueError(
            f"dnspython is not installed in this image, so the replica index cannot be looked "
            f"up: set {REPLICA_INDEX_ENV}"
        ) from None
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = list(servers)
    resolver.port = port
    resolver.timeout = resolver.lifetime = timeout
    try:
        answer = resolver.resolve(dns.reversename.from_address(address), "PTR")
    except dns.exception.DNSException as exc:
        raise ValueError(
            f"reverse DNS of this container's address {address} at {', '.join(servers)} "
            f"failed ({exc.__class__.__name__}: {exc})"
        ) from None
    return [record.to_text() for record in answer]


def looked_up_index(
    address: Callable[[], str] = lambda: own_address(),
    resolv_conf: Path = RESOLV_CONF,
    port: int = 53,
    timeout: float = PTR_TIMEOUT_S,
) -> int:
    """This container's number from Docker's embedded DNS: a PTR query for its own address
    answers its container name, ``<project>-<service>-<n>.<network>``."""
    ip = address()
    try:
        servers = nameservers(resolv_conf.read_text()) or [DOCKER_DNS]
    except OSError:
        servers = [DOCKER_DNS]
    names = ptr_names(ip, servers, port, timeout)
    found = {index for index in map(index_from_name, names) if index is not None}
    if len(found) != 1:
        raise ValueError(
            f"reverse DNS of {ip} answered {names or 'nothing'}, with no single container "
            f"number in it (want <project>-<service>-<n>)"
        )
    return found.pop()


def replica_index(
    env: Mapping[str, str], replicas: int, lookup: Callable[[], int] = looked_up_index
) -> int:
    """This replica's index (1-based): KIT_REPLICA_INDEX when set; 1 with one replica (no
    lookup); else compose's container number, looked up (ValueError naming the way out)."""
    raw = env.get(REPLICA_INDEX_ENV, "").strip()
    if raw:
        if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
            raise ValueError(f"{REPLICA_INDEX_ENV}={raw!r}: want an integer >= 1")
        return int(raw)
    if replicas == 1:
        return 1
    try:
        return lookup()
    except ValueError as exc:
        raise ValueError(
            f"{exc}: cannot tell which of the {replicas} replicas ({role_knobs(env).replicas}) "
            f"this is, so which GPUs are its own; set {REPLICA_INDEX_ENV} to override"
        ) from None


def own_address() -> str:
    """This container's address on its network: Docker maps the hostname to it in /etc/hosts."""
    return socket.gethostbyname(socket.gethostname())


class Placement(NamedTuple):
    """Which replica this server is and the host GPU ids it uses (none: the cpu profile, or a
    Kubernetes pod, whose GPUs come from the device plugin)."""

    replica: int
    replicas: int
    gpus: list[str]


def placement(
    env: Mapping[str, str], argv: Sequence[str], lookup: Callable[[], int] = looked_up_index
) -> Placement:
    """This replica's index and its slice of KIT_ROLE_GPUS, TP x PCP x PP ids (from ``argv``,
    the server's vLLM flags) per replica. Without KIT_ROLE_GPUS no GPUs, and the index is only
    looked up for the start-up line (a failed lookup gives 0: unknown)."""
    replicas = replica_count(env)
    role_gpus = split_ids(env.get(ROLE_GPUS_ENV, ""))
    if not role_gpus:
        try:
            return Placement(replica_index(env, replicas, lookup), replicas, [])
        except ValueError:
            return Placement(0, replicas, [])
    index = replica_index(env, replicas, lookup)
    gpus = replica_gpus(role_gpus, replicas, gpus_per_replica(argv), index, role_knobs(env))
    return Placement(index, replicas, gpus)
