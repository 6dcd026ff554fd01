"""Expert parallelism on vLLM 0.32's CPU build: the missing pieces, and the cases it refuses.

* ``CPUUnquantizedExperts.apply`` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py)
  receives ``expert_map`` and ignores it: the global expert ids from the router index this rank's
  *local* weights. With EP2 half the ids are out of range (a crash in cpu_fused_moe, or garbage)
  and the other half pick the wrong expert on every rank but the first. ``apply_with_expert_map``
  maps the ids through ``expert_map`` and hands the kernel only this rank's (token, expert) pairs:
  tokens are grouped by how many of their experts are local, each group runs as its own
  ``[tokens, local count]`` problem (the kernel has one top-k width per call and no id it skips),
  and tokens with no local expert get zero rows. The EP combine (a sum over ranks) adds the shares.
  Dropping the foreign pairs, rather than weighting them 0, also keeps ``topk=1`` with
  ``apply_router_weight_on_input`` right: there the kernel overwrites the weight with 1.0.
* ``CpuCommunicator`` has no ``all_gatherv`` / ``reduce_scatterv``
  (vllm/distributed/device_communicators/base_device_communicator.py raises NotImplementedError),
  which the naive EP dispatch/combine call. ``all_gatherv`` / ``reduce_scatterv`` below implement
  them with the communicator's own equal-size collectives, padding where the sizes differ.
* The quantized CPU experts (``CPUExpertsFp8``, ``CPUExpertsInt8``, ...) ignore ``expert_map``
  too, and nothing here fixes their kernels: ``refuse_under_expert_parallel`` makes them raise
  when a layer is built with expert parallelism, instead of computing with the wrong experts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

MARKER = "_pcp_nixl_cpu_ep_fix"
REFUSAL_MARKER = "_pcp_nixl_cpu_ep_refusal"


class ExpertParallelUnsupported(RuntimeError):
    """A case the CPU expert-parallel fix cannot compute correctly: stop, never guess."""


def local_slots(topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int) -> torch.Tensor:
    """Each routed (token, k) pair's local expert slot, or -1 where another rank owns it.

    ``expert_map[g]`` is the local slot of global expert ``g``, or -1. Ids outside the map are
    refused: a -1 id would otherwise index ``expert_map`` from its end (torch wraps negative
    indices) and run the last global expert's slot.
    """
    num_global = expert_map.numel()
    if topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_global:
            bad = low if low < 0 else high
            raise ExpertParallelUnsupported(
                f"topk_ids holds expert id {bad}, outside the expert_map's 0..{num_global - 1}: "
                "the CPU expert-parallel fix maps router ids through expert_map and will not "
                "let a negative id wrap to the last expert"
            )
    if num_global:
        low, high = int(expert_map.min()), int(expert_map.max())
        if low < -1 or high >= num_local:
            raise ExpertParallelUnsupported(
                f"expert_map holds local slot {low if low < -1 else high}, outside -1 (another "
                f"rank's expert) and 0..{num_local - 1} (this rank's {num_local} experts)"
            )
    return expert_map[topk_ids.long()]


@dataclass(frozen=True)
class PairGroup:
    """Tokens with the same number of local experts, as one MoE problem of that top-k width."""

    rows: torch.Tensor  # token indices into the layer's batch (int64)
    ids: torch.Tensor  # [len(rows), width] local expert slots, in the router's order
    weights: torch.Tensor  # [len(rows), width] their router weights


def local_pair_groups(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor, num_local: int
) -> list[PairGroup]:
    """This rank's (token, expert) pairs, grouped by how many each token has (1..topk).

    Within a token the local pairs keep the router's order, so a token whose experts are all
    local is the same problem, summed in the same order, as on a single instance.
    """
    slots = local_slots(topk_ids, expert_map, num_local)
    is_local = slots >= 0
    counts = is_local.sum(dim=1)
    # Local pairs first, each side in its original order (a stable sort on "is foreign").
    order = torch.sort((~is_local).to(torch.int8), dim=1, stable=True).indices
    ids = slots.gather(1, order).to(topk_ids.dtype)
    weights = topk_weights.gather(1, order)
    groups = []
    for width in range(1, topk_ids.size(1) + 1):
        rows = (counts == width).nonzero().squeeze(1)
        if rows.numel():
            groups.append(
                PairGroup(rows, ids[rows, :width].contiguous(), weights[rows, :width].contiguous())
            )
    return groups


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def run_local_pairs(
    output: torch.Tensor, hidden_states: torch.Tensor, groups: Sequence[PairGroup], kernel: Kernel
) -> None:
    """Fill ``output`` [tokens, hidden] with this rank's share: ``kernel(out, hidden, weights,
    ids)`` once per group, zero rows for tokens none of whose experts are here."""
    if len(groups) == 1 and groups[0].rows.numel() == output.size(0):
        group = groups[0]  # every token has the same local count: no gather, no scatter
        kernel(output, hidden_states, group.weights, group.ids)
        return
    output.zero_()
    for group in groups:
        part = output.new_empty((group.rows.numel(), output.size(1)))
        kernel(part, hidden_states.index_select(0, group.rows), group.weights, group.ids)
        output.index_copy_(0, group.rows, part)


def apply_with_expert_map(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``CPUUnquantizedExperts.apply`` (its signature in vLLM 0.32; the modular kernel
    calls it with keywords)."""

    @functools.wraps(original)
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
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: Any,
        apply_router_weight_on_input: bool,
    ) -> None:
        def kernel(
            out: torch.Tensor,
            hidden: torch.Tensor,
            weights: torch.Tensor,
            ids: torch.Tensor,
            emap: torch.Tensor | None = None,
        ) -> None:
            original(
                self,
                out,
                hidden,
                w1,
                w2,
                weights,
                ids,
                activation,
                global_num_experts,
                emap,
                a1q_scale,
                a2_scale,
                workspace13,
                workspace2,
                expert_tokens_meta,
                apply_router_weight_on_input,
            )

        if expert_map is None:
            kernel(output, hidden_states, topk_weights, topk_ids, None)
            return
        if apply_router_weight_on_input and topk_ids.size(1) != 1:
            raise ExpertParallelUnsupported(
                f"apply_router_weight_on_input with topk={topk_ids.size(1)}: vLLM applies the "
                "router weight to the input only for topk=1, and the CPU kernel then overwrites "
                "the first weight of each token with 1.0"
            )
        # The ids handed on are local slots: expert_map is not passed again.
        groups = local_pair_groups(topk_ids, topk_weights, expert_map, w1.size(0))
        run_local_pairs(output, hidden_states, groups, kernel)

    setattr(apply, MARKER, True)
    return apply


def quantized_cpu_experts(
    modules: Iterable[ModuleType], experts_base: type, unquantized: type
) -> list[type]:
    """The ``experts_base`` subclasses defined in ``modules`` other than ``unquantized`` and its
    subclasses: vLLM's quantized CPU MoE kernels (FP8, INT8, INT4, MXFP4, ...)."""
    return [
        cls
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
        and issubclass(cls, experts_base)
        and not issubclass(cls, unquantized)
    ]


def refuse_under_expert_parallel(classes: Iterable[type]) -> list[str]:
    """Make each class's constructor raise for a layer built with expert parallelism (vLLM
    builds the experts object once per MoE layer, at model load). Returns the names patched."""
    patched = []
    for cls in classes:
        if getattr(cls.__dict__.get("__init__"), REFUSAL_MARKER, False):
            continue
        # An inherited constructor is wrapped on this class only: the base stays as it is.
        init = getattr(cls, "__init__")  # noqa: B009 (mypy refuses cls.__init__ on a type)
        setattr(cls, "__init__", _refusing_init(cls.__name__, init))  # noqa: B010
        patched.append(cls.__name__)
    return patched


def _refusing_init(name: str, init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, moe_config: Any, *args: Any, **kwargs: Any) -> None:
        if moe_config.moe_parallel_config.use_ep:
            raise ExpertParallelUnsupported(
                f"{name} under expert parallelism (--enable-expert-parallel): vLLM's quantized "
                "CPU MoE kernels ignore expert_map, so each rank would run its local weights "
                "for the router's global expert ids, and the kit's CPU fix covers only "
                "unquantized experts. Serve an unquantized checkpoint, or turn expert "
                "parallelism off (CPU_PREFILL_EXPERT_PARALLEL=0)"
            )
        init(self, moe_config, *args, **kwargs)

    setattr(__init__, REFUSAL_MARKER, True)
    return __init__


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
