"""The on/off switches the entrypoint reads, with one parser: ``0`` must never mean on.

ENFORCE_EAGER is read here and nowhere else (compose: KIT_ENFORCE_EAGER; Kubernetes: the params'
ENFORCE_EAGER via the KIT_ prefix); preflight imports enforce_eager() to refuse what the servers
would refuse. Standard library only, Python 3.8 syntax (preflight runs on a host's system python3).
"""

from __future__ import annotations

from collections.abc import Mapping

# ENFORCE_EAGER (compose: KIT_ENFORCE_EAGER; Kubernetes: the params' ENFORCE_EAGER via the KIT_
# prefix), read here and nowhere else: the one switch parser (preflight imports it too).
EAGER_ENV = "KIT_ENFORCE_EAGER"
SWITCH_ON = ("1", "true", "on")
SWITCH_OFF = ("0", "false", "off", "")


def one_or_zero(name: str, value: str, knob: str) -> bool:
    """A 1/0 switch; ValueError naming the variable and its .env knob for anything else."""
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} ({knob}): want 1 or 0")
    return value == "1"


def switch(name: str, value: str, knob: str) -> bool:
    """An on/off switch: 1/true/on or 0/false/off/empty (any case); ValueError naming the
    variable and its .env knob for anything else (``0`` must never mean on)."""
    word = value.strip().lower()
    if word in SWITCH_ON:
        return True
    if word in SWITCH_OFF:
        return False
    raise ValueError(f"{name}={value!r} ({knob}): want 1/true/on or 0/false/off/empty")


def enforce_eager(env: Mapping[str, str]) -> bool:
    """Whether both servers run eager (no CUDA graphs / torch.compile): ENFORCE_EAGER."""
    return switch(EAGER_ENV, env.get(EAGER_ENV, ""), "ENFORCE_EAGER")
