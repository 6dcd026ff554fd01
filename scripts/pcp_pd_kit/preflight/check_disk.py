"""Free disk for what `up` will download: the model's missing weights under HF_CACHE_DIR (once;
prefill and decode share the cache) and, when VLLM_IMAGE is not pulled, ~25 GB under Docker's
data root. Demands on the same filesystem are added up."""

from __future__ import annotations

import os
from pathlib import Path

from pcp_pd_kit.preflight import hfcache
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.memory import GB
from pcp_pd_kit.preflight.report import Result, fail, ok, warn

CHECK = "disk"
IMAGE_BYTES = 25 * GB  # vllm/vllm-openai CUDA images unpack to roughly this much
HEADROOM = 1.2


def disk(ctx: Context) -> list[Result]:
    s = ctx.need_settings()
    results: list[Result] = []
    demands: list[tuple[Path, float, str, str]] = []  # where, bytes, what, how to make room
    model, cache = ctx.model_name(), s.path("hf_cache_dir")
    info = ctx.model_info() if model and not hfcache.is_local_path(model) else None
    if info is not None and info.size is None:
        msg = (
            f"could not estimate the size of {model} ({info.source}), so free space under "
            f"HF_CACHE_DIR was not checked: make sure {cache} has room for its weights."
        )
        results.append(warn(CHECK, msg))
    elif info is not None and info.size is not None:
        missing = max(0, info.size.weight_bytes - hfcache.cached_bytes(cache, model))
        if missing:
            what = f"{model}'s weights ({missing / GB:.1f} GB not yet cached)"
            demands.append((cache, missing, what, "set HF_CACHE_DIR to a bigger disk"))
    if ctx.gpu_mode and ctx.info is not None and ctx.image() is None:
        image, root = s.text("vllm_image"), str(ctx.info.get("DockerRootDir") or "")
        if root and Path(root).is_dir():
            what = f"the image {image} (~{IMAGE_BYTES / GB:.0f} GB, not pulled yet)"
            demands.append((Path(root), IMAGE_BYTES, what, "'docker system prune' old images"))
        else:
            msg = (
                f"Docker's data root '{root or '?'}' is not visible from here, so room to pull "
                f"{image} (~{IMAGE_BYTES / GB:.0f} GB) was not checked: check it on the Docker "
                "host."
            )
            results.append(warn(CHECK, msg))
    by_fs: dict[int, list[tuple[Path, float, str, str]]] = {}
    for demand in demands:
        by_fs.setdefault(os.stat(_existing(demand[0])).st_dev, []).append(demand)
    for group in by_fs.values():
        results.append(_verdict(group))
    if not demands and not results:
        results.append(ok(CHECK, _nothing_to_download(ctx, model)))
    return results


def _nothing_to_download(ctx: Context, model: str) -> str:
    if ctx.gpu_mode:
        return "nothing to download: the model is cached and the image pulled"
    if model:
        return "nothing to download for the model: it is cached (cpu images are built locally)"
    return "no download to make room for: the cpu profile names no model (no cpu_model_name)"


def _verdict(group: list[tuple[Path, float, str, str]]) -> Result:
    stat = os.statvfs(_existing(group[0][0]))
    free = stat.f_bavail * stat.f_frsize
    need = sum(item[1] for item in group)
    what = " and ".join(item[2] for item in group)
    where = " and ".join(sorted({str(item[0]) for item in group}))
    numbers = f"{what} need {need / GB:.1f} GB on the filesystem of {where}"
    if free < need:
        hints = " or ".join(item[3] for item in group)
        return fail(
            CHECK, f"{numbers}, but only {free / GB:.1f} GB is free: free space there or {hints}."
        )
    if free < need * HEADROOM:
        return warn(
            CHECK,
            f"{numbers} and {free / GB:.1f} GB is free, less than 20% to spare: "
            "free some space there before 'docker compose up'.",
        )
    return ok(CHECK, f"{numbers}; {free / GB:.1f} GB is free")


def _existing(path: Path) -> Path:
    """The path itself or its nearest existing parent (HF_CACHE_DIR may not exist yet)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
