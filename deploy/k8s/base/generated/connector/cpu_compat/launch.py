"""What a CPU vLLM server's launcher adds for the kit's topology: flags and environment.

One function for both launchers (the local stack's ``commands.py`` and the containers'
entrypoint), so a PCP prefill gets the same flags, core groups and plugin knobs everywhere.
Standard library only: the entrypoint runs it before vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import FIXES_ENV, SLEEPING_WAIT_ENV, TRITON_INTERPRETER_ENV
from .binding import omp_threads_bind

#: vLLM's two spellings of the prefix-caching switch; a launcher passes exactly one.
PREFIX_CACHING_FLAGS = ("--enable-prefix-caching", "--no-enable-prefix-caching")


def prefix_caching_flag(on: bool) -> str:
    """The vLLM flag for prefix caching on or off. On the CPU build, "on" takes effect for MLA
    models only with the kit's CPU fixes (``prefix_caching``), which every CPU server gets."""
    return PREFIX_CACHING_FLAGS[0] if on else PREFIX_CACHING_FLAGS[1]


def gives_prefix_caching_flag(argv: Sequence[str]) -> bool:
    """Whether argv already switches prefix caching (with ``=`` or underscores, as vLLM reads)."""
    names = {flag.replace("-", "_") for flag in PREFIX_CACHING_FLAGS}
    return any(arg.split("=", 1)[0].replace("-", "_") in names for arg in argv)


def cpu_server_launch(
    pcp_size: int, expert_parallel: bool, cores: Sequence[int], *, sleeping_wait: bool = True
) -> tuple[list[str], dict[str, str]]:
    """(extra vLLM flags, extra environment) for a CPU server with ``pcp_size`` ranks on ``cores``.

    Every CPU server gets the kit's CPU fixes (correct MLA rope, expert-parallel MoE, the fused
    MLA prefill attention); a PCP prefill also gets Model Runner V2's Triton kernels in Triton's
    interpreter (its hottest in torch), and expert parallelism over its PCP ranks when asked.
    ``sleeping_wait``: its workers sleep instead of spinning while they wait for a step, for the
    servers of a P/D pair, whose processes share the host's cores (a server alone on the host
    keeps vLLM's spin: sleeping cost it per-token latency). ValueError when the cores cannot be
    split evenly over the ranks.
    """
    if pcp_size < 1:
        raise ValueError(f"PCP size must be >= 1, got {pcp_size}")
    env = {FIXES_ENV: "1", "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(cores, pcp_size)}
    if sleeping_wait:
        env[SLEEPING_WAIT_ENV] = "1"
    flags: list[str] = []
    if pcp_size > 1:
        flags += ["--prefill-context-parallel-size", str(pcp_size)]
        if expert_parallel:
            flags.append("--enable-expert-parallel")
        env[TRITON_INTERPRETER_ENV] = "1"
    return flags, env
