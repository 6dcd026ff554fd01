"""Probes: does a vLLM class still have the defect a kit CPU fix works around?

Each probe drives the class's own code and answers True only for the exact defective behaviour
the fix was written against; anything else - fixed, changed, or failing some other way - is
False, so the canary test (``test_upstream_canaries.py``) fails and someone re-reads vLLM before
the fix is allowed to patch it (``cpu_compat/upstream_gate.py``). Pure: the classes come in as
arguments, so unit tests can show a probe flags a fake "fixed" class. The releases that cannot
be installed here are read statically instead (``static_canaries.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

HEADS, ROPE_DIM, NOPE, TOKENS, LATENT = 4, 64, 32, 10, 512


def mla_rope_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions, q ``[tokens, heads, nope + rope]`` and the latent projection that ``k_pe``
    views (``[:, 512:].unsqueeze(1)``, row stride 576), as vLLM's MLA builds them."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE_DIM, generator=generator)
    latent = torch.randn(TOKENS, LATENT + ROPE_DIM, generator=generator)
    positions = torch.arange(TOKENS) * 3 + 1
    return positions, q, latent


def rope_defect_present(forward_cpu: Callable[..., Any], rope: Any) -> bool:
    """True when ``forward_cpu`` (a ``RotaryEmbedding.forward_cpu``) rotates MLA's 3-D query and
    key views differently from ``rope.forward_native`` (plain torch, right for any layout)."""
    positions, q, latent = mla_rope_inputs()
    want_q, want_k = rope.forward_native(
        positions, q[..., NOPE:].clone(), latent[:, LATENT:].unsqueeze(1).clone()
    )
    try:
        forward_cpu(rope, positions, q[..., NOPE:], latent[:, LATENT:].unsqueeze(1))
    except Exception:
        return False  # not the defect this fix knows: something changed
    right_q = torch.allclose(q[..., NOPE:], want_q, atol=1e-4)
    right_k = torch.allclose(latent[:, LATENT:].unsqueeze(1), want_k, atol=1e-4)
    return not (right_q and right_k)


def expert_map_defect_present(experts_cls: Any, kernel_module: Any, activation: Any) -> bool:
    """True when ``experts_cls.apply`` hands the router's *global* expert ids to the CPU kernel
    (``kernel_module.cpu_fused_moe``) untouched and gives the kernel no ``expert_map``.

    Probed as EP rank 1 of 2 with 4 experts (it owns global 2 and 3 as local 0 and 1) on tokens
    routed to experts 2 and 3: a vLLM that honours the map passes local ids 0 and 1, or the map.
    The kernel is replaced by a recorder for the call, so no weights are needed.
    """
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    topk_ids = torch.tensor([[2, 3], [3, 2]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.5, 0.5], [0.7, 0.3]])
    calls: list[tuple[Any, ...]] = []
    real_kernel = kernel_module.cpu_fused_moe
    kernel_module.cpu_fused_moe = lambda *args, **kwargs: calls.append((*args, *kwargs.values()))
    stub = SimpleNamespace(_use_zentorch=False, w1_bias=None, w2_bias=None, isa="vec")
    hidden = torch.zeros(2, 8)
    try:
        experts_cls.apply(
            stub, torch.zeros(2, 8), hidden, torch.zeros(2, 16, 8), torch.zeros(2, 8, 8),
            topk_weights, topk_ids, activation, 4, expert_map,
            None, None, torch.empty(0), torch.empty(0), None, False,
        )  # fmt: skip
    except Exception:
        return False
    finally:
        kernel_module.cpu_fused_moe = real_kernel
    if len(calls) != 1:
        return False
    tensors = [a for a in calls[0] if isinstance(a, torch.Tensor)]
    got_global_ids = any(t.shape == topk_ids.shape and torch.equal(t, topk_ids) for t in tensors)
    got_map = any(t.shape == expert_map.shape and torch.equal(t, expert_map) for t in tensors)
    return got_global_ids and not got_map


def collectives_defect_present(communicator_cls: Any) -> bool:
    """True when ``communicator_cls`` has no working ``all_gatherv``/``reduce_scatterv``: both
    raise ``NotImplementedError`` (the device-communicator base class's body)."""
    stub = SimpleNamespace(world_size=2, rank_in_group=0, device_group=None, cpu_group=None)
    for name in ("all_gatherv", "reduce_scatterv"):
        try:
            getattr(communicator_cls, name)(stub, torch.zeros(2, 2), 0, [1, 1])
        except NotImplementedError:
            continue
        except Exception:
            return False
        return False
    return True
