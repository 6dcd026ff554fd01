"""The entrypoint's steps in order: the crash-loop bound, the settings (refused before anything
waits), the slot lease, the environment and command, the start-up lines, the KV transport check,
the wait for GPU memory, then vLLM under supervision.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .command import vllm_command
from .console import log
from .cpu_topology import cpu_topology
from .crash_loop import (
    CRASH_FILE,
    CRASH_FILE_ENV,
    CRASH_LIMIT,
    hold_after_crash_loop,
    read_crashes,
    record_exit,
    write_crashes,
)
from .environment import SIDE_CHANNEL_HOST_ENV, serve_environment
from .gpu_memory import wait_for_gpus
from .gpus import replica_count
from .kv_config import KV_FLAG
from .kv_events import KV_EVENTS_FLAG, KV_EVENTS_PORT_ENV
from .replica import Placement, looked_up_index, placement
from .slots import SLOT_DIR_ENV, Lease, pinned_slot, take_slot
from .stop_flag import StopFlag
from .supervise import supervise
from .tracing import TRACES_FLAG
from .transport import kv_transport_setup
from .transport_check import CHECK_ENV, check_kv_transport, check_mode

# The exit status for settings the entrypoint refuses (before vLLM starts).
USAGE_EXIT = 2


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
        index = lease.slot if lease is not None else None
        place = placement(os.environ, argv, (lambda: index) if index else looked_up_index)
        env = serve_environment(os.environ, argv=argv, lookup=lambda: place.replica)
        flags, cpu_env = cpu_topology(env, sorted(os.sched_getaffinity(0)), argv)
        env = {**cpu_env, **env}  # an explicit VLLM_CPU_OMP_THREADS_BIND wins
        cmd = vllm_command([*argv, *flags], env, sys.executable)
        watch: Callable[[str], None] | None = None
        transport_mode = "off"
        if place.gpus and env.get(SLOT_DIR_ENV, "").strip():  # compose's GPU servers
            ucx, watch = kv_transport_setup(env)
            env.update(ucx)
            transport_mode = check_mode(env.get(CHECK_ENV))
    except ValueError as exc:
        # A refused setting is a crash too: the restart policy would otherwise retry it forever.
        record_exit(crash_file, True, 0.0, str(exc))
        log(str(exc))
        sys.exit(USAGE_EXIT)
    print_start_lines(place, lease, env, flags, cmd)
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


def print_start_lines(
    place: Placement,
    lease: Lease | None,
    env: Mapping[str, str],
    flags: Sequence[str],
    cmd: Sequence[str],
) -> None:
    """What this server runs with, on stdout before vLLM's own lines: the replica, its GPUs and
    lease, whether the secrets were found (never their values), and the flags the entrypoint
    built."""
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
    if TRACES_FLAG in cmd:
        print(
            f"vllm_serve: tracing to {cmd[cmd.index(TRACES_FLAG) + 1]} "
            f"({env.get('OTEL_EXPORTER_OTLP_TRACES_PROTOCOL')}) as {env.get('OTEL_SERVICE_NAME')}"
        )
    print(f"vllm_serve: {KV_FLAG} {cmd[-1]}")
    sys.stdout.flush()
