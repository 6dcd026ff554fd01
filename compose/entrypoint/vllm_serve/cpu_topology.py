"""A CPU server's topology (compose's cpu profile): PCP ranks, expert parallelism over them, one
core group per rank from the container's cpuset, and the prefix-caching switch.

The flags come from the connector's one launch rule (pcp_nixl_connector.cpu_compat.launch),
imported when a CPU server asks for them, so this module stays standard library only at import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .switches import SWITCH_OFF, SWITCH_ON, one_or_zero

# A CPU server's topology (compose's cpu profile): PCP ranks, expert parallelism over them. The
# cores are the container's cpuset, split evenly over the ranks.
CPU_PCP_ENV = "KIT_CPU_PCP_SIZE"
CPU_EP_ENV = "KIT_CPU_EXPERT_PARALLEL"
# A CPU server's prefix caching, true or false (.env PREFIX_CACHING); unset: vLLM's default.
PREFIX_CACHING_ENV = "KIT_PREFIX_CACHING"


def cpu_topology(
    env: Mapping[str, str], cores: Sequence[int], argv: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """vLLM flags and environment for a CPU server with KIT_CPU_PCP_SIZE ranks on ``cores``
    (none when the variable is unset: the GPU services), from the connector's one launch rule,
    with the prefix-caching switch from KIT_PREFIX_CACHING (``argv``: the server's own flags,
    which must not switch it too)."""
    raw = env.get(CPU_PCP_ENV, "").strip()
    if not raw:
        return [], {}
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"{CPU_PCP_ENV}={raw!r} (CPU_PREFILL_PCP_SIZE): want an integer >= 1")
    ep = env.get(CPU_EP_ENV, "0").strip()
    expert_parallel = one_or_zero(CPU_EP_ENV, ep, "CPU_PREFILL_EXPERT_PARALLEL")
    from pcp_nixl_connector.cpu_compat.launch import cpu_server_launch

    try:
        flags, cpu_env = cpu_server_launch(int(raw), expert_parallel, cores)
    except ValueError as exc:
        raise ValueError(f"{CPU_PCP_ENV}={raw} on this container's CPUs: {exc}") from None
    return [*flags, *prefix_caching_flags(env, argv)], cpu_env


def prefix_caching_flags(env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """``--enable-prefix-caching`` or ``--no-enable-prefix-caching`` from KIT_PREFIX_CACHING
    (none when unset); ValueError for another value, or when ``argv`` switches it as well (two
    switches would leave the last one winning, silently)."""
    raw = env.get(PREFIX_CACHING_ENV, "").strip()
    if not raw:
        return []
    from pcp_nixl_connector.cpu_compat.launch import gives_prefix_caching_flag, prefix_caching_flag

    word = raw.lower()
    if word not in SWITCH_ON and word not in SWITCH_OFF:
        raise ValueError(f"{PREFIX_CACHING_ENV}={raw!r} (PREFIX_CACHING): want true or false")
    if gives_prefix_caching_flag(argv):
        raise ValueError(
            "--enable-prefix-caching/--no-enable-prefix-caching is in the arguments "
            f"(VLLM_CPU_EXTRA_ARGS?): the entrypoint adds it from {PREFIX_CACHING_ENV}; set "
            "PREFIX_CACHING=true or false in .env instead"
        )
    return [prefix_caching_flag(word in SWITCH_ON)]


def prefix_caching_on(env: Mapping[str, str], argv: Sequence[str]) -> bool:
    """Whether vLLM will cache prefixes: KIT_PREFIX_CACHING when set, else the last switch in
    ``argv``, else vLLM's default (on)."""
    raw = env.get(PREFIX_CACHING_ENV, "").strip().lower()
    if raw:
        return raw in SWITCH_ON
    from pcp_nixl_connector.cpu_compat.launch import PREFIX_CACHING_FLAGS

    on = True
    for arg in argv:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in PREFIX_CACHING_FLAGS:
            on = name == PREFIX_CACHING_FLAGS[0]
    return on
