"""GPU memory arithmetic, kept pure so it is unit-tested without a GPU: how much of a GPU one
vLLM rank needs for its share of the weights plus a runtime and KV reserve, and the
--gpu-memory-utilization fraction to set when the configured one is too small."""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1000**3
GIB = 1024**3
MIB = 1024**2
#: Activations of the profiling run, CUDA graphs, NCCL/cuBLAS workspaces: a rough allowance.
RUNTIME_RESERVE_GIB = 3.0
#: Least KV cache worth starting with; more when one max_model_len sequence needs more.
KV_RESERVE_GIB = 4.0
#: Above this fraction there is no headroom left for the driver and other processes.
MAX_FRACTION = 0.95
STEP = 0.05


@dataclass(frozen=True)
class Need:
    """Bytes one rank needs: its weights, the runtime allowance and the KV reserve."""

    weights: float
    runtime: float
    kv: float

    @property
    def total(self) -> float:
        return self.weights + self.runtime + self.kv

    def describe(self) -> str:
        return (
            f"{self.weights / GB:.1f} GB of weights + {self.runtime / GIB:.0f} GiB runtime + "
            f"{self.kv / GIB:.1f} GiB KV"
        ).replace(".0 GiB KV", " GiB KV")


@dataclass(frozen=True)
class Verdict:
    """`required`: the least fraction that fits; `suggested`: what to set (None: cannot fit)."""

    fits: bool
    required: float
    suggested: float | None


def weights_per_rank(
    total_params: float, expert_params: float, bytes_per_param: float, tp: int, expert_ranks: int
) -> float:
    """Bytes of weights on one rank: non-expert weights split over TP, routed experts over the
    ranks that share them (TP x PCP with expert parallelism on prefill, TP on decode)."""
    dense = (total_params - expert_params) * bytes_per_param / tp
    experts = expert_params * bytes_per_param / expert_ranks
    return dense + experts


def kv_reserve(kv_bytes_per_token: float | None, max_model_len: int) -> float:
    """KV bytes to reserve: KV_RESERVE_GIB, or one full max_model_len sequence if that is more."""
    one_sequence = (kv_bytes_per_token or 0.0) * max_model_len
    return max(KV_RESERVE_GIB * GIB, one_sequence)


def need(weights: float, kv: float) -> Need:
    return Need(weights=weights, runtime=RUNTIME_RESERVE_GIB * GIB, kv=kv)


def judge(need_bytes: float, gpu_mib: int, fraction: float) -> Verdict:
    """Does `fraction` of a `gpu_mib` GPU hold `need_bytes`, and what fraction would?"""
    required = need_bytes / (gpu_mib * MIB)
    return Verdict(fits=fraction >= required, required=required, suggested=suggest(required))


def suggest(required: float) -> float | None:
    """Round `required` up to the next 0.05 step; None above MAX_FRACTION (does not fit)."""
    steps = math.ceil(round(required / STEP, 6))
    value = round(steps * STEP, 2)
    return None if value > MAX_FRACTION else value


def ceil2(value: float) -> float:
    """Round up to two decimals, so a printed minimum is never below the true one."""
    return math.ceil(round(value * 100, 6)) / 100
