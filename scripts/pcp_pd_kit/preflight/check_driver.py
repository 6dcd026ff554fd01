"""The NVIDIA driver against the CUDA that VLLM_IMAGE was built with (the image's CUDA_VERSION
when it is pulled, else its tag), so "driver too old" shows before the image is even started."""

from __future__ import annotations

from pcp_pd_kit.preflight import cuda
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result, fail, ok, warn

CHECK = "driver-cuda"


def driver_cuda(ctx: Context) -> list[Result]:
    if not ctx.gpus:
        return []
    image = ctx.need_settings().text("vllm_image")
    driver = ctx.gpus[0].driver
    env = ((ctx.image() or {}).get("Config") or {}).get("Env") or []
    version, source = cuda.from_image_env(env), "the image's CUDA_VERSION"
    if version is None:
        version, source = cuda.from_tag(image), "its tag"
    if version is None:
        msg = (
            f"could not tell which CUDA {image} is built for (not pulled, and the tag names "
            f"none): check its release notes for the least driver (this host has {driver})."
        )
        return [warn(CHECK, msg)]
    label = f"{version[0]}.{version[1]}"
    minimum = cuda.min_driver(version)
    if minimum is None:
        msg = (
            f"{image} is a CUDA {label} build ({source}) and preflight does not know that "
            f"CUDA's least driver: compare NVIDIA's CUDA release notes with this host's {driver}."
        )
        return [warn(CHECK, msg)]
    if cuda.driver_at_least(driver, minimum):
        msg = f"driver {driver} runs {image} (CUDA {label} from {source} needs >= {minimum})"
        return [ok(CHECK, msg)]
    usable = [
        v for v, least in sorted(cuda.MIN_DRIVER.items()) if cuda.driver_at_least(driver, least)
    ]
    if usable:
        major, minor = usable[-1]
        older = (
            f"a tag built for CUDA {major}.{minor} or older (a cu{major}{minor} variant, where "
            "the release publishes one)"
        )
    else:
        older = "an image built for an older CUDA"
    msg = (
        f"driver {driver} is too old for {image}, a CUDA {label} build ({source}) that needs "
        f"driver >= {minimum}: upgrade the NVIDIA driver to {minimum} or later, or set "
        f"VLLM_IMAGE in {ctx.env_label} to {older}."
    )
    return [fail(CHECK, msg)]
