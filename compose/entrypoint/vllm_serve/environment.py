"""The environment vLLM starts with: this replica's NIXL side-channel host, its GPUs as CUDA sees
them inside the container, the secret files' values, and its tracing service name.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence

from .gpus import cuda_visible_devices, split_ids
from .replica import looked_up_index, own_address, placement
from .secret_files import secret_environment
from .tracing import tracing_environment

# The NIXL handshake host vLLM publishes to decode (vllm.envs); see side_channel_host().
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"


def side_channel_host(env: Mapping[str, str], address: Callable[[], str]) -> dict[str, str]:
    """VLLM_NIXL_SIDE_CHANNEL_HOST when it is unset: this replica's own address.

    The prefill publishes this host in every request's kv_transfer_params (remote_host) and binds
    its handshake listener to it, so it must name this one replica: with several replicas a
    service name resolves to all of them. Kubernetes sets the pod IP; compose leaves it to here.
    """
    if env.get(SIDE_CHANNEL_HOST_ENV):
        return {}
    return {SIDE_CHANNEL_HOST_ENV: address()}


def serve_environment(
    env: Mapping[str, str],
    address: Callable[[], str] = own_address,
    argv: Sequence[str] = (),
    lookup: Callable[[], int] = looked_up_index,
) -> dict[str, str]:
    """The environment vLLM starts with for its flags ``argv`` (pure apart from reading the two
    secret files, the replica's own address and, with several replicas, its index). With
    tracing on, the protocol and this replica's service name (tracing.py)."""
    out = dict(env)
    out.update(side_channel_host(env, address))
    place = placement(env, argv, lookup)
    if place.gpus:
        all_gpus = split_ids(env.get("KIT_ALL_GPUS", "")) or place.gpus
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        out["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(place.gpus, all_gpus)
    out.update(secret_environment())
    out.update(tracing_environment(env, place.replica, socket.gethostname()))
    return out
