"""Rotary embedding on CPU for queries and keys with more than two dimensions.

vLLM 0.32's CPU kernel (``torch.ops._C.rotary_embedding``, csrc/cpu/pos_encoding.cpp) takes the
token count as ``query.numel() / query.size(-1)`` and the head count as ``query.size(-1) /
head_size``. That is right for the ``[tokens, heads * head_size]`` layout most models pass, and
wrong for MLA's ``[tokens, heads, rope_dim]`` views (``q[..., nope:]``, ``k_pe``): every head is
taken for a token, ``positions`` is read past its end, and rows are rotated with other rows'
positions - in a way that depends on what lies in memory after the batch, so the same prompt
gives different tokens alone and in a batch, and a PCP-split prefill differs from an unsplit one.

The kit routes those calls to vLLM's own ``forward_native`` (plain torch, correct for any
layout) and writes the result back in place, as the kernel's callers expect.
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
