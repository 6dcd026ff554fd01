"""A dense MoE in plain torch and a two-rank expert split, to check the CPU EP fix against.

The reference runs every (token, expert) pair on one "instance"; the EP side runs each simulated
rank on its own experts only and sums the ranks (what vLLM's EP combine does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HIDDEN, INTERMEDIATE, EXPERTS = 64, 64, 4
# Rank 0 owns global experts 0 and 2, rank 1 owns 1 and 3: not a contiguous split, so a fix that
# only subtracted an offset would be caught.
OWNED = ((0, 2), (1, 3))


def expert_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SiLU-gated expert, w13 = [gate; up] as vLLM stores it."""
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.T


def dense_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """sum_k w[t, k] * expert[ids[t, k]](x[t]); with ``weight_on_input`` the weight scales the
    expert's input instead (vLLM allows that for topk=1 only)."""
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        for k in range(ids.size(1)):
            e, w = int(ids[t, k]), weights[t, k]
            if weight_on_input:
                out[t] += expert_forward(x[t] * w, w13[e], w2[e])
            else:
                out[t] += w * expert_forward(x[t], w13[e], w2[e])
    return out


def expert_map(rank: int) -> torch.Tensor:
    """vLLM's expert_map for ``rank``: global id -> local slot, -1 for the other rank's."""
    emap = torch.full((EXPERTS,), -1, dtype=torch.int32)
    for slot, expert in enumerate(OWNED[rank]):
        emap[expert] = slot
    return emap


@dataclass(frozen=True)
class Problem:
    x: torch.Tensor
    w13: torch.Tensor  # [EXPERTS, 2 * INTERMEDIATE, HIDDEN]
    w2: torch.Tensor  # [EXPERTS, HIDDEN, INTERMEDIATE]
    ids: torch.Tensor  # [tokens, topk] int32 global ids, distinct per token
    weights: torch.Tensor  # [tokens, topk] float32

    def local_weights(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        owned = list(OWNED[rank])
        return self.w13[owned].contiguous(), self.w2[owned].contiguous()


def problem(topk: int, tokens: int = 24, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Random routing whose first tokens cover every case for rank 0: all experts local, none
    local, and (topk 2) one of each, in both orders."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:topk] for _ in range(tokens)])
    fixed = {1: [[0], [1], [2], [3]], 2: [[0, 2], [1, 3], [0, 1], [3, 2], [2, 1]]}[topk]
    ids[: len(fixed)] = torch.tensor(fixed)
    return Problem(
        x=torch.randn(tokens, HIDDEN, generator=gen).to(dtype),
        w13=(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / 8).to(dtype),
        w2=(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / 8).to(dtype),
        ids=ids.to(torch.int32),
        weights=torch.rand(tokens, topk, generator=gen) + 0.1,
    )


def local_counts(p: Problem, rank: int) -> torch.Tensor:
    """How many of each token's experts ``rank`` owns."""
    return torch.isin(p.ids, torch.tensor(OWNED[rank], dtype=p.ids.dtype)).sum(dim=1)
