"""Ask Linux for AMX tile permission in the vLLM CPU worker process.

Why: on CPUs with AMX (Sapphire Rapids and newer), vLLM's CPU attention picks
its AMX kernel for bf16 with a block size that is a multiple of 32. Executing
AMX tile instructions faults with SIGILL unless the process first asked the
kernel for the XTILEDATA state component (``arch_prctl(ARCH_REQ_XCOMP_PERM)``).
A plain vLLM instance gets it as a side effect of its first large prefill GEMM
(oneDNN asks); a P/D decode server's first step is a one-token step after the
KV arrived over NIXL, so nothing has asked and the worker dies with exit -4.
The request is idempotent and harmless where AMX is absent.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(f"vllm.{__name__}")

# <asm/prctl.h> and <asm/unistd_64.h> (x86-64).
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@dataclass(frozen=True)
class AmxStatus:
    """What this process may execute: ``supported`` by the CPU, ``permitted`` by the kernel."""

    supported: bool
    permitted: bool

    def describe(self) -> str:
        if not self.supported:
            return "CPU has no AMX (no amx_tile flag): nothing to request"
        if self.permitted:
            return "AMX tile data permitted for this process (arch_prctl ARCH_REQ_XCOMP_PERM)"
        return "CPU has AMX but the kernel refused tile data permission: AMX kernels will SIGILL"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags from /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_has_amx(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        text = cpuinfo_path.read_text()
    except OSError:
        return False
    return "amx_tile" in cpu_flags(text)


def _arch_prctl(code: int, arg: int | ctypes.c_void_p) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(SYS_ARCH_PRCTL, code, arg))


def permitted_xfeatures() -> int:
    """The bitmask of extended state components this process may use (0 if unknown)."""
    mask = ctypes.c_uint64(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
        return 0
    return mask.value


def tile_data_permitted() -> bool:
    return bool(permitted_xfeatures() & (1 << XFEATURE_XTILEDATA))


def ensure_amx_permission(*, has_amx: bool | None = None) -> AmxStatus:
    """Request XTILEDATA permission if the CPU has AMX; log and return the outcome."""
    supported = cpu_has_amx() if has_amx is None else has_amx
    if not supported:
        status = AmxStatus(supported=False, permitted=False)
        logger.info("%s", status.describe())
        return status
    if not tile_data_permitted():
        _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    status = AmxStatus(supported=True, permitted=tile_data_permitted())
    (logger.info if status.permitted else logger.error)("%s", status.describe())
    return status
