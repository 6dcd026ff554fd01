"""Expert parallelism on vLLM 0.32's CPU build: the two missing pieces.

* ``CPUUnquantizedExperts.apply`` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py)
  receives ``expert_map`` and ignores it: the global expert ids from the router index this rank's
  *local* weights. With EP2 half the ids are out of range (a crash in cpu_fused_moe, or garbage)
  and the other half pick the wrong expert on every rank but the first. ``local_routing`` maps the
  ids through ``expert_map`` and gives the experts this rank does not own a weight of 0, so each
  rank computes its own experts' share and the EP combine (a sum over ranks) adds them up.
* ``CpuCommunicator`` has no ``all_gatherv`` / ``reduce_scatterv``
  (vllm/distributed/device_communicators/base_device_communicator.py raises NotImplementedError),
  which the naive EP dispatch/combine call. ``all_gatherv`` / ``reduce_scatterv`` below implement
  them with the communicator's own equal-size collectives, padding where the sizes differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

MARKER = "_pcp_nixl_cpu_ep_fix"


def local_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids -> this rank's local ids; experts owned elsewhere weigh 0.

    ``expert_map[g]`` is the local slot of global expert ``g``, or -1 when another rank owns it.
    """
    local = expert_map[topk_ids.long()]
    foreign = local < 0
    local_ids = torch.where(foreign, torch.zeros_like(local), local).to(topk_ids.dtype)
    return local_ids, topk_weights.masked_fill(foreign, 0.0)


def apply_with_expert_map(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``CPUUnquantizedExperts.apply`` (its positional signature in vLLM 0.32)."""

    def apply(
        self: Any,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Any,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if expert_map is not None:
            topk_ids, topk_weights = local_routing(topk_ids, topk_weights, expert_map)
        return original(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            expert_map,
            *args,
            **kwargs,
        )

    setattr(apply, MARKER, True)
    return apply


def gather_varlen(
    tensor: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    all_gather_equal: Callable[[torch.Tensor], list[torch.Tensor]],
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (``sizes[r]`` rows along ``dim``) in rank order."""
    rows = tensor.movedim(dim, 0).contiguous()
    longest = max(sizes)
    padded = rows.new_zeros((longest, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    pieces = all_gather_equal(padded)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes, strict=True)]).movedim(
        0, dim
    )


def scatter_varlen_sum(
    tensor: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    rank: int,
    all_reduce_sum: Callable[[torch.Tensor], Any],
) -> torch.Tensor:
    """The sum over ranks of ``tensor`` (``all_reduce_sum`` works in place), then this rank's
    ``sizes[rank]`` rows along ``dim``."""
    total = tensor.movedim(dim, 0).contiguous()
    all_reduce_sum(total)
    start = sum(sizes[:rank])
    return total[start : start + sizes[rank]].movedim(0, dim).contiguous()


def _equal(sizes: Sequence[int] | None) -> bool:
    return sizes is None or len(set(sizes)) <= 1


def all_gatherv(
    self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: Any = None
) -> Any:
    """``DeviceCommunicatorBase.all_gatherv`` for ``CpuCommunicator``."""
    import torch.distributed as dist

    def gather_one(tensor: torch.Tensor) -> torch.Tensor:
        if _equal(sizes):
            return self.all_gather(tensor, dim)

        def all_gather_equal(padded: torch.Tensor) -> list[torch.Tensor]:
            pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(pieces, padded, group=self.device_group)
            return pieces

        return gather_varlen(tensor, sizes, dim, all_gather_equal)

    if isinstance(input_, list):
        return [gather_one(tensor) for tensor in input_]
    return gather_one(input_)


def reduce_scatterv(self: Any, input_: torch.Tensor, dim: int = -1, sizes: Any = None) -> Any:
    """``DeviceCommunicatorBase.reduce_scatterv`` for ``CpuCommunicator``."""
    if _equal(sizes):
        return self.reduce_scatter(input_, dim)
    return scatter_varlen_sum(input_, sizes, dim, self.rank_in_group, self.all_reduce)


def install(experts_cls: Any, communicator_cls: Any, vllm_version: str | None = None) -> bool:
    """Patch both classes once; False when already patched. Refuses a vLLM either fix was not
    checked against (``upstream_gate``; default: the installed vLLM): one that honours
    ``expert_map`` itself would get already-local ids mapped a second time."""
    from . import upstream_gate

    upstream_gate.check(upstream_gate.EXPERT_MAP, vllm_version)
    upstream_gate.check(upstream_gate.COLLECTIVES, vllm_version)
    if getattr(experts_cls.apply, MARKER, False):
        return False
    experts_cls.apply = apply_with_expert_map(experts_cls.apply)
    communicator_cls.all_gatherv = all_gatherv
    communicator_cls.reduce_scatterv = reduce_scatterv
    return True
