"""The CPU expert-parallel fix without vLLM: only local (token, expert) pairs, the refusals.

The kernel here is a plain-torch stand-in with the CPU kernel's contract (ids index the local
weights, expert_map ignored, the weight forced to 1.0 when it was applied on the input);
test_cpu_expert_parallel_vllm.py runs the same checks on vLLM's real kernel.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from pcp_nixl_connector.cpu_compat.expert_parallel import (
    MARKER,
    ExpertParallelUnsupported,
    apply_with_expert_map,
    local_pair_groups,
    local_slots,
    quantized_cpu_experts,
    refuse_under_expert_parallel,
)
from tests.connector.moe_reference import (
    OWNED,
    Problem,
    dense_moe,
    expert_map,
    local_counts,
    problem,
)


def torch_kernel(
    self: Any,
    output: torch.Tensor,
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Any,
    global_num_experts: int,
    emap: torch.Tensor | None,
    a1q_scale: Any,
    a2_scale: Any,
    workspace13: Any,
    workspace2: Any,
    meta: Any,
    on_input: bool,
) -> None:
    """Stand-in for stock CPUUnquantizedExperts.apply; counts the pairs it is given."""
    assert ids.dtype == torch.int32 and int(ids.min()) >= 0 and int(ids.max()) < w1.size(0)
    self.pairs += ids.numel()
    used = torch.ones_like(weights) if on_input else weights
    output.copy_(dense_moe(hidden, w1, w2, ids, used))


def run_rank(p: Problem, rank: int, x: torch.Tensor, on_input: bool = False) -> tuple:
    """One simulated EP rank: the fixed apply over its local weights; (output, pairs run)."""
    apply = apply_with_expert_map(torch_kernel)
    w13, w2 = p.local_weights(rank)
    out = torch.full_like(x, float("nan"))  # rows the fix forgets to write stay NaN
    state = SimpleNamespace(pairs=0)
    apply(
        state,
        output=out,
        hidden_states=x,
        w1=w13,
        w2=w2,
        topk_weights=p.weights.clone(),
        topk_ids=p.ids.clone(),
        activation="silu",
        global_num_experts=4,
        expert_map=expert_map(rank),
        a1q_scale=None,
        a2_scale=None,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=None,
        apply_router_weight_on_input=on_input,
    )
    return out, state.pairs


@pytest.mark.parametrize("topk", [1, 2])
def test_two_ranks_sum_to_the_dense_moe_and_run_only_their_own_pairs(topk: int) -> None:
    p = problem(topk)
    counts = local_counts(p, 0)
    assert set(counts.tolist()) == set(range(topk + 1))  # tokens with 0, 1 (and 2) local experts
    want = dense_moe(p.x, p.w13, p.w2, p.ids, p.weights)
    outs, pairs = [], []
    for rank in (0, 1):
        out, ran = run_rank(p, rank, p.x)
        owned = torch.tensor(OWNED[rank], dtype=p.ids.dtype)
        mine = torch.where(torch.isin(p.ids, owned), p.weights, torch.zeros_like(p.weights))
        assert torch.allclose(out, dense_moe(p.x, p.w13, p.w2, p.ids, mine), atol=1e-5)
        assert ran == int(local_counts(p, rank).sum())
        outs.append(out)
        pairs.append(ran)
    assert torch.allclose(outs[0] + outs[1], want, atol=1e-5)
    assert sum(pairs) == p.ids.numel()  # each pair on exactly one rank, none twice


def test_router_weight_on_the_input_with_topk_1_stays_on_its_rank() -> None:
    # vLLM scales the input by the weight and the kernel then uses 1.0: a pair sent to slot 0
    # with weight 0 (the kit's earlier fix) would add local expert 0's output for every token
    # routed to the other rank. Only local pairs run, so nothing leaks.
    p = problem(1)
    scaled = p.x * p.weights
    want = dense_moe(p.x, p.w13, p.w2, p.ids, p.weights, weight_on_input=True)
    outs = [run_rank(p, rank, scaled, on_input=True)[0] for rank in (0, 1)]
    assert torch.allclose(outs[0] + outs[1], want, atol=1e-5)
    foreign = local_counts(p, 0) == 0
    assert foreign.any() and torch.equal(outs[0][foreign], torch.zeros_like(outs[0][foreign]))


def test_weight_zero_masking_would_leak_with_the_weight_on_the_input() -> None:
    # Why the fix drops foreign pairs instead of weighting them 0 (the stand-in forces 1.0, as
    # cpu_fused_moe does): the masked version adds a wrong expert's output.
    p = problem(1)
    w13, w2 = p.local_weights(0)
    slots = expert_map(0)[p.ids.long()]
    masked_ids = slots.clamp(min=0).to(torch.int32)
    out = torch.empty_like(p.x)
    torch_kernel(
        SimpleNamespace(pairs=0), out, p.x * p.weights, w13, w2, p.weights, masked_ids,
        "silu", 4, None, None, None, None, None, None, True,
    )  # fmt: skip
    foreign = (slots < 0).squeeze(1)
    assert out[foreign].abs().max() > 0


def test_all_local_tokens_run_unchanged_without_gather_or_scatter() -> None:
    p = problem(2)
    everything = torch.arange(4, dtype=torch.int32)  # one rank owning every expert
    seen = []

    def kernel(self, output, hidden, w1, w2, weights, ids, *rest):
        seen.append((output.data_ptr(), hidden.data_ptr(), ids.tolist(), rest[2]))

    out = torch.empty_like(p.x)
    apply = apply_with_expert_map(kernel)
    args = (p.weights, p.ids, "silu", 4, everything, None, None, None, None, None, False)
    apply(None, out, p.x, p.w13, p.w2, *args)
    assert seen == [(out.data_ptr(), p.x.data_ptr(), p.ids.tolist(), None)]


def test_without_an_expert_map_the_call_is_passed_through() -> None:
    seen = []

    def kernel(self, output, hidden, w1, w2, weights, ids, act, n, emap, *rest):
        seen.append((ids, weights, emap, rest))

    ids, weights = torch.tensor([[5, 2]], dtype=torch.int32), torch.tensor([[0.5, 0.5]])
    apply = apply_with_expert_map(kernel)
    apply(None, None, None, None, None, weights, ids, "silu", 8, None, 1, 2, 3, 4, 5, True)
    assert seen[0][0] is ids and seen[0][1] is weights and seen[0][2] is None
    assert seen[0][3] == (1, 2, 3, 4, 5, True)
    assert getattr(apply, MARKER) and apply.__wrapped__ is kernel


def test_groups_keep_the_router_order_and_map_to_local_slots() -> None:
    ids = torch.tensor([[3, 0], [1, 2], [2, 3], [0, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]])
    groups = local_pair_groups(ids, weights, torch.tensor([0, -1, 2, 1], dtype=torch.int32), 3)
    assert [g.rows.tolist() for g in groups] == [[1, 3], [0, 2]]
    assert [g.ids.tolist() for g in groups] == [[[2], [0]], [[1, 0], [2, 1]]]
    assert groups[0].ids.dtype == torch.int32
    assert torch.equal(groups[0].weights, torch.tensor([[0.4], [0.7]]))
    assert torch.equal(groups[1].weights, torch.tensor([[0.1, 0.2], [0.5, 0.6]]))


@pytest.mark.parametrize(
    ("ids", "emap", "message"),
    [
        ([[0, -1]], [0, 1, -1, -1], "expert id -1, outside the expert_map's 0..3"),
        ([[4, 1]], [0, 1, -1, -1], "expert id 4, outside"),
        ([[0, 1]], [0, 2, -1, -1], "local slot 2, outside .* 0..1"),
        ([[0, 1]], [0, 1, -2, -1], "local slot -2"),
    ],
)
def test_ids_outside_the_map_are_refused_not_wrapped(ids, emap, message) -> None:
    topk_ids = torch.tensor(ids, dtype=torch.int32)
    with pytest.raises(ExpertParallelUnsupported, match=message):
        local_slots(topk_ids, torch.tensor(emap, dtype=torch.int32), 2)


def test_an_empty_batch_gives_no_groups() -> None:
    empty = torch.zeros((0, 2), dtype=torch.int32)
    assert local_pair_groups(empty, empty.float(), expert_map(0), 2) == []


def test_weight_on_the_input_with_topk_2_is_refused() -> None:
    p = problem(2)
    apply = apply_with_expert_map(torch_kernel)
    with pytest.raises(ExpertParallelUnsupported, match="apply_router_weight_on_input with topk=2"):
        apply(SimpleNamespace(pairs=0), p.x.clone(), p.x, p.w13, p.w2, p.weights, p.ids,
              "silu", 4, expert_map(0), None, None, None, None, None, True)  # fmt: skip


class _Base:
    def __init__(self, moe_config: Any, quant_config: Any) -> None:
        self.built = (moe_config, quant_config)


class _Unquantized(_Base):
    pass


class _X86Unquantized(_Unquantized):
    pass


class _Fp8(_Base):
    def __init__(self, moe_config: Any, quant_config: Any) -> None:
        super().__init__(moe_config, quant_config)


class _Int8(_Base):
    pass  # no __init__ of its own: wrapped on this class, _Base stays as it is


def _fake_module() -> ModuleType:
    module = ModuleType(__name__)
    for cls in (_Base, _Unquantized, _X86Unquantized, _Fp8, _Int8, int):
        setattr(module, cls.__name__, cls)
    return module


def test_quantized_classes_are_the_experts_that_are_not_unquantized() -> None:
    found = quantized_cpu_experts([_fake_module()], _Base, _Unquantized)
    assert {cls.__name__ for cls in found} == {"_Base", "_Fp8", "_Int8"}


def test_quantized_experts_refuse_expert_parallel_at_construction(monkeypatch) -> None:
    for cls in (_Fp8, _Int8):  # undone after the test (for _Int8: removed again)
        monkeypatch.setattr(cls, "__init__", cls.__init__)
    assert refuse_under_expert_parallel([_Fp8, _Int8]) == ["_Fp8", "_Int8"]
    assert refuse_under_expert_parallel([_Fp8, _Int8]) == []  # once
    ep = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=True))
    no_ep = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=False))
    for cls in (_Fp8, _Int8):
        with pytest.raises(ExpertParallelUnsupported, match=rf"{cls.__name__} under expert para"):
            cls(moe_config=ep, quant_config=None)
        assert cls(no_ep, "q").built == (no_ep, "q")
    assert _Base(ep, "q").built == (ep, "q")  # the base class is not touched
