"""Which host GPUs a replica uses and the ids CUDA sees for them inside the container.

Why here: CUDA IPC between the prefill and decode containers needs each to *see* both roles' GPUs
(mutual visibility) while using only its own, and the compose file cannot compute in-container
device indices (it gives both containers every host GPU: KIT_ALL_GPUS=all). With several replicas
of a role (PREFILL_REPLICAS / DECODE_REPLICAS) every replica gets the role's whole list and takes
its own slice: TP x PCP x PP ids, read from its own vLLM flags, at its replica index. Preflight
imports ROLE_KNOBS, replica_gpus() and gpus_per_replica() to apply the same rule to the .env
values. Standard library only, Python 3.8 syntax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .kv_config import KV_ENV

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
