"""Checks of the GPUs against the settings: nvidia-smi works, there are enough GPUs, and
PREFILL_GPUS / DECODE_GPUS name existing, distinct GPUs (by index or UUID) in the right number."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass

from pcp_pd_kit.preflight import gpus, proc
from pcp_pd_kit.preflight.context import QUICK_S, Context
from pcp_pd_kit.preflight.report import Result, fail, ok
from pcp_pd_kit.preflight.settings import Settings, SettingsError


@dataclass(frozen=True)
class Role:
    """A server's settings: its GPU list, the sizes whose product is its GPU count (TP first;
    expert parallelism spreads the routed experts over all of them), its memory fraction, and
    how to give it more GPUs."""

    name: str
    gpus: str
    sizes: tuple[str, ...]
    fraction: str
    more_gpus: str

    def shape(self, s: Settings) -> list[int]:
        return [s.positive_int(key) for key in self.sizes]

    def why(self, s: Settings) -> str:
        """`PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE = 1 x 2 = 2`, `DECODER_TP_SIZE = 1`."""
        values = self.shape(s)
        text = " x ".join(s.env(k) for k in self.sizes) + " = " + " x ".join(map(str, values))
        return text + (f" = {math.prod(values)}" if len(values) > 1 else "")


ROLES = (
    Role("prefill", "prefill_gpus", ("prefill_tp_size", "prefill_pcp_size"),
         "prefill_gpu_memory_utilization",
         "raise PREFILLER_PCP_SIZE or PREFILLER_TP_SIZE (more GPUs share the weights)"),
    Role("decode", "decode_gpus", ("decode_tp_size",), "decode_gpu_memory_utilization",
         "raise DECODER_TP_SIZE (more GPUs share the weights)"),
)  # fmt: skip


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


def _count(ctx: Context, found: list[gpus.Gpu]) -> list[Result]:
    s = ctx.need_settings()
    need = sum(math.prod(role.shape(s)) for role in ROLES)
    if len(found) >= need:
        shapes = ", ".join(f"{r.name} {' x '.join(map(str, r.shape(s)))}" for r in ROLES)
        return [ok("gpus", f"{len(found)} GPU(s) for {need} needed ({shapes})")]
    needs = " and ".join(f"{role.name} needs {role.why(s)}" for role in ROLES)
    msg = (
        f"found {len(found)} GPU(s) but {needs}, {need} in all: use a bigger host or lower those "
        f"sizes in {ctx.env_label}."
    )
    return [fail("gpus", msg)]


def _ids(ctx: Context, found: list[gpus.Gpu]) -> list[Result]:
    """Resolve both id lists; fills ctx.assigned with the GPUs that resolved cleanly."""
    s = ctx.need_settings()
    listing = ", ".join(str(g.index) for g in found) or "none"
    owner: dict[int, str] = {}
    problems: list[str] = []
    placed: list[str] = []
    for role in ROLES:
        env, ids, want = s.env(role.gpus), s.id_list(role.gpus), math.prod(role.shape(s))
        ctx.assigned[role.name] = []
        if len(ids) != want:
            problems.append(
                f"{env}='{s.text(role.gpus)}' lists {len(ids)} GPU(s) but {role.why(s)}: list "
                f"exactly {want} GPU id(s) in {env} in {ctx.env_label}."
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
                ctx.assigned[role.name].append(gpu)
                names.append(gpus.describe(gpu_id, gpu))
        placed.append(f"{role.name} on {', '.join(names)}")
    if problems:
        return [fail("gpu-ids", msg) for msg in problems]
    return [ok("gpu-ids", "; ".join(placed))]
