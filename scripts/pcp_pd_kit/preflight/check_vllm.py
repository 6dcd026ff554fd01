"""Prefill and decode must run the same vLLM release: NIXL's handshake carries a version and a
compatibility hash that include vLLM's own version (vLLM 0.33 raised the handshake version from
14 to 15), so a 0.32 prefill and a 0.33 decode never move a byte of KV. Compose gives both the
same VLLM_IMAGE, but an override file or a hand edit can split them."""

from __future__ import annotations

from typing import Any

from pcp_pd_kit.preflight import vllm_version
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result, fail, ok, warn

CHECK = "vllm-version"
#: The prefill and decode services of each stack (GPU mode, cpu profile).
SERVICES = {True: ("prefill", "decode"), False: ("prefill-cpu", "decode-cpu")}


def _image(service: Any) -> str:
    return str(service.get("image") or "") if isinstance(service, dict) else ""


def same_vllm(ctx: Context) -> list[Result]:
    assert ctx.view is not None, "runs only with settings, i.e. with the resolved project"
    names = SERVICES[ctx.gpu_mode]
    images = [_image(ctx.view.services.get(name)) for name in names]
    if not all(images):
        return []  # a stack without both servers (not selected): nothing to compare
    inspected = {image: ctx.inspect(image) for image in images}
    found = [vllm_version.image_release(image, inspected[image]) for image in images]
    (pre, pre_src), (dec, dec_src) = found
    if images[0] == images[1]:
        what = f"vLLM {pre} ({pre_src})" if pre else "vLLM version not read from the image"
        return [ok(CHECK, f"prefill and decode run the same image {images[0]} ({what})")]
    ids = [(inspected[image] or {}).get("Id") for image in images]
    if ids[0] and ids[0] == ids[1]:
        return [ok(CHECK, f"prefill ({images[0]}) and decode ({images[1]}) are one image")]
    if pre and dec and pre != dec:
        msg = (
            f"prefill runs vLLM {pre} ({images[0]}, {pre_src}) but decode runs vLLM {dec} "
            f"({images[1]}, {dec_src}): NIXL refuses a handshake between different vLLM "
            "releases (its handshake version and compatibility hash include the vLLM version), "
            f"so no KV would reach decode: give {names[0]} and {names[1]} the same image "
            f"(VLLM_IMAGE in {ctx.env_label}, and no per-service image override)."
        )
        return [fail(CHECK, msg)]
    if pre and dec:
        return [ok(CHECK, f"prefill and decode both run vLLM {pre} ({images[0]}, {images[1]})")]
    unknown = ", ".join(images[i] for i in (0, 1) if not found[i][0])
    msg = (
        f"prefill ({images[0]}) and decode ({images[1]}) run different images and the vLLM "
        f"release of {unknown} could not be read (no version label, tag or VLLM_VERSION): they "
        "must run the same vLLM release, or NIXL refuses the handshake; use one image for both."
    )
    return [warn(CHECK, msg)]
