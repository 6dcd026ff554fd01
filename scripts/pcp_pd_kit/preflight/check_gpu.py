"""Checks of the GPUs against the settings: nvidia-smi works, there are enough GPUs, and
PREFILL_GPUS / DECODE_GPUS name existing, distinct GPUs (by index or UUID) in the right number."""

from __future__ import annotations

import shutil

from pcp_pd_kit.preflight import gpus, proc
from pcp_pd_kit.preflight.context import QUICK_S, Context
from pcp_pd_kit.preflight.report import Result, fail, ok
from pcp_pd_kit.preflight.settings import Settings, SettingsError

ROLES = ("prefill", "decode")


def inventory(ctx: Context) -> list[Result]:
    """nvidia-smi works and lists the GPUs; with settings, their number and the configured ids."""
    if shutil.which(ctx.nvidia_smi) is None:
        msg = (
            "nvidia-smi is not installed, so no NVIDIA driver is visible: install the NVIDIA "
            "driver for your GPUs (or use COMPOSE_PROFILES=cpu)."
        )
        return [fail("gpus", msg)]
    out = proc.run([ctx.nvidia_smi, *gpus.QUERY_ARGS], QUICK_S)
    if not out.ok:
        msg = (
            f"nvidia-smi failed ({out.detail()}), so the NVIDIA driver is not working: check "
            "'nvidia-smi' output and reinstall or reload the driver."
        )
        return [fail("gpus", msg)]
    try:
        found = gpus.parse_inventory(out.stdout)
    except ValueError as exc:
        msg = (
            f"nvidia-smi answered the GPU query oddly ({exc}): update the NVIDIA driver "
            "(preflight queries compute_cap, known to drivers 510 and later)."
        )
        return [fail("gpus", msg)]
    ctx.gpus = found
    if ctx.settings is None:
        return [ok("gpus", f"{len(found)} GPU(s) listed by nvidia-smi")]
    try:
        return _count(ctx, found) + _ids(ctx, found)
    except SettingsError as exc:
        return [fail("gpus", str(exc))]


def _sizes(s: Settings) -> tuple[int, int, int]:
    return (
        s.positive_int("prefill_tp_size"),
        s.positive_int("prefill_pcp_size"),
        s.positive_int("decode_tp_size"),
    )


def _count(ctx: Context, found: list[gpus.Gpu]) -> list[Result]:
    tp, pcp, dtp = _sizes(ctx.need_settings())
    need = tp * pcp + dtp
    if len(found) >= need:
        return [
            ok(
                "gpus",
                f"{len(found)} GPU(s) for {need} needed (prefill {tp} x {pcp}, decode {dtp})",
            )
        ]
    msg = (
        f"found {len(found)} GPU(s) but prefill needs PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE = "
        f"{tp} x {pcp} = {tp * pcp} and decode DECODER_TP_SIZE = {dtp}, {need} in all: use a "
        f"bigger host or lower those sizes in {ctx.env_label}."
    )
    return [fail("gpus", msg)]


def _ids(ctx: Context, found: list[gpus.Gpu]) -> list[Result]:
    """Resolve both id lists; fills ctx.assigned with the GPUs that resolved cleanly."""
    s = ctx.need_settings()
    tp, pcp, dtp = _sizes(s)
    wants = {
        "prefill": (
            "prefill_gpus",
            tp * pcp,
            f"PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE = {tp} x {pcp} = {tp * pcp}",
        ),
        "decode": ("decode_gpus", dtp, f"DECODER_TP_SIZE = {dtp}"),
    }
    listing = ", ".join(str(g.index) for g in found) or "none"
    owner: dict[int, str] = {}
    problems: list[str] = []
    placed: list[str] = []
    for role in ROLES:
        key, want, why = wants[role]
        env, ids = s.env(key), s.id_list(key)
        ctx.assigned[role] = []
        if len(ids) != want:
            problems.append(
                f"{env}='{s.text(key)}' lists {len(ids)} GPU(s) but {why}: list exactly {want} "
                f"GPU id(s) in {env} in {ctx.env_label}."
            )
        names = []
        for gpu_id in ids:
            gpu = gpus.resolve(gpu_id, found)
            if gpu is None:
                problems.append(
                    f"{env} names GPU '{gpu_id}', which nvidia-smi does not list (it lists "
                    f"{listing}): set {env} in {ctx.env_label} to GPU indices or UUIDs from "
                    "'nvidia-smi -L'."
                )
            elif owner.get(gpu.index) == env:
                problems.append(
                    f"{gpus.describe(gpu_id, gpu)} appears twice in {env}: list each GPU once "
                    f"in {ctx.env_label}."
                )
            elif gpu.index in owner:
                problems.append(
                    f"GPU {gpu.index} is given to both {owner[gpu.index]} and {env} "
                    f"({gpus.describe(gpu_id, gpu)}): give every server its own GPUs in "
                    f"{ctx.env_label}."
                )
            else:
                owner[gpu.index] = env
                ctx.assigned[role].append(gpu)
                names.append(gpus.describe(gpu_id, gpu))
        placed.append(f"{role} on {', '.join(names)}")
    if problems:
        return [fail("gpu-ids", msg) for msg in problems]
    return [ok("gpu-ids", "; ".join(placed))]
