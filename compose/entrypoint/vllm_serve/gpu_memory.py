"""Wait until this replica's GPUs have the memory vLLM will ask for, before vLLM starts.

Why: vLLM 0.32 refuses to start when a GPU's free memory is below total x
--gpu-memory-utilization (vllm/v1/worker/utils.py, request_memory); it does not shrink to fit.
A server that starts while the previous one on the same GPUs is still going (a partial `up`, a
rescale, workers left in the shared PID namespace, memory the driver frees asynchronously) is
refused, and back-to-back refusals reach the entrypoint's crash-loop hold. Waiting here, with the
numbers in the log, turns that race into a pause. NVML comes as vllm.third_party.pynvml, loaded by
path so vLLM itself (and torch) is not imported yet.
Standard library only at import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

from .console import log
from .gpus import flag_value, split_ids
from .slots import SLOT_DIR_ENV
from .stop_flag import StopFlag

GIB = 1 << 30
HEADROOM_ENV = "KIT_GPU_FREE_HEADROOM_GIB"  # .env GPU_FREE_HEADROOM_GIB
VLLM_DEFAULT_UTILIZATION = 0.92  # vllm.config.cache.CacheConfig.gpu_memory_utilization (0.32)
UTILIZATION_FLAG = ("--gpu-memory-utilization",)
POLL_S = 2.0
LOG_EVERY_S = 15.0


class GpuMemory(NamedTuple):
    """One GPU's memory as NVML reports it, in bytes; ``gpu`` is the id it was asked by."""

    gpu: str
    free: int
    total: int


def needed_bytes(total: int, utilization: float, headroom: int) -> int:
    """What vLLM will ask for on a GPU of ``total`` bytes, plus ``headroom``."""
    return int(total * utilization) + headroom


def shortfalls(
    readings: Sequence[GpuMemory], utilization: float, headroom: int
) -> list[tuple[GpuMemory, int]]:
    """The GPUs whose free memory is below what vLLM needs, with the bytes they lack."""
    out = []
    for mem in readings:
        want = needed_bytes(mem.total, utilization, headroom)
        if mem.free < want:
            out.append((mem, want - mem.free))
    return out


def describe(short: Sequence[tuple[GpuMemory, int]], utilization: float, headroom: int) -> str:
    parts = [
        f"GPU {mem.gpu} {mem.free / GIB:.1f} of {mem.total / GIB:.1f} GiB free, "
        f"{lack / GIB:.1f} GiB short"
        for mem, lack in short
    ]
    return (
        f"waiting for GPU memory: vLLM needs total x {utilization} "
        f"(--gpu-memory-utilization) + {headroom / GIB:g} GiB headroom free on each of this "
        f"replica's GPUs; {'; '.join(parts)}. Another process still holds them (a previous "
        "server stopping, or another replica on the same GPUs: check PREFILL_GPUS/DECODE_GPUS "
        "and nvidia-smi)"
    )


def utilization(raw: str | None) -> float:
    """--gpu-memory-utilization's value (vLLM's default when absent); ValueError otherwise."""
    if raw is None:
        return VLLM_DEFAULT_UTILIZATION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(f"--gpu-memory-utilization={raw!r}: want a number in (0, 1]")
    return value


def headroom_bytes(raw: str) -> int:
    """KIT_GPU_FREE_HEADROOM_GIB (GPU_FREE_HEADROOM_GIB) in bytes; ValueError for a bad one."""
    try:
        value = float(raw.strip() or "0")
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(
            f"{HEADROOM_ENV}={raw!r} (GPU_FREE_HEADROOM_GIB): want GiB >= 0 (e.g. 1 or 0.5)"
        )
    return int(value * GIB)


def load_nvml() -> ModuleType:
    """vllm.third_party.pynvml, loaded from its file: importing it as a submodule would run
    vllm/__init__.py first."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed: no vllm.third_party.pynvml")
    path = f"{list(spec.submodule_search_locations)[0]}/third_party/pynvml.py"
    nvml_spec = importlib.util.spec_from_file_location("kit_pynvml", path)
    if nvml_spec is None or nvml_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(nvml_spec)
    sys.modules[nvml_spec.name] = module  # pynvml looks itself up there while it loads
    nvml_spec.loader.exec_module(module)
    return module


def nvml_reader(nvml: Any) -> Callable[[str], GpuMemory]:
    """A reading function over an initialised NVML module: ``gpu`` is an in-container index or
    a GPU-/MIG- UUID (the ids CUDA_VISIBLE_DEVICES holds)."""

    def read(gpu: str) -> GpuMemory:
        if gpu.startswith(("GPU-", "MIG-")):
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu)
        else:
            handle = nvml.nvmlDeviceGetHandleByIndex(int(gpu))
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuMemory(gpu, int(info.free), int(info.total))

    return read


def wait_for_free_memory(
    gpus: Sequence[str],
    utilization: float,
    headroom: int,
    read: Callable[[str], GpuMemory],
    wait: Callable[[float], bool],
    log: Callable[[str], None],
    poll_s: float = POLL_S,
    log_every_s: float = LOG_EVERY_S,
) -> bool:
    """Poll ``read`` until every GPU of ``gpus`` has enough free memory (True), logging the
    numbers every ``log_every_s`` while it waits; False when ``wait`` says a stop was asked."""
    since_log = log_every_s
    waited = 0.0
    while True:
        short = shortfalls([read(gpu) for gpu in gpus], utilization, headroom)
        if not short:
            if waited:
                log(f"GPU memory free after {waited:.0f}s: starting vLLM")
            return True
        if since_log >= log_every_s:
            log(describe(short, utilization, headroom))
            since_log = 0.0
        if wait(poll_s):
            return False
        since_log += poll_s
        waited += poll_s


def wait_with_nvml(
    gpus: Sequence[str],
    utilization: float,
    headroom: int,
    wait: Callable[[float], bool],
    log: Callable[[str], None],
    nvml: Any = None,
) -> bool:
    """wait_for_free_memory() against the real NVML (``nvml``: a stand-in module for tests)."""
    nvml = nvml if nvml is not None else load_nvml()
    nvml.nvmlInit()
    try:
        return wait_for_free_memory(gpus, utilization, headroom, nvml_reader(nvml), wait, log)
    finally:
        nvml.nvmlShutdown()


def wait_for_gpus(env: Mapping[str, str], argv: Sequence[str], stop: StopFlag) -> None:
    """Block until this replica's GPUs (its CUDA_VISIBLE_DEVICES) have the memory vLLM will
    ask for plus GPU_FREE_HEADROOM_GIB; SystemExit(0) when stopped while waiting."""
    gpus = split_ids(env.get("CUDA_VISIBLE_DEVICES", ""))
    if not gpus or not env.get(SLOT_DIR_ENV, "").strip():
        return
    share = utilization(flag_value(argv, UTILIZATION_FLAG))
    headroom = headroom_bytes(env.get(HEADROOM_ENV, "1"))
    if not wait_with_nvml(gpus, share, headroom, stop.wait, log):
        log("stopped while waiting for GPU memory")
        raise SystemExit(0)
