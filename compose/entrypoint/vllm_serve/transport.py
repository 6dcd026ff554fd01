"""The KV pull's transport on a GPU host: set up so it can be CUDA IPC, and watched as vLLM runs.

Why: NIXL's KV pull is a UCX GET. Two things make it silently run over TCP on a GPU host:
- nixl 1.5.1 installs nixl_cu12 and nixl_cu13 with the same-named libucs but different CUDA
  transport modules, and UCX loads modules next to whichever libucs came first. With the wrong
  one, GPU memory is "detected as host" and the pull goes over TCP (nixl#1628). UCX_MODULE_DIR
  pins the build that matches torch's CUDA (read from torch/version.py, torch not imported).
- cuda_ipc's GET zero-copy is `auto` by default: off without an active NVLink, so on PCIe the
  pull becomes "software emulation | tcp" (100x slower). compose sets
  UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y on the GPU servers; this module checks it is set.
With UCX_PROTO_INFO=y UCX prints one table per protocol selection to stdout; ProtoScanner reads
the "remote memory read by ucp_get*" tables between this host's peers as vLLM runs, and the
entrypoint says loudly when the pull is TCP-only or sees GPU memory as host memory. On the cpu
profile TCP is the only path: nothing is forced there and the scanner is not used.
Standard library only.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from .console import log
from .ucx_tables import ProtoScanner

GET_ZCOPY_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
MODULE_DIR_ENV = "UCX_MODULE_DIR"
CUDA_MODULE = "libuct_cuda.so"
_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9]+)\.", re.MULTILINE)


def torch_cuda_major(torch_dir: Path) -> int | None:
    """torch's CUDA major version from its version.py (None: a CPU build)."""
    text = (torch_dir / "version.py").read_text()
    found = _TORCH_CUDA.search(text)
    return int(found.group(1)) if found else None


def nixl_ucx_dir(site_packages: Path, cuda_major: int) -> Path:
    """The UCX module folder of the nixl build for CUDA ``cuda_major``; ValueError when it is
    missing or has no CUDA transport (then the KV pull could only be TCP)."""
    folder = site_packages / f"nixl_cu{cuda_major}.libs" / "ucx"
    if not folder.is_dir():
        raise ValueError(
            f"no {folder} for torch's CUDA {cuda_major}: install nixl's cu{cuda_major} build "
            f"(or set {MODULE_DIR_ENV} to a UCX module folder with {CUDA_MODULE})"
        )
    check_module_dir(folder)
    return folder


def check_module_dir(folder: Path) -> None:
    if not any(p.name.startswith(CUDA_MODULE) for p in folder.iterdir()):
        raise ValueError(
            f"{MODULE_DIR_ENV}={folder} has no {CUDA_MODULE}*: UCX would see GPU memory as host "
            "memory and move KV over TCP"
        )


def transport_warnings(env: Mapping[str, str]) -> list[str]:
    """A GPU server's UCX settings that leave the KV pull to TCP (preflight reads the same)."""
    warnings = []
    if (env.get(GET_ZCOPY_ENV) or "").strip().lower() not in ("y", "yes", "on", "1"):
        warnings.append(
            f"{GET_ZCOPY_ENV}={env.get(GET_ZCOPY_ENV) or '(unset: auto)'}: without NVLink UCX "
            "turns cuda_ipc GET zero-copy off and the KV pull runs as software emulation over TCP"
        )
    tls = env.get("UCX_TLS") or ""
    if tls and "cuda_ipc" not in tls and "rc" not in tls and "^" not in tls:
        warnings.append(f"UCX_TLS={tls} has no cuda_ipc (nor RDMA): the KV pull can only be TCP")
    return warnings


def gpu_ucx_env(
    env: Mapping[str, str], site_packages: Path, torch_dir: Path
) -> tuple[dict[str, str], list[str]]:
    """The UCX settings a GPU server starts with (UCX_MODULE_DIR unless set), and warnings for
    settings that leave the KV pull to TCP. ValueError when no CUDA transport can load."""
    warnings = transport_warnings(env)
    given = env.get(MODULE_DIR_ENV, "").strip()
    if given:
        check_module_dir(Path(given))
        return {}, warnings
    major = torch_cuda_major(torch_dir)
    if major is None:
        raise ValueError(f"torch in {torch_dir} is a CPU build: a GPU server needs CUDA torch")
    return {MODULE_DIR_ENV: str(nixl_ucx_dir(site_packages, major))}, warnings


def install_paths() -> tuple[Path, Path]:
    """(site-packages holding nixl's builds, torch's package folder), found without importing."""
    nixl, torch = importlib.util.find_spec("nixl"), importlib.util.find_spec("torch")
    if nixl is None or nixl.origin is None or torch is None or not torch.origin:
        raise ValueError("nixl or torch is not installed in this image: no KV transfer over NIXL")
    return Path(nixl.origin).resolve().parent.parent, Path(torch.origin).resolve().parent


def kv_transport_setup(env: Mapping[str, str]) -> tuple[dict[str, str], Callable[[str], None]]:
    """A GPU server's UCX settings (gpu_ucx_env(), warnings logged loudly) and the watcher of
    UCX's protocol tables for its output."""
    site, torch_dir = install_paths()
    extra, warnings = gpu_ucx_env(env, site, torch_dir)
    for warning in warnings:
        log(f"KV TRANSPORT WARNING: {warning}")
    scanner = ProtoScanner()

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
