"""Prefix caching for MLA models on vLLM's CPU build (reference ``CPU_MLA`` backend).

``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``, end of the method, in
0.32.0) turns chunked prefill *and* prefix caching off for every MLA model that does not run the
AMX MLA backend, whatever ``--enable-prefix-caching`` says. The kit pins ``CPU_MLA``, so every
CPU server it starts had no prefix cache.

The chunked-prefill half is needed: the reference backend splits no prompt. The prefix-caching
half is not, in 0.32.0: a prefill whose first blocks come from the cache runs MLA's generic
context path (``MLACommonBaseImpl.forward_mha`` -> ``_compute_prefill_context``), which on CPU
takes a branch of its own - ``ops.gather_mla_context_cache_cpu`` (plain torch) instead of the
CUDA gather ops, the ``CPU_SDPA_MLA`` prefill backend's dense attention for both the new tokens
and the context, and the torch fallback of ``merge_attn_states`` (docs/cpu.md traces it). So this
fix puts the user's choice back after the platform ran: prefix caching as asked (on by default),
chunked prefill still off.

It installs only on the vLLM releases ``upstream_gate`` lists for it; on another release it
leaves vLLM as it is (caching off) and says so. The canary in
``tests/connector/test_upstream_canaries.py`` fails once vLLM stops forcing caching off, or
changes how.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import upstream_gate

MARKER = "_pcp_nixl_cpu_prefix_caching"
#: vLLM's model_type for which the CPU platform has its own (AMX-only) MLA path.
DEEPSEEK_V4 = "deepseek_v4"

logger = logging.getLogger(f"vllm.{__name__}")


def forced_off_for_mla(wanted: bool | None, vllm_config: Any) -> bool:
    """True when the platform turned off prefix caching that ``wanted`` asked for, on the kit's
    MLA path: an MLA model other than DeepSeek-V4, chunked prefill left off."""
    model_config = vllm_config.model_config
    if not wanted or model_config is None or not getattr(model_config, "use_mla", False):
        return False
    model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    if model_type == DEEPSEEK_V4:
        return False
    return (
        not vllm_config.cache_config.enable_prefix_caching
        and not vllm_config.scheduler_config.enable_chunked_prefill
    )


def check_and_update_config_fixed(original: Callable[[Any], None]) -> Callable[[Any, Any], None]:
    """A ``check_and_update_config`` (classmethod body) that runs ``original`` (bound) and then
    gives back prefix caching where only the MLA rule took it away."""

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.cache_config.enable_prefix_caching
        original(vllm_config)
        if forced_off_for_mla(wanted, vllm_config):
            vllm_config.cache_config.enable_prefix_caching = True
            logger.info(
                "pcp_nixl_connector CPU fix: prefix caching kept on for MLA on the reference "
                "CPU backend (vLLM turned it off; chunked prefill stays off)"
            )

    setattr(check_and_update_config, MARKER, True)
    return check_and_update_config


def install(platform_cls: Any, vllm_version: str | None = None) -> bool:
    """Patch ``platform_cls.check_and_update_config`` once; False when it already is. Raises
    ``UpstreamGateError`` on a vLLM the fix was not checked against (default: the installed)."""
    upstream_gate.check(upstream_gate.PREFIX_CACHING, vllm_version)
    current = platform_cls.check_and_update_config
    if getattr(current, MARKER, False):
        return False
    platform_cls.check_and_update_config = classmethod(check_and_update_config_fixed(current))
    return True


def installed(platform_cls: Any) -> bool:
    return bool(getattr(platform_cls.check_and_update_config, MARKER, False))
