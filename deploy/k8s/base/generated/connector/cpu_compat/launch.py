"""What a CPU vLLM server's launcher adds for the kit's topology: flags and environment.

One function for both launchers (the local stack's ``commands.py`` and the containers'
entrypoint), so a PCP prefill gets the same flags, core groups and plugin knobs everywhere.
Standard library only: the entrypoint runs it before vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import FIXES_ENV, TRITON_INTERPRETER_ENV
from .binding import omp_threads_bind


def cpu_server_launch(
    pcp_size: int, expert_parallel: bool, cores: Sequence[int]
) -> tuple[list[str], dict[str, str]]:
    """(extra vLLM flags, extra environment) for a CPU server with ``pcp_size`` ranks on ``cores``.

    Every CPU server gets the kit's CPU fixes (correct MLA rope, expert-parallel MoE); a PCP
    prefill also gets Model Runner V2's Triton kernels in Triton's interpreter,
    and expert parallelism over its PCP ranks when asked. ValueError when the cores cannot be
    split evenly over the ranks.
    """
    if pcp_size < 1:
        raise ValueError(f"PCP size must be >= 1, got {pcp_size}")
    env = {FIXES_ENV: "1", "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(cores, pcp_size)}
    flags: list[str] = []
    if pcp_size > 1:
        flags += ["--prefill-context-parallel-size", str(pcp_size)]
        if expert_parallel:
            flags.append("--enable-expert-parallel")
        env[TRITON_INTERPRETER_ENV] = "1"
    return flags, env
