"""The GPU servers' UCX settings for the KV pull, as Compose renders them: the same rule the
servers' entrypoint applies at start (compose/entrypoint/vllm_serve/transport.py), so a
deployment whose pull would fall back to TCP is named before anything starts. What UCX really
picks needs the GPUs: each server reads it from UCX's own table at run time (docs/gpu.md,
"KV transport")."""

from __future__ import annotations

from typing import Any

from pcp_pd_kit.preflight import entrypoint, settings
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result, fail, ok

CHECK = "kv-transport"


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A rendered service's environment (Compose prints a mapping; a list is accepted too)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, "") for item in raw)
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def kv_transport(ctx: Context) -> list[Result]:
    view = ctx.view
    if view is None:
        return []
    problems = [
        f"{name}: {warning}"
        for name in settings.gpu_services(view)
        for warning in entrypoint.transport_warnings(environment(view.services[name]))
    ]
    if problems:
        msg = (
            f"{'; '.join(problems)}. Set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y on the GPU servers "
            f"(compose.yaml does) and keep cuda_ipc in UCX_TLS in {ctx.env_label}."
        )
        return [fail(CHECK, msg)]
    return [
        ok(
            CHECK,
            "the GPU servers force cuda_ipc GET zero-copy with cuda_ipc in UCX_TLS; each reads "
            "the transport UCX picks for the KV pull at run time",
        )
    ]
