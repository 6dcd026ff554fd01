"""The host's GPUs as nvidia-smi reports them, and GPU ids (indices or GPU-UUIDs, as Compose's
device_ids accept) resolved against that list, so every message can name a GPU by index and model.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

QUERY_ARGS = (
    "--query-gpu=index,uuid,name,memory.total,compute_cap,driver_version",
    "--format=csv,noheader,nounits",
)


@dataclass(frozen=True)
class Gpu:
    """One row of the nvidia-smi query. memory_mib/compute_cap are None when it says [N/A]."""

    index: int
    uuid: str
    name: str
    memory_mib: int | None
    compute_cap: tuple[int, int] | None
    driver: str

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.name})"

    @property
    def sm(self) -> str:
        return "SM ?" if self.compute_cap is None else "SM {}.{}".format(*self.compute_cap)


def parse_inventory(text: str) -> list[Gpu]:
    """Parse `nvidia-smi --query-gpu=... --format=csv,noheader,nounits`; ValueError if malformed."""
    gpus = []
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        cells = [cell.strip() for cell in row]
        if len(cells) != 6 or not cells[0].isdigit():
            raise ValueError(f"unexpected nvidia-smi line {', '.join(cells)!r}")
        index, uuid, name, memory, cap, driver = cells
        gpus.append(Gpu(int(index), uuid, name, _int(memory), _capability(cap), driver))
    return gpus


def resolve(gpu_id: str, gpus: list[Gpu]) -> Gpu | None:
    """The GPU an id names: a decimal index, or a full UUID (`GPU-...`, case-insensitive)."""
    if gpu_id.isdigit():
        return next((g for g in gpus if g.index == int(gpu_id)), None)
    return next((g for g in gpus if g.uuid.lower() == gpu_id.lower()), None)


def describe(gpu_id: str, gpu: Gpu) -> str:
    """`GPU 2 (NVIDIA H100)`, or `GPU-ab12... = GPU 2 (NVIDIA H100)` when given by UUID."""
    return gpu.label if gpu_id.isdigit() else f"{gpu_id} = {gpu.label}"


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def _capability(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)
