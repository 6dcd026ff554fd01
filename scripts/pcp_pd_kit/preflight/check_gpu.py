"""Checks of the GPUs against the settings: nvidia-smi works, there are enough GPUs, and
PREFILL_GPUS / DECODE_GPUS name existing, distinct GPUs (by index or UUID) in the right number.

With several replicas per role (PREFILL_REPLICAS / DECODE_REPLICAS) each list holds every
replica's GPUs and each replica takes its own run of them: the servers' entrypoint decides which
(compose/entrypoint/vllm_serve, imported), and preflight applies that same rule and
prints each replica's GPUs."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass

from pcp_pd_kit.preflight import entrypoint, gpus, proc
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
    replicas: str
    kv_role: str  # the entrypoint's KIT_KV_ROLE, whose knob names its messages use

    def shape(self, s: Settings) -> list[int]:
        """One replica's sizes."""
        return [s.positive_int(key) for key in self.sizes]

    def count(self, s: Settings) -> int:
        """How many replicas (1 when compose.yaml's settings block predates the knob)."""
        return s.positive_int(self.replicas) if s.has(self.replicas) else 1

    def need(self, s: Settings) -> int:
        """The role's GPUs: replicas x one replica's."""
        return self.count(s) * math.prod(self.shape(s))

    def why(self, s: Settings) -> str:
        """`PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE = 1 x 2 = 2`, `DECODER_TP_SIZE = 1`; with
        several replicas `PREFILL_REPLICAS x PREFILLER_TP_SIZE x ... = 2 x 1 x 2 = 4`."""
        keys, values = list(self.sizes), self.shape(s)
        if self.count(s) > 1:
            keys, values = [self.replicas, *keys], [self.count(s), *values]
        text = " x ".join(s.env(k) for k in keys) + " = " + " x ".join(map(str, values))
        return text + (f" = {math.prod(values)}" if len(values) > 1 else "")


ROLES = (
    Role("prefill", "prefill_gpus", ("prefill_tp_size", "prefill_pcp_size"),
         "prefill_gpu_memory_utilization",
         "raise PREFILLER_PCP_SIZE or PREFILLER_TP_SIZE (more GPUs share the weights)",
         "prefill_replicas", "kv_producer"),
    Role("decode", "decode_gpus", ("decode_tp_size",), "decode_gpu_memory_utilization",
         "raise DECODER_TP_SIZE (more GPUs share the weights)", "decode_replicas", "kv_consumer"),
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
    need = sum(role.need(s) for role in ROLES)
    if len(found) >= need:
        shapes = ", ".join(_shape(r, s) for r in ROLES)
        return [ok("gpus", f"{len(found)} GPU(s) for {need} needed ({shapes})")]
    needs = " and ".join(f"{role.name} needs {role.why(s)}" for role in ROLES)
    fewer = any(role.count(s) > 1 for role in ROLES)
    msg = (
        f"found {len(found)} GPU(s) but {needs}, {need} in all: use a bigger host or lower those "
        f"sizes{' or replica counts' if fewer else ''} in {ctx.env_label}."
    )
    return [fail("gpus", msg)]


def _shape(role: Role, s: Settings) -> str:
    """`prefill 1 x 2`, or `prefill 2 x (1 x 2)` for two replicas."""
    one = " x ".join(map(str, role.shape(s)))
    if role.count(s) == 1:
        return f"{role.name} {one}"
    return f"{role.name} {role.count(s)} x ({one})"


def _ids(ctx: Context, found: list[gpus.Gpu]) -> list[Result]:
    """Resolve both id lists; fills ctx.assigned with the GPUs that resolved cleanly."""
    s = ctx.need_settings()
    listing = ", ".join(str(g.index) for g in found) or "none"
    owner: dict[int, str] = {}
    problems: list[str] = []
    placed: list[str] = []
    for role in ROLES:
        env, ids = s.env(role.gpus), s.id_list(role.gpus)
        replicas, per_replica = role.count(s), math.prod(role.shape(s))
        ctx.assigned[role.name] = []
        try:
            # The entrypoint's rule: replica i takes the i-th run of TP x PCP (x PP) ids.
            knobs = entrypoint.ROLE_KNOBS[role.kv_role]
            slices = [
                entrypoint.replica_gpus(ids, replicas, per_replica, index, knobs)
                for index in range(1, replicas + 1)
            ]
        except ValueError as exc:
            slices = []
            if len(ids) != replicas * per_replica:  # a GPU listed twice is reported below
                problems.append(f"{exc}, in {ctx.env_label}{_fix(role, s)}.")
        problems += _command_sizes(ctx, role, per_replica)
        names: dict[str, str] = {}
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
                names[gpu_id] = gpus.describe(gpu_id, gpu)
        for index, own in enumerate(slices, start=1):
            placed.append(f"{role.name}-{index}: {', '.join(names.get(g, g) for g in own)}")
    if problems:
        return [fail("gpu-ids", msg) for msg in problems]
    return [ok("gpu-ids", "; ".join(placed))]


def _fix(role: Role, s: Settings) -> str:
    """More of the fix for a list of the wrong length: what the host would need otherwise."""
    if role.count(s) == 1:
        return ""
    return (
        f", or change {s.env(role.replicas)} (each {role.name} replica takes "
        f"{' x '.join(s.env(k) for k in role.sizes)} GPUs)"
    )


def _command_sizes(ctx: Context, role: Role, per_replica: int) -> list[str]:
    """The GPUs per replica the server's own rendered flags give (what its entrypoint counts,
    VLLM_EXTRA_ARGS included) against the sizes' product; none when compose's model lacks the
    service's command."""
    service = ctx.view.services.get(role.name) if ctx.view is not None else None
    command = service.get("command") if isinstance(service, dict) else None
    if not isinstance(command, list):
        return []
    s = ctx.need_settings()
    try:
        got = entrypoint.gpus_per_replica([str(arg) for arg in command])
    except ValueError as exc:
        return [f"the {role.name} service's vLLM flags: {exc}; fix them in {ctx.env_label}."]
    if got == per_replica:
        return []
    sizes = " x ".join(s.env(k) for k in role.sizes)
    return [
        f"the {role.name} service's vLLM flags give {got} GPU(s) per replica (TP x PCP x PP) but "
        f"{sizes} = {per_replica}: set the parallel sizes with {sizes} only, not in "
        f"VLLM_EXTRA_ARGS, in {ctx.env_label}."
    ]
