"""Prefill and decode must run the same vLLM release: NIXL's handshake carries a version and a
compatibility hash that include vLLM's own version (vLLM 0.33 raised the handshake version from
14 to 15), so a 0.32 prefill and a 0.33 decode never move a byte of KV. Compose gives both the
same VLLM_IMAGE, but an override file or a hand edit can split them. The release must also be
one the kit's connector supports (``pcp_nixl_connector.releases``): on any other it refuses to
load and the servers stop at start."""

from __future__ import annotations

import sys
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.preflight import vllm_version
from pcp_pd_kit.preflight.check_timeouts import service_env
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import OK, Result, fail, ok, warn

# The connector is not installed for a host's system python3; its release list imports nothing
# (and the package's __init__ only its metric names).
_CONNECTOR_DIR = str(repo_root() / "connector")
if _CONNECTOR_DIR not in sys.path:
    sys.path.append(_CONNECTOR_DIR)
from pcp_nixl_connector.releases import (  # noqa: E402
    OVERRIDE_ENV,
    RELEASES,
    SUPPORTED_TEXT,
    is_supported,
)

CHECK = "vllm-version"
#: The prefill and decode services of each stack (GPU mode, cpu profile).
SERVICES = {True: ("prefill", "decode"), False: ("prefill-cpu", "decode-cpu")}


def _image(service: Any) -> str:
    return str(service.get("image") or "") if isinstance(service, dict) else ""


def supported(
    ctx: Context, names: tuple[str, ...], images: list[str], found: list[tuple[str | None, str]]
) -> list[Result]:
    """A FAIL for each image whose vLLM release the connector refuses to load on (a WARN where
    every service running it sets the connector's override); nothing for a release not read."""
    assert ctx.view is not None
    results: list[Result] = []
    for image in dict.fromkeys(images):
        release, source = found[images.index(image)]
        if release is None or is_supported(release):
            continue
        newest = RELEASES[-1].version
        users = [names[i] for i, used in enumerate(images) if used == image]
        msg = (
            f"{' and '.join(users)} run{'s' if len(users) == 1 else ''} vLLM {release} ({image}, "
            f"{source}): the kit's connector supports {SUPPORTED_TEXT} and refuses to load on "
            "another release, so the servers would stop at start: set VLLM_IMAGE in "
            f"{ctx.env_label} to a supported release (e.g. vllm/vllm-openai:v{newest})"
        )
        envs = [service_env(ctx.view.services.get(name)) for name in users]
        if all(env.get(OVERRIDE_ENV) == "1" for env in envs):
            results.append(warn(CHECK, f"{msg}; {OVERRIDE_ENV}=1 lets the connector try it."))
        else:
            results.append(fail(CHECK, f"{msg}, or set {OVERRIDE_ENV}=1 to try it anyway."))
    return results


def same_vllm(ctx: Context) -> list[Result]:
    assert ctx.view is not None, "runs only with settings, i.e. with the resolved project"
    names = SERVICES[ctx.gpu_mode]
    images = [_image(ctx.view.services.get(name)) for name in names]
    if not all(images):
        return []  # a stack without both servers (not selected): nothing to compare
    inspected = {image: ctx.inspect(image) for image in images}
    found = [vllm_version.image_release(image, inspected[image]) for image in images]
    refused = supported(ctx, names, images, found)
    same = _same(ctx, names, images, inspected, found)
    return refused + [r for r in same if not (refused and r.status == OK)]


def _same(
    ctx: Context,
    names: tuple[str, ...],
    images: list[str],
    inspected: dict[str, Any],
    found: list[tuple[str | None, str]],
) -> list[Result]:
    """Prefill and decode on one release."""
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
