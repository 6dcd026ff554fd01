"""The prefill's KV lease against pd-proxy's limits, as Compose will start the containers: a
decode that answers after the lease ran out may have read KV blocks the prefill already freed and
reused (HTTP 200, wrong text). The rule is pd-proxy's own (proxy/pd_proxy/timeouts.py, standard
library only, imported from the checkout), read here from the resolved services' environments:
the kv_producer's KIT_NIXL_KV_LEASE_S (vLLM's default when unset) and each pd-proxy service's
PD_PROXY_* limits (the proxy's defaults when unset)."""

from __future__ import annotations

import sys
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result, fail, ok

# pd_proxy is not installed for a host's system python3; its timeouts module needs nothing else.
_PROXY_DIR = str(repo_root() / "proxy")
if _PROXY_DIR not in sys.path:
    sys.path.append(_PROXY_DIR)
from pd_proxy.timeouts import (  # noqa: E402
    KIT_NAMES,
    VLLM_DEFAULT_KV_LEASE_S,
    ProxyLimits,
    timeout_problems,
)

CHECK = "timeouts"
#: pd-proxy's --health-timeout default (the block-size wait with --first-token-from-prefill).
PROXY_HEALTH_TIMEOUT_S = 2.0
_TRUE = ("1", "true", "yes", "on")


class _Bad(ValueError):
    """A value that is not a number; the message is the FAIL sentence."""


def service_env(service: Any) -> dict[str, str]:
    """A resolved service's environment as text (Compose gives a mapping; a list is accepted)."""
    raw = service.get("environment") if isinstance(service, dict) else None
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw if isinstance(item, str) and "=" in item)
    if not isinstance(raw, dict):
        return {}
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def _seconds(env: dict[str, str], key: str, default: float, where: str, knob: str) -> float:
    text = env.get(key, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise _Bad(f"service {where} has {key}='{text}', not seconds > 0: set {knob}")
    return value


def kv_timeouts(ctx: Context) -> list[Result]:
    """One line per pd-proxy service: ok, or FAIL naming the lease and the limits outlasting it."""
    view = ctx.view
    if view is None:
        return []
    envs = {name: service_env(svc) for name, svc in sorted(view.services.items())}
    producers = {n: e for n, e in envs.items() if e.get("KIT_KV_ROLE") == "kv_producer"}
    proxies = {n: e for n, e in envs.items() if any(k.startswith("PD_PROXY_") for k in e)}
    if not proxies:
        return []
    results = []
    try:
        leases = {
            name: (
                _seconds(
                    env, "KIT_NIXL_KV_LEASE_S", VLLM_DEFAULT_KV_LEASE_S, name, KIT_NAMES["lease"]
                ),
                "KIT_NIXL_KV_LEASE_S"
                if env.get("KIT_NIXL_KV_LEASE_S", "").strip()
                else "vLLM's default",
            )
            for name, env in producers.items()
        }
        for name, env in proxies.items():
            results.append(_one_proxy(ctx, name, env, leases))
    except _Bad as exc:
        results.append(fail(CHECK, f"{exc} in {ctx.env_label}."))
    return results


def _one_proxy(
    ctx: Context, name: str, env: dict[str, str], leases: dict[str, tuple[float, str]]
) -> Result:
    defaults = ProxyLimits()
    wait = 0.0
    if env.get("PD_PROXY_FIRST_TOKEN_FROM_PREFILL", "").strip().lower() in _TRUE:
        knob = KIT_NAMES["block_size_wait"]
        wait = _seconds(env, "PD_PROXY_HEALTH_TIMEOUT", PROXY_HEALTH_TIMEOUT_S, name, knob)
    limits = ProxyLimits(
        _seconds(env, "PD_PROXY_CONNECT_TIMEOUT", defaults.connect_s, name, KIT_NAMES["connect"]),
        _seconds(env, "PD_PROXY_PREFILL_TIMEOUT", defaults.prefill_s, name, KIT_NAMES["prefill"]),
        _seconds(env, "PD_PROXY_DECODE_TIMEOUT", defaults.decode_s, name, KIT_NAMES["decode"]),
        wait,
    )
    told = env.get("PD_PROXY_KV_LEASE_S", "").strip()
    told_s = _seconds(env, "PD_PROXY_KV_LEASE_S", 0.0, name, KIT_NAMES["lease"]) if told else None
    if not leases:  # no kv_producer selected: judge by what the proxy was told, if anything
        if told_s is None:
            return ok(CHECK, f"{name}: no prefill service selected, no KV lease to check against")
        leases = {"the prefill": (told_s, "PD_PROXY_KV_LEASE_S")}
    producer, (lease, how) = min(leases.items(), key=lambda item: item[1][0])
    # First what the proxy was told: its own start-up check trusts it, and a lease that never
    # reached the prefill is the cause to name, not the rule it then breaks.
    if told_s is not None and told_s != lease:
        unset = "; compose passes it no KIT_NIXL_KV_LEASE_S" if how == "vLLM's default" else ""
        return fail(
            CHECK,
            f"{name} checks its limits against a KV lease of {told_s:g} s (PD_PROXY_KV_LEASE_S), "
            f"but {producer} keeps KV for {lease:g} s ({how}{unset}): both must get the lease "
            f"{KIT_NAMES['lease']} sets in {ctx.env_label}.",
        )
    problems = timeout_problems(lease, limits, names=KIT_NAMES)
    if problems:
        return fail(CHECK, f"{name} in front of {producer} ({ctx.env_label}): {problems[0]}")
    return ok(
        CHECK,
        f"{name}: the KV lease on {producer} ({lease:g} s) outlasts the longest the proxy waits "
        f"for decode's first byte ({limits.decode_wait_s():g} s: decode timeout "
        f"{limits.decode_s:g} s + 2 x connect {limits.connect_s:g} s"
        f"{f' + block-size lookup {wait:g} s' if wait else ''})",
    )
