"""``vllm.general_plugins`` entry point: the CPU fixes, in every engine and worker process.

vLLM loads general plugins in the engine-core and worker processes before it builds the model and
its process groups (``v1/engine/core.py``, ``v1/worker/worker_base.py``), so class-level patches
made here are in place for every layer and communicator the process creates.
"""

from __future__ import annotations

import logging
import os

from . import FIXES_ENV, TRITON_INTERPRETER_ENV
from .knobs import knob_on, wants_fixes

logger = logging.getLogger(f"vllm.{__name__}")


class CpuCompatError(RuntimeError):
    """A knob asked for something this process cannot do; the server must not start half-fixed."""


def _is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_triton_interpreter() -> None:
    """The Triton knob must have taken effect before vLLM read ``HAS_TRITON``."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise CpuCompatError(
            f"{TRITON_INTERPRETER_ENV}=1 but vLLM decided Triton is unavailable: the platform "
            "plugin did not run first (VLLM_TARGET_DEVICE=cpu skips platform plugins: unset it; "
            "VLLM_PLUGINS must include 'pcp_nixl_triton' if set)"
        )


def apply_fixes() -> list[str]:
    """Install every CPU fix; returns the names of those installed by this call."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from . import expert_parallel, rope

    installed = []
    if rope.install(RotaryEmbedding):
        installed.append("rotary embedding for [tokens, heads, dim] inputs")
    if expert_parallel.install(CPUUnquantizedExperts, CpuCommunicator):
        installed.append("expert-parallel MoE (expert_map, all_gatherv, reduce_scatterv)")
    refused = expert_parallel.refuse_under_expert_parallel(_quantized_cpu_experts())
    if refused:
        installed.append(f"expert parallelism refused for quantized CPU MoE ({', '.join(refused)})")
    return installed


def _quantized_cpu_experts() -> list[type]:
    """vLLM's quantized CPU expert classes (they ignore ``expert_map`` like the unquantized one,
    and the kit does not fix them)."""
    from vllm.model_executor.layers.fused_moe import modular_kernel
    from vllm.model_executor.layers.fused_moe.experts import cpu_int4_moe, cpu_moe

    from . import expert_parallel

    return expert_parallel.quantized_cpu_experts(
        (cpu_moe, cpu_int4_moe),
        modular_kernel.FusedMoEExperts,
        cpu_moe.CPUUnquantizedExperts,
    )


def register() -> None:
    """Entry point. Raises (and so stops the server) on a bad knob or a fix that cannot apply."""
    cpu_build = _is_cpu_build()
    if cpu_build and knob_on(os.environ, TRITON_INTERPRETER_ENV):
        check_triton_interpreter()
    if not wants_fixes(os.environ, cpu_build):
        return
    try:
        installed = apply_fixes()
    except (ImportError, AttributeError) as exc:
        raise CpuCompatError(
            f"{FIXES_ENV}=1: a vLLM class the CPU fixes patch has moved ({exc}); these fixes "
            "are written for vLLM 0.32/0.33"
        ) from exc
    for name in installed:
        logger.info("pcp_nixl_connector CPU fix: %s", name)
