"""GPU memory per server: the configured fraction of the smallest assigned GPU must hold one
rank's weights plus the runtime and KV reserves; when it does not, print the fraction to set."""

from __future__ import annotations

import math

from pcp_pd_kit.preflight import memory
from pcp_pd_kit.preflight.check_gpu import ROLES
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result, fail, ok, warn
from pcp_pd_kit.preflight.settings import SettingsError

CHECK = "memory"


def gpu_memory(ctx: Context) -> list[Result]:
    s = ctx.need_settings()
    info, model = ctx.model_info(), ctx.model_name()
    if info.size is None:
        msg = (
            f"could not estimate the size of {model} ({info.source}), so GPU memory was not "
            "checked: download the model first (its config.json is enough) or check the "
            "fractions by hand."
        )
        return [warn(CHECK, msg)]
    try:
        shapes = {role.name: role.shape(s) for role in ROLES}
        max_len = s.positive_int("max_model_len")
    except SettingsError as exc:
        return [fail(CHECK, str(exc))]
    results = []
    for role in ROLES:
        try:
            fraction = s.fraction(role.fraction)
        except SettingsError as exc:
            results.append(fail(CHECK, str(exc)))
            continue
        sized = [g for g in ctx.assigned.get(role.name, []) if g.memory_mib]
        if not sized:
            continue  # no valid GPU ids (already a FAIL), or nvidia-smi showed no memory size
        # TP splits the dense weights; expert parallelism spreads the routed experts over all.
        tp_size, expert_ranks = shapes[role.name][0], math.prod(shapes[role.name])
        size = info.size
        weights = memory.weights_per_rank(
            size.total_params, size.expert_params, size.bytes_per_param, tp_size, expert_ranks
        )
        kv_token = size.kv_bytes_per_token / (tp_size if size.kv_split_by_tp else 1)
        need = memory.need(weights, memory.kv_reserve(kv_token, max_len))
        gpu = min(sized, key=lambda g: g.memory_mib or 0)
        mib = gpu.memory_mib or 0
        verdict = memory.judge(need.total, mib, fraction)
        env, least = s.env(role.fraction), memory.ceil2(verdict.required)
        if verdict.fits:
            msg = (
                f"{role.name} fits: {env}={fraction:g} of {gpu.label}'s {mib} MiB = "
                f"{int(fraction * mib)} MiB holds {need.describe()} (needs >= {least:.2f}; "
                f"sizes from {info.source})"
            )
            results.append(ok(CHECK, msg))
        elif verdict.suggested is not None:
            msg = (
                f"{role.name} needs >= {least:.2f} of {gpu.label}'s {mib} MiB for "
                f"{need.describe()}, but {env}={fraction:g}: set {env}={verdict.suggested:.2f} "
                f"in {ctx.env_label}."
            )
            results.append(fail(CHECK, msg))
        else:
            msg = (
                f"{model} does not fit {gpu.label} at this TP: a {role.name} rank needs "
                f"{need.describe()}, {least:.2f} of its {mib} MiB, more than "
                f"{memory.MAX_FRACTION}: {role.more_gpus} or use GPUs with more memory."
            )
            results.append(fail(CHECK, msg))
    return results
