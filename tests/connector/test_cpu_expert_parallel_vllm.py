"""The CPU expert-parallel fix on vLLM's real CPU MoE kernel (cpu_fused_moe) and classes.

Two simulated EP ranks, each running the fixed ``CPUUnquantizedExperts.apply`` over its own
prepacked experts, must add up to a dense plain-torch MoE over all experts.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from pcp_nixl_connector.cpu_compat.expert_parallel import (
    ExpertParallelUnsupported,
    apply_with_expert_map,
    refuse_under_expert_parallel,
)
from tests.connector.moe_reference import (
    Problem,
    dense_moe,
    expert_map,
    local_counts,
    problem,
)

pytestmark = pytest.mark.vllm

ISA = "vec"  # the portable kernel: runs on every x86 and Arm CPU


@pytest.fixture(scope="module")
def fixed_apply():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return apply_with_expert_map(inspect.unwrap(CPUUnquantizedExperts.apply))


def _rank_output(fixed_apply, p: Problem, rank: int, x: torch.Tensor, on_input: bool):
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    w13, w2 = p.local_weights(rank)
    experts = SimpleNamespace(_use_zentorch=False, w1_bias=None, w2_bias=None, isa=ISA)
    out = torch.full_like(x, float("nan"))
    weights = p.weights.clone()
    fixed_apply(
        experts,
        output=out,
        hidden_states=x,
        w1=cpu_prepack_moe_weight(w13, ISA),
        w2=cpu_prepack_moe_weight(w2, ISA),
        topk_weights=weights,
        topk_ids=p.ids.clone(),
        activation=MoEActivation.SILU,
        global_num_experts=4,
        expert_map=expert_map(rank),
        a1q_scale=None,
        a2_scale=None,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=None,
        apply_router_weight_on_input=on_input,
    )
    assert torch.equal(weights, p.weights)  # the kernel writes 1.0 into copies, not the router's
    return out


@pytest.mark.parametrize(
    ("topk", "dtype", "atol"),
    [(1, torch.float32, 1e-4), (2, torch.float32, 1e-4), (2, torch.bfloat16, 3e-2)],
)
def test_real_kernel_two_ranks_sum_to_the_dense_moe(fixed_apply, topk, dtype, atol) -> None:
    p = problem(topk, tokens=40, dtype=dtype)
    assert set(local_counts(p, 0).tolist()) == set(range(topk + 1))
    want = dense_moe(p.x.float(), p.w13.float(), p.w2.float(), p.ids, p.weights)
    outs = [_rank_output(fixed_apply, p, rank, p.x, on_input=False) for rank in (0, 1)]
    got = outs[0].float() + outs[1].float()
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    none_here = local_counts(p, 0) == 0
    assert torch.equal(outs[0][none_here], torch.zeros_like(outs[0][none_here]))


def test_real_kernel_router_weight_on_the_input_with_topk_1(fixed_apply) -> None:
    # vLLM's prepare step scales the input; cpu_fused_moe then forces the weight to 1.0.
    p = problem(1, tokens=40)
    scaled = p.x * p.weights
    want = dense_moe(p.x, p.w13, p.w2, p.ids, p.weights, weight_on_input=True)
    outs = [_rank_output(fixed_apply, p, rank, scaled, on_input=True) for rank in (0, 1)]
    assert torch.allclose(outs[0] + outs[1], want, atol=1e-4)


def test_a_negative_expert_id_stops_before_the_kernel(fixed_apply) -> None:
    p = problem(2)
    p.ids[3, 1] = -1
    with pytest.raises(ExpertParallelUnsupported, match="expert id -1"):
        _rank_output(fixed_apply, p, 0, p.x, on_input=False)


def test_every_quantized_cpu_expert_class_refuses_expert_parallel(monkeypatch) -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from pcp_nixl_connector.cpu_compat.plugin import _quantized_cpu_experts

    classes = _quantized_cpu_experts()
    names = {cls.__name__ for cls in classes}
    # vLLM 0.32's quantized CPU kernels that accept expert parallelism, and none of the
    # unquantized ones (those the kit fixes).
    assert {"CPUExpertsFp8", "CPUExpertsInt8", "CPUExpertsMxfp4", "CPUExpertsInt4"} <= names
    assert "CPUExpertsFp8W8A8" in names
    assert not any(issubclass(cls, cpu_moe.CPUUnquantizedExperts) for cls in classes)
    for cls in classes:  # undone after the test
        monkeypatch.setattr(cls, "__init__", cls.__init__)
    # (two classes are named CPUExpertsInt4: cpu_moe's and cpu_int4_moe's)
    assert sorted(refuse_under_expert_parallel(classes)) == sorted(c.__name__ for c in classes)
    ep = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=True))
    for cls in classes:
        with pytest.raises(ExpertParallelUnsupported, match=f"{cls.__name__} under expert"):
            cls(moe_config=ep, quant_config=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_kernel_gives_the_same_bits_as_weighting_foreign_experts_zero(fixed_apply, dtype):
    # The kit's earlier fix ran every pair, foreign ones at slot 0 with weight 0 (what the e2e
    # greedy comparisons were first proven with). Dropping those pairs changes no bit: w * y + 0
    # is w * y. So the numerics, and with them greedy equality, carry over.
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    p = problem(2, tokens=40, dtype=dtype)
    for rank in (0, 1):
        w13, w2 = (cpu_prepack_moe_weight(w, ISA) for w in p.local_weights(rank))
        slots = expert_map(rank)[p.ids.long()]
        masked = torch.empty_like(p.x)
        cpu_fused_moe(
            masked, p.x, w13, w2, None, None,
            p.weights.masked_fill(slots < 0, 0.0), slots.clamp(min=0).to(torch.int32),
            "silu", ISA, False,
        )  # fmt: skip
        assert torch.equal(_rank_output(fixed_apply, p, rank, p.x, on_input=False), masked)
