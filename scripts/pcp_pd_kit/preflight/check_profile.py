"""Which stack `docker compose up` would start: GPU checks run only when a selected service
reserves GPUs. An explicit `--profile cpu` / COMPOSE_PROFILES=cpu skips them even before Compose
has answered; otherwise the resolved services decide (so COMPOSE_PROFILES in .env counts too)."""

from __future__ import annotations

from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result, ok, warn
from pcp_pd_kit.preflight.settings import gpu_services

CHECK = "profile"


def choose_mode(ctx: Context) -> list[Result]:
    """Set ctx.gpu_mode and say why when the GPU checks are skipped."""
    if ctx.profiles:
        chosen, label = ctx.profiles, "--profile " + ",".join(ctx.profiles)
    else:
        chosen = [p.strip() for p in ctx.environ.get("COMPOSE_PROFILES", "").split(",")]
        chosen = [p for p in chosen if p]
        label = "COMPOSE_PROFILES=" + ",".join(chosen)
    if "cpu" in chosen and "gpu" not in chosen:
        ctx.gpu_mode = False
        return [ok(CHECK, f"{label}: GPU checks skipped")]
    if ctx.view is None:
        ctx.gpu_mode = True
        return []
    reserving = gpu_services(ctx.view)
    if reserving:
        ctx.gpu_mode = True
        return [ok(CHECK, f"services reserving GPUs: {', '.join(reserving)}")]
    ctx.gpu_mode = False
    if not ctx.view.services:
        msg = (
            "no service is selected, so 'docker compose up' would start nothing: set "
            f"COMPOSE_PROFILES=gpu (or cpu) in {ctx.env_label}."
        )
        return [warn(CHECK, msg)]
    names = ", ".join(sorted(ctx.view.services))
    return [ok(CHECK, f"no selected service reserves a GPU ({names}): GPU checks skipped")]
