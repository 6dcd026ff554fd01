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
import errno
import logging
import os
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


def syscall_available(
    machine: str | None = None, release: str | None = None, system: str | None = None
) -> str | None:
    """None where ARCH_GET/REQ_XCOMP_PERM exist (Linux x86-64, kernel >= 5.16), else why not."""
    machine = platform.machine() if machine is None else machine
    release = platform.release() if release is None else release
    system = platform.system() if system is None else system
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        return f"arch_prctl's XCOMP_PERM codes are Linux x86-64 only (this is {system} {machine})"
    parts = release.split(".")
    try:
        version = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    except (IndexError, ValueError):
        return None  # an odd release string: let the kernel answer
    if version < (5, 16):
        return f"kernel {release} predates ARCH_GET_XCOMP_PERM (Linux 5.16)"
    return None


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> None:
    """arch_prctl(code, arg) through syscall(2); OSError with the kernel's errno on failure.

    The arguments are typed C longs and the readback buffer goes by reference: syscall() is
    variadic, so an untyped Python int would be passed as a 32-bit C int and a 64-bit address
    cut in half (the kernel then answers EFAULT).
    """
    why_not = syscall_available()
    if why_not is not None:
        raise OSError(errno.ENOSYS, why_not)
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    ptr_or_int = ctypes.byref(arg) if isinstance(arg, ctypes.c_uint64) else ctypes.c_long(arg)
    ctypes.set_errno(0)
    rc = syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ptr_or_int)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"arch_prctl({code:#x}) failed: {os.strerror(err)} (rc {rc})")


def permitted_xfeatures() -> int:
    """The bitmask of extended state components this process may use (ARCH_GET_XCOMP_PERM).

    Raises OSError when the kernel refuses the call: a readback of 0 would be indistinguishable
    from "nothing permitted".
    """
    mask = ctypes.c_uint64(0)
    _arch_prctl(ARCH_GET_XCOMP_PERM, mask)
    return mask.value


def request_xfeature(feature: int) -> None:
    """Ask for a dynamic state component (ARCH_REQ_XCOMP_PERM); OSError if refused.

    The kernel answers EOPNOTSUPP for a component the CPU lacks (XTILEDATA without AMX).
    """
    _arch_prctl(ARCH_REQ_XCOMP_PERM, feature)


def tile_data_permitted() -> bool:
    return bool(permitted_xfeatures() & (1 << XFEATURE_XTILEDATA))


def ensure_amx_permission(*, has_amx: bool | None = None) -> AmxStatus:
    """Request XTILEDATA permission if the CPU has AMX; log and return the outcome.

    A refused call is logged at ERROR with the kernel's reason and reported as not permitted;
    ``amx_problem`` says whether the worker can still run (vLLM picks its AMX kernel only for
    bf16).
    """
    supported = cpu_has_amx() if has_amx is None else has_amx
    if not supported:
        status = AmxStatus(supported=False, permitted=False)
        logger.info("%s", status.describe())
        return status
    try:
        if not tile_data_permitted():
            request_xfeature(XFEATURE_XTILEDATA)
        permitted = tile_data_permitted()
    except OSError as exc:
        logger.error("AMX tile permission: %s", exc)
        permitted = False
    status = AmxStatus(supported=True, permitted=permitted)
    (logger.info if status.permitted else logger.error)("%s", status.describe())
    return status


def amx_problem(status: AmxStatus, dtype: object) -> str | None:
    """Why this worker must not start, or None: an AMX CPU without tile permission runs vLLM's
    AMX attention kernel for bf16 and dies with SIGILL at decode's first step, so stop at start
    with the reason; other dtypes never reach AMX code and only get the log line."""
    if not status.supported or status.permitted:
        return None
    if "bfloat16" not in str(dtype):
        logger.warning(
            "%s; dtype %s does not use AMX kernels, so the worker goes on", status.describe(), dtype
        )
        return None
    return (
        f"{status.describe()} (dtype {dtype}): the first decode step would die with SIGILL. "
        "Run with --dtype float32, or on a kernel that grants ARCH_REQ_XCOMP_PERM (Linux 5.16+)"
    )
