"""Which CUDA an image was built for, and the least NVIDIA driver that runs it, so a too-old driver
shows up before `up` instead of as "CUDA driver version is insufficient" in the vLLM logs."""

from __future__ import annotations

import re

#: Least Linux driver per CUDA toolkit (the GA row of NVIDIA's CUDA Toolkit release notes,
#: "CUDA Toolkit and Corresponding Driver Versions").
MIN_DRIVER: dict[tuple[int, int], str] = {
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}
#: vllm/vllm-openai's plain release tags (vX.Y.Z) are CUDA 13.0 builds from this release on.
PLAIN_TAG_CUDA = (13, 0)
PLAIN_TAG_SINCE = (0, 32, 0)
_VLLM_REPO = re.compile(r"^(?:(?:docker\.io|registry-1\.docker\.io)/)?vllm/vllm-openai$")


def version_tuple(text: str) -> tuple[int, ...]:
    """`580.65.06` -> (580, 65, 6); non-numeric parts end the tuple."""
    parts = []
    for part in text.strip().lstrip("v").split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def from_image_env(env: list[str]) -> tuple[int, int] | None:
    """CUDA major.minor from an image's CUDA_VERSION=13.0.1 variable (nvidia/cuda bases set it)."""
    for item in env:
        if item.startswith("CUDA_VERSION="):
            version = version_tuple(item.partition("=")[2])
            if len(version) >= 2:
                return version[0], version[1]
    return None


def from_tag(image: str) -> tuple[int, int] | None:
    """CUDA major.minor from a tag: `...-cu129`/`cu128` suffixes, or vLLM's plain release tags."""
    name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
    match = re.search(r"(?:^|[-_.])cu(\d{2})(\d)(?:$|[-_.])", tag)
    if match:
        return int(match.group(1)), int(match.group(2))
    if _VLLM_REPO.match(name) and re.fullmatch(r"v\d+\.\d+\.\d+", tag):
        if version_tuple(tag) >= PLAIN_TAG_SINCE:
            return PLAIN_TAG_CUDA
    return None


def min_driver(cuda: tuple[int, int]) -> str | None:
    return MIN_DRIVER.get(cuda)


def driver_at_least(driver: str, minimum: str) -> bool:
    return version_tuple(driver) >= version_tuple(minimum)
