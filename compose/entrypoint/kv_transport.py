"""The KV pull's transport on a GPU host: set up so it can be CUDA IPC, then read what UCX chose.

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

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

GET_ZCOPY_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
MODULE_DIR_ENV = "UCX_MODULE_DIR"
CUDA_MODULE = "libuct_cuda.so"
_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9]+)\.", re.MULTILINE)
_TRANSPORT = re.compile(r"([a-z][a-z0-9_]*)/[^\s,|]+")


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


# ------------------------------------------------------------------ UCX_PROTO_INFO tables
@dataclass
class Selection:
    """One UCX protocol-selection table: its title lines and its (range, description, config)
    rows."""

    title: list[str] = field(default_factory=list)
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def heading(self) -> str:
        return " / ".join(self.title)

    def is_remote_read(self) -> bool:
        """A GET between two agents (the KV pull), not an agent reading itself (`self cfg`)."""
        text = self.heading
        return "remote memory read" in text and ("intra-node" in text or "inter-node" in text)

    def transports(self) -> set[str]:
        return {m.group(1) for _, _, config in self.rows for m in _TRANSPORT.finditer(config)}

    def problem_on_gpu(self) -> str | None:
        """Why this KV pull is wrong on a GPU host, or None."""
        if "into host memory" in self.heading or "from host memory" in self.heading:
            return "UCX sees the KV memory as host memory (a UCX build without its CUDA module?)"
        names = self.transports()
        if names and names <= {"tcp"}:
            how = ", ".join(sorted({desc for _, desc, _ in self.rows}))
            return f"the KV pull runs over TCP only ({how})"
        return None

    def summary(self) -> str:
        rows = "; ".join(f"{r} {d} {c}" for r, d, c in self.rows)
        return f"{self.heading}: {rows}"


def _cells(line: str) -> list[str] | None:
    """The cells of a table row (the log prefix before the first '|' dropped), None otherwise."""
    start = line.find("|")
    if start < 0 or not line.rstrip().endswith("|"):
        return None
    return [c.strip() for c in line.rstrip()[start + 1 : -1].split("|")]


class ProtoScanner:
    """Feed UCX's output line by line; finished selection tables come out of feed()."""

    def __init__(self) -> None:
        self.current: Selection | None = None

    def feed(self, line: str) -> Iterator[Selection]:
        cells = _cells(line)
        if cells is None:
            # The table ends at its bottom border (a border after rows) or at any other line:
            # the pull's table can be the last thing UCX prints for a while.
            border = "+--" in line
            if self.current is not None and (not border or self.current.rows):
                yield from self._close()
            return
        if len(cells) == 1:  # a title line: a new table starts after a finished one
            if self.current is not None and self.current.rows:
                yield from self._close()
            if self.current is None:
                self.current = Selection()
            self.current.title.append(cells[0])
        elif len(cells) >= 3 and self.current is not None:
            if cells[:3] != ["Range", "Description", "Config"]:
                self.current.rows.append((cells[0], cells[1], " ".join(cells[2:])))

    def close(self) -> Iterator[Selection]:
        yield from self._close()

    def _close(self) -> Iterator[Selection]:
        done, self.current = self.current, None
        if done is not None and done.rows:
            yield done


# ------------------------------------------------------------------ the probe at start
CHECK_ENV = "KIT_KV_TRANSPORT_CHECK"
CHECK_MODES = ("warn", "refuse", "off")
HOST_DETECTED = "detected as host"


def check_mode(raw: str | None) -> str:
    """KV_TRANSPORT_CHECK: warn (default), refuse or off; ValueError otherwise."""
    mode = (raw or "warn").strip().lower()
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV}={raw!r} (KV_TRANSPORT_CHECK): want one of {CHECK_MODES}")
    return mode


@dataclass
class ProbeVerdict:
    """What a NIXL READ at start showed. ``problem``: the pull would not be GPU to GPU (the
    server should warn or refuse); ``unknown``: the probe itself failed, so nothing is known."""

    summary: str
    problem: str | None = None
    unknown: bool = False


def probe_verdict(returncode: int, stdout: str, stderr: str, ucx_log: str) -> ProbeVerdict:
    """Judge nixl_read_probe.py's run: its exit, its JSON line, NIXL's errors and UCX's tables."""
    if HOST_DETECTED in stderr:
        return ProbeVerdict(
            "GPU memory could not be registered",
            "UCX sees GPU memory as host memory (the wrong nixl build's UCX modules loaded?)",
        )
    scanner = ProtoScanner()
    tables = [t for line in ucx_log.splitlines() for t in scanner.feed(line)]
    pulls = [t for t in [*tables, *scanner.close()] if t.is_remote_read()]
    result: dict[str, object] = {}
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
            break
    if returncode != 0 or not result:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeVerdict(f"the probe failed (exit {returncode}): {last[:300]}", unknown=True)
    rate = result.get("gb_per_s")
    speed = f"{rate:.1f} GB/s" if isinstance(rate, (int, float)) else "speed unknown"
    if not pulls:
        return ProbeVerdict(
            f"{speed}; UCX printed no pull table (UCX_PROTO_INFO off?)", unknown=True
        )
    for pull in pulls:
        problem = pull.problem_on_gpu()
        if problem:
            return ProbeVerdict(f"{pull.summary()}, {speed}", problem)
    return ProbeVerdict(f"{pulls[-1].summary()}, {speed}")
