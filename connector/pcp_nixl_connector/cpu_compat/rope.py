"""Rotary embedding on CPU for queries and keys with more than two dimensions.

vLLM's CPU kernel (``torch.ops._C.rotary_embedding``; ``csrc/cpu/pos_encoding.cpp:340`` in 0.32.0
and 0.33.0) takes the token count T from ``positions.numel()``, reads one head per token, and
steps from row to row by ``stride(-2)``. That is right for the ``[tokens, heads * head_size]``
layout most models pass, and wrong for MLA's 3-D views:

* ``q[..., nope:]`` is ``[tokens, heads, rope_dim]``, so ``stride(-2)`` is the head stride: the
  kernel rotates the first T *head rows* (token 0's heads, then token 1's, ...) with positions
  0..T-1 and leaves the rest alone. Only head 0 of token 0 comes out right.
* ``k_pe`` is ``latent[:, kv_lora_rank:].unsqueeze(1)``, whose ``stride(-2)`` is 64 (the new unit
  dimension's), not the latent row of 576: row 0 is token 0's ``k_pe`` and is right; the other
  T-1 writes land further into the latent buffer, on columns of the first rows that the layer
  has already consumed (``kv_c`` was normalized into a new tensor before the rope call) and,
  every ninth row, on a later token's ``k_pe`` rotated with another row's position.

Nothing is read past ``positions``, but which rows are rotated depends on T, so the same prompt
gives different tokens alone and in a batch, and a PCP-split prefill (fewer tokens per rank)
differs from an unsplit one. (Real DeepSeek checkpoints with YaRN use
``DeepseekScalingRotaryEmbedding``, whose own forward already takes the native path.)

The kit routes those calls to vLLM's own ``forward_native`` (plain torch, correct for any
layout) and writes the result back in place, as the kernel's callers expect. It installs only on
the vLLM releases ``upstream_gate`` lists for it; the canary in
``tests/connector/test_upstream_canaries.py`` fails once a vLLM no longer has the defect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import upstream_gate

MARKER = "_pcp_nixl_cpu_rope_fix"


def packed_2d(tensor: torch.Tensor | None) -> bool:
    """The layout the CPU kernel handles: absent, or ``[tokens, heads * head_size]``."""
    return tensor is None or tensor.dim() == 2


def forward_cpu_fixed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``RotaryEmbedding.forward_cpu`` that leaves 2-D calls to ``original``."""

    def forward_cpu(
        self: Any,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if packed_2d(query) and packed_2d(key):
            return original(self, positions, query, key)
        rotated_query, rotated_key = self.forward_native(positions, query, key)
        query.copy_(rotated_query)
        if key is not None:
            key.copy_(rotated_key)
        return query, key

    setattr(forward_cpu, MARKER, True)
    return forward_cpu


def install(rotary_cls: Any, vllm_version: str | None = None) -> bool:
    """Patch ``rotary_cls.forward_cpu`` once; False when it already is. Refuses a vLLM the fix
    was not checked against (``upstream_gate``; default: the installed vLLM)."""
    upstream_gate.check(upstream_gate.ROPE, vllm_version)
    current = rotary_cls.forward_cpu
    if getattr(current, MARKER, False):
        return False
    rotary_cls.forward_cpu = forward_cpu_fixed(current)
    return True
