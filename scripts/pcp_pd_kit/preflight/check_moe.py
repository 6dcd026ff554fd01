"""The GPU servers' kernel settings against vLLM 0.32.0. MOE_BACKEND: a name it knows, one it
accepts for an unquantized MoE model, and a kernel that runs on the assigned GPUs' compute
capability (else vLLM raises at start-up). ENFORCE_EAGER: read by the servers' entrypoint's own
switch parser (compose/entrypoint/vllm_serve, imported), so preflight refuses exactly
what the containers would refuse."""

from __future__ import annotations

from pcp_pd_kit.preflight import VLLM_VERSION, entrypoint, moe
from pcp_pd_kit.preflight.check_gpu import ROLES
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.gpus import Gpu
from pcp_pd_kit.preflight.report import Result, fail, ok

CHECK = "moe-backend"


def moe_backend(ctx: Context) -> list[Result]:
    raw = ctx.need_settings().text("moe_backend")
    backend = moe.normalize(raw)
    where = ctx.env_label
    if backend not in moe.BACKENDS:
        msg = (
            f"MOE_BACKEND='{raw}' is not a moe_backend of vLLM {VLLM_VERSION}: set MOE_BACKEND "
            f"in {where} to one of {', '.join(moe.BACKENDS)}."
        )
        return [fail(CHECK, msg)]
    info, model = ctx.model_info(), ctx.model_name()
    if info.size is not None and not info.size.is_moe:
        return [ok(CHECK, f"MOE_BACKEND={backend} is valid; {model} has no MoE layers")]
    if info.quantized is not False:
        return [
            ok(
                CHECK,
                f"MOE_BACKEND={backend} is a vLLM {VLLM_VERSION} name (whether it "
                f"suits {model}'s quantization, or unknown size, is left to vLLM)",
            )
        ]
    if backend not in moe.UNQUANTIZED + moe.FALLS_BACK_TO_AUTO:
        msg = (
            f"MOE_BACKEND={backend} is not accepted for an unquantized (bf16) MoE model such as "
            f"{model} by vLLM {VLLM_VERSION}, which takes only {', '.join(moe.UNQUANTIZED)} "
            f"there: set MOE_BACKEND=auto in {where}."
        )
        return [fail(CHECK, msg)]
    placed = [g for role in ROLES for g in ctx.assigned.get(role.name, []) if g.compute_cap]
    if not placed:
        return [ok(CHECK, f"MOE_BACKEND={backend} is valid (no GPU compute capability to compare)")]
    if backend in moe.FALLS_BACK_TO_AUTO:
        return [_auto_line(backend, placed)]
    unfit = [g for g in placed if g.compute_cap and not moe.runs_on(backend, g.compute_cap)]
    if unfit:
        names = ", ".join(f"{g.label} is {g.sm}" for g in unfit)
        msg = (
            f"MOE_BACKEND={backend} needs {moe.requirement(backend)} for bf16 MoE, but {names}, "
            f"so vLLM {VLLM_VERSION} refuses to start: set MOE_BACKEND=auto in {where}."
        )
        return [fail(CHECK, msg)]
    sms = ", ".join(sorted({g.sm for g in placed}))
    return [ok(CHECK, f"MOE_BACKEND={backend} runs on every assigned GPU ({sms})")]


def _auto_line(backend: str, placed: list[Gpu]) -> Result:
    caps = sorted({g.compute_cap for g in placed if g.compute_cap})
    picks = ", ".join(f"{moe.auto_choice(c)} on SM {c[0]}.{c[1]}" for c in caps)
    text = f"MOE_BACKEND={backend}: vLLM {VLLM_VERSION} tries {picks} first"
    if all(moe.runs_on("flashinfer_cutlass", c) for c in caps):
        text += (
            "; flashinfer_cutlass also runs on these GPUs and is the documented faster choice "
            "to benchmark (MOE_BACKEND=flashinfer_cutlass)"
        )
        if any(c[0] == 9 for c in caps):
            text += ", though vLLM's own oracle ranks FlashInfer behind Triton on Hopper"
    return ok(CHECK, text)


def enforce_eager(ctx: Context) -> list[Result]:
    """Silent when off (vLLM's compiled default); one line when eager; FAIL where the servers'
    entrypoint would refuse the value and exit before vLLM starts."""
    value = ctx.need_settings().text("enforce_eager")
    try:
        eager = entrypoint.enforce_eager({entrypoint.EAGER_ENV: value})
    except ValueError as exc:
        return [
            fail(
                "enforce-eager",
                f"{exc}: the vLLM servers would not start; fix it in {ctx.env_label}.",
            )
        ]
    if eager:
        return [
            ok(
                "enforce-eager",
                f"ENFORCE_EAGER={value}: both GPU servers run eager (no CUDA graphs)",
            )
        ]
    return []
