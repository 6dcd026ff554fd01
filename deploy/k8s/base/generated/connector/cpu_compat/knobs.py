"""Which CPU fixes a process applies: pure decisions over its environment and vLLM build."""

from __future__ import annotations

from collections.abc import Mapping

from . import FIXES_ENV, TRITON_INTERPRETER_ENV

_ON = {"1", "true", "yes", "on"}
_OFF = {"", "0", "false", "no", "off"}


class KnobError(ValueError):
    """A knob with a value that is neither on nor off."""


def knob_on(environ: Mapping[str, str], name: str) -> bool:
    """True for 1/true/yes/on, False when unset or 0/false/no/off; anything else is an error."""
    raw = environ.get(name, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise KnobError(f"{name}={environ.get(name)!r}: want 1 or 0")


def wants_triton_interpreter(environ: Mapping[str, str], cpu_build: bool) -> bool:
    """The Triton interpreter only ever applies to vLLM's CPU build (a GPU host keeps Triton)."""
    return cpu_build and knob_on(environ, TRITON_INTERPRETER_ENV)


def wants_fixes(environ: Mapping[str, str], cpu_build: bool) -> bool:
    return cpu_build and knob_on(environ, FIXES_ENV)
