"""``vllm.general_plugins`` entry point: the CPU fixes, in every engine and worker process.

vLLM loads general plugins in the engine-core and worker processes before it builds the model and
its process groups (``v1/engine/core.py``, ``v1/worker/worker_base.py``), so class-level patches
made here are in place for every layer and communicator the process creates. The API server
loads them too (``EngineArgs.__post_init__``, ``vllm/engine/arg_utils.py``) before it builds the
``VllmConfig``, so the prefix-caching fix is in place when the CPU platform checks that config.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping

from ..releases import CPU_CHECKED, and_list
from . import FIXES_ENV, SLEEPING_WAIT_ENV, TRITON_INTERPRETER_ENV
from .knobs import knob_on, wants_fixes

logger = logging.getLogger(f"vllm.{__name__}")
#: The log line of the fused attention fix (``bench prefill`` tells a server that ran it apart).
FUSED_MLA_PREFILL = "fused MLA prefill attention (PyTorch's CPU flash attention with its LSE)"
NATIVE_KERNELS = (
    "Model Runner V2's hottest Triton kernels in torch (staged writes, slot mappings, "
    "block-table gather, greedy sampling, the step's input and update kernels)"
)
SLEEPING_WAIT = "workers sleep between looks for the next step instead of spinning a core"


class CpuCompatError(RuntimeError):
    """A knob asked for something this process cannot do; the server must not start half-fixed."""


def _is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_triton_interpreter() -> None:
    """The Triton knob must have taken effect before vLLM read ``HAS_TRITON``."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    if not triton_installed():
        raise CpuCompatError(
            f"{TRITON_INTERPRETER_ENV}=1 but the Python package 'triton' is not installed, and "
            "Model Runner V2 (which PCP needs) runs its kernels with Triton's interpreter on "
            "CPU: install the kit's cpu extra (pip install -e '.[cpu]', which pins triton) or "
            "'pip install triton' into this vLLM's environment"
        )
    raise CpuCompatError(
        f"{TRITON_INTERPRETER_ENV}=1 and triton is installed, but vLLM decided Triton is "
        "unavailable: the kit's platform plugin 'pcp_nixl_triton' did not run before vLLM "
        "checked (VLLM_TARGET_DEVICE=cpu skips platform plugins: unset it; VLLM_PLUGINS, if "
        "set, must include 'pcp_nixl_triton'; connector/ must be on PYTHONPATH)"
    )


def apply_fixes() -> list[str]:
    """Install every CPU fix; returns the names of those installed by this call."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from . import expert_parallel, mla_prefill, rope

    installed = []
    if rope.install(RotaryEmbedding):
        installed.append("rotary embedding for [tokens, heads, dim] inputs")
    if expert_parallel.install(CPUUnquantizedExperts, CpuCommunicator):
        installed.append("expert-parallel MoE (expert_map, all_gatherv, reduce_scatterv)")
    refused = expert_parallel.refuse_under_expert_parallel(_quantized_cpu_experts())
    if refused:
        installed.append(f"expert parallelism refused for quantized CPU MoE ({', '.join(refused)})")
    if _install_prefix_caching():
        installed.append(
            "prefix caching for MLA on the reference CPU backend (chunked prefill stays off)"
        )
    if mla_prefill.install(_mla_prefill_backend()):
        installed.append(FUSED_MLA_PREFILL)
    return installed


def apply_knob_fixes(environ: Mapping[str, str]) -> list[str]:
    """The fixes two more knobs ask for: with the Triton knob (a PCP prefill) Model Runner V2's
    hottest kernels in torch; with ``PCP_NIXL_CPU_SLEEPING_WAIT`` (the servers of a P/D pair, which
    share the host's cores) workers that sleep instead of spinning while they wait. A server
    alone on the host keeps vLLM's spin: sleeping cost a single vLLM 1.6-2.4 ms per output token
    (docs/measurements.md). Returns the log lines (with the kernels that stay interpreted)."""
    from . import idle_wait, native_kernels

    lines = []
    if knob_on(environ, TRITON_INTERPRETER_ENV) and native_kernels.install():
        lines += [
            NATIVE_KERNELS,
            "Triton kernels left to the interpreter: "
            + (", ".join(native_kernels.interpreted_kernels()) or "none"),
        ]
    if knob_on(environ, SLEEPING_WAIT_ENV) and idle_wait.install(_spin_condition()):
        lines.append(SLEEPING_WAIT)
    return lines


def missing_fixes() -> list[str]:
    """The CPU fixes this process's vLLM classes lack (their markers, or our collectives)."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from . import expert_parallel, mla_prefill, prefix_caching, rope

    missing = []
    if not getattr(RotaryEmbedding.forward_cpu, rope.MARKER, False):
        missing.append("RotaryEmbedding.forward_cpu (rope)")
    if not getattr(CPUUnquantizedExperts.apply, expert_parallel.MARKER, False):
        missing.append("CPUUnquantizedExperts.apply (expert_map)")
    for name in ("all_gatherv", "reduce_scatterv"):
        if getattr(CpuCommunicator, name) is not getattr(expert_parallel, name):
            missing.append(f"CpuCommunicator.{name}")
    missing.extend(
        f"{cls.__name__}.__init__ (refusal under expert parallelism)"
        for cls in _quantized_cpu_experts()
        if not getattr(cls.__dict__.get("__init__"), expert_parallel.REFUSAL_MARKER, False)
    )
    if _prefix_caching_checked() and not prefix_caching.installed(_cpu_platform()):
        missing.append("CpuPlatform.check_and_update_config (prefix caching for MLA)")
    if not mla_prefill.installed(_mla_prefill_backend()):
        missing.append("CPUSDPAMLAPrefillBackend._ragged_sdpa (fused MLA prefill attention)")
    return missing


def verify_installed(environ: Mapping[str, str]) -> None:
    """In a process where vLLM's plugins should have run: what the knobs ask for is in place.

    The general plugin can be left out without a word: a ``VLLM_PLUGINS`` allowlist without
    ``pcp_nixl_cpu_fixes``, a ``PYTHONPATH`` without ``connector/`` (whose dist-info declares the
    entry points), or an import error that vLLM only logs. The rope defect then silently comes
    back, so the connector's worker calls this and the server stops instead.
    """
    if not _is_cpu_build():
        return
    if knob_on(environ, TRITON_INTERPRETER_ENV):
        check_triton_interpreter()
    if not knob_on(environ, FIXES_ENV):
        return
    missing = missing_fixes() + missing_knob_fixes(environ)
    if missing:
        raise CpuCompatError(
            f"{FIXES_ENV}=1 but this vLLM process lacks the kit's CPU fixes "
            f"({', '.join(missing)}): vLLM did not run the general plugin 'pcp_nixl_cpu_fixes'. "
            "Check that VLLM_PLUGINS, if set, includes pcp_nixl_cpu_fixes, that the connector "
            "folder is on PYTHONPATH (its pcp_nixl_connector-*.dist-info declares the plugin), "
            "and vLLM's log for a plugin that failed to load"
        )


def _mla_prefill_backend() -> type:
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    return CPUSDPAMLAPrefillBackend


def _spin_condition() -> type:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return SpinCondition


def missing_knob_fixes(environ: Mapping[str, str]) -> list[str]:
    """What ``apply_knob_fixes`` puts in place for these knobs that this process lacks."""
    from . import idle_wait, native_kernels

    missing = []
    if knob_on(environ, TRITON_INTERPRETER_ENV) and not native_kernels.installed():
        missing.append("Model Runner V2's kernels in torch (native_kernels)")
    if knob_on(environ, SLEEPING_WAIT_ENV) and not idle_wait.installed(_spin_condition()):
        missing.append("SpinCondition.wait (workers sleep instead of spinning)")
    return missing


def _cpu_platform() -> type:
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform


def _prefix_caching_checked() -> bool:
    from . import upstream_gate

    try:
        upstream_gate.check(upstream_gate.PREFIX_CACHING)
    except upstream_gate.UpstreamGateError:
        return False
    return True


def _install_prefix_caching() -> bool:
    """The prefix-caching fix, or on a vLLM it was not read against a warning and vLLM's own
    rule (caching off for MLA): leaving it off is safe, so this never stops the server."""
    from . import prefix_caching, upstream_gate

    try:
        return prefix_caching.install(_cpu_platform())
    except upstream_gate.UpstreamGateError as exc:
        logger.warning("pcp_nixl_connector: prefix caching stays off for MLA models: %s", exc)
        return False


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
        installed = apply_fixes() + apply_knob_fixes(os.environ)
    except (ImportError, AttributeError) as exc:
        raise CpuCompatError(
            f"{FIXES_ENV}=1: a vLLM class the CPU fixes patch has moved ({exc}); these fixes "
            f"are written for vLLM {and_list(list(CPU_CHECKED))}"
        ) from exc
    for name in installed:
        logger.info("pcp_nixl_connector CPU fix: %s", name)
