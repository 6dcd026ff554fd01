"""Which vLLM release an image runs, from what Docker knows without starting it: the image's
labels or environment when it is pulled, else its tag (vllm/vllm-openai:v0.33.0 -> 0.33.0)."""

from __future__ import annotations

import re
from typing import Any

#: Image labels that carry the version (the OCI standard one, set by most release pipelines).
LABELS = ("org.opencontainers.image.version",)
#: Environment variables that carry it.
ENV_KEYS = ("VLLM_VERSION",)
_RELEASE = re.compile(r"^v?(\d+\.\d+\.\d+)(?:$|[-+_.])")


def tag_of(image: str) -> str | None:
    """The tag of an image reference (`repo/name:tag@digest` -> tag), None without one."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def release_of(text: str | None) -> str | None:
    """`v0.33.0`, `0.32.0-x86_64`, `v0.33.0+cu129` -> the X.Y.Z release; None for anything else."""
    found = _RELEASE.match(text.strip()) if text else None
    return found.group(1) if found else None


def from_inspect(inspect: dict[str, Any] | None) -> tuple[str | None, str]:
    """(release, where it was read) from `docker image inspect`; (None, "") when it says none."""
    config = (inspect or {}).get("Config") or {}
    labels = config.get("Labels") or {}
    for label in LABELS:
        release = release_of(labels.get(label))
        if release:
            return release, f"its label {label}"
    for entry in config.get("Env") or []:
        key, _, value = str(entry).partition("=")
        if key in ENV_KEYS and release_of(value):
            return release_of(value), f"its {key}"
    return None, ""


def image_release(image: str, inspect: dict[str, Any] | None) -> tuple[str | None, str]:
    """(release, source): the pulled image's own word first, then its tag."""
    release, source = from_inspect(inspect)
    if release:
        return release, source
    release = release_of(tag_of(image))
    return (release, "its tag") if release else (None, "")
