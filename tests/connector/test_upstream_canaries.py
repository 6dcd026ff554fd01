"""Canaries: the installed vLLM still has each defect a kit CPU fix works around, and the
version gate that keeps the fixes off a vLLM nobody checked.

A canary that fails means upstream fixed (or changed) that code: re-read it, then drop the fix
or re-check it, and only then list the new release in ``cpu_compat/upstream_gate.READ_AGAINST``.
The unit tests below show each probe flags a fake "fixed" class, so the canaries can fail.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pcp_nixl_connector.cpu_compat import expert_parallel, rope, upstream_gate
from tests.connector.upstream_canaries import (
    LATENT,
    NOPE,
    collectives_defect_present,
    expert_map_defect_present,
    mla_rope_inputs,
    rope_defect_present,
)

FIXED_BY_UPSTREAM = "vLLM {} no longer has this defect: re-read it and drop or re-check the fix"


# -- the canaries, on the installed vLLM's real, unpatched classes --------------------------------
@pytest.fixture(scope="module")
def mla_rope() -> Any:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            64,
            max_position=4096,
            is_neox_style=False,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )


def _vllm_version() -> str:
    return upstream_gate.installed_vllm_version()


@pytest.mark.vllm
def test_canary_rope_kernel_still_mishandles_mla_layouts(mla_rope: Any) -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    assert type(mla_rope) is RotaryEmbedding
    assert not getattr(RotaryEmbedding.forward_cpu, rope.MARKER, False), "patched in this process"
    assert rope_defect_present(RotaryEmbedding.forward_cpu, mla_rope), FIXED_BY_UPSTREAM.format(
        _vllm_version()
    )


@pytest.mark.vllm
def test_canary_cpu_experts_still_ignore_expert_map() -> None:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = cpu_moe.CPUUnquantizedExperts
    assert not getattr(experts.apply, expert_parallel.MARKER, False), "patched in this process"
    assert expert_map_defect_present(experts, cpu_moe, MoEActivation.SILU), (
        FIXED_BY_UPSTREAM.format(_vllm_version())
    )


@pytest.mark.vllm
def test_canary_cpu_communicator_still_lacks_variable_size_collectives() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    assert CpuCommunicator.all_gatherv is not expert_parallel.all_gatherv, "patched here"
    assert collectives_defect_present(CpuCommunicator), FIXED_BY_UPSTREAM.format(_vllm_version())


@pytest.mark.vllm
@pytest.mark.parametrize("fix", sorted(upstream_gate.READ_AGAINST))
def test_the_installed_vllm_passes_the_gate(fix: str) -> None:
    upstream_gate.check(fix)  # else the plugin would refuse to start a CPU server here


# -- the probes flag fixed classes (no vLLM needed) ------------------------------------------------
class FakeRope:
    """forward_native is the reference the probe compares against: a real rotation."""

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
        angle = positions.float().view(-1, 1, 1) * 0.1
        return q * torch.cos(angle), k * torch.cos(angle)


def _fixed_forward_cpu(self: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    want_q, want_k = self.forward_native(positions, q, k)
    q.copy_(want_q)
    k.copy_(want_k)
    return q, k


def _defective_forward_cpu(self: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Like the 0.32/0.33 CPU kernel on these views: token 0 right, the other rows not."""
    want_q, want_k = self.forward_native(positions, q, k)
    q[0] = want_q[0]
    k[0] = want_k[0]
    return q, k


def test_rope_probe_flags_a_fixed_kernel_and_knows_the_defect() -> None:
    assert rope_defect_present(_defective_forward_cpu, FakeRope())
    assert not rope_defect_present(_fixed_forward_cpu, FakeRope())


def test_rope_probe_treats_a_changed_kernel_as_not_the_known_defect() -> None:
    def raises(*_args: Any) -> None:
        raise TypeError("new signature")

    assert not rope_defect_present(raises, FakeRope())


def test_rope_inputs_are_mla_views() -> None:
    positions, q, latent = mla_rope_inputs()
    k_pe = latent[:, LATENT:].unsqueeze(1)
    assert q[..., NOPE:].dim() == 3 and k_pe.stride(0) == latent.shape[1]
    assert positions.numel() == q.shape[0]


class KernelModule:
    """Stands in for vLLM's cpu_moe module: the probe swaps its cpu_fused_moe for a recorder."""

    @staticmethod
    def cpu_fused_moe(*_args: Any) -> None:
        raise AssertionError("the probe must not run the real kernel")


def _experts(map_ids: bool, pass_map: bool = False) -> Any:
    class Experts:
        def apply(self, output, hidden, w1, w2, weights, ids, act, n, expert_map, *rest):
            if map_ids and expert_map is not None:
                ids = expert_map[ids.long()].to(ids.dtype)
            extra = (expert_map,) if pass_map else ()
            KernelModule.cpu_fused_moe(output, hidden, w1, w2, None, None, weights, ids, *extra)

    return Experts


def test_expert_map_probe_flags_a_vllm_that_honours_the_map() -> None:
    act = SimpleNamespace(value="silu")
    assert expert_map_defect_present(_experts(map_ids=False), KernelModule, act)
    assert not expert_map_defect_present(_experts(map_ids=True), KernelModule, act)
    assert not expert_map_defect_present(_experts(False, pass_map=True), KernelModule, act)
    assert KernelModule.cpu_fused_moe.__name__ == "cpu_fused_moe"  # the real one is back


def test_collectives_probe_flags_a_communicator_that_implements_them() -> None:
    class Base:
        def all_gatherv(self, *_args: Any) -> Any:
            raise NotImplementedError

        def reduce_scatterv(self, *_args: Any) -> Any:
            raise NotImplementedError

    class Fixed(Base):
        def all_gatherv(self, input_: torch.Tensor, dim: int = 0, sizes: Any = None) -> Any:
            return torch.cat([input_, input_], dim)

    assert collectives_defect_present(Base)
    assert not collectives_defect_present(Fixed)


# -- the gate -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_gate_lets_the_releases_read_through(version: str) -> None:
    for fix in upstream_gate.READ_AGAINST:
        upstream_gate.check(fix, version)


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.33.0", "0.34.0", "0.33.0rc1", "1.0.0"])
def test_gate_refuses_other_releases_saying_what_to_do(version: str) -> None:
    with pytest.raises(upstream_gate.UpstreamGateError) as caught:
        upstream_gate.check(upstream_gate.EXPERT_MAP, version)
    message = str(caught.value)
    assert f"checked against vLLM 0.32.0, not vLLM {version}" in message
    assert upstream_gate.CANARIES in message and "READ_AGAINST['expert_map']" in message
    assert "PCP_NIXL_CPU_FIXES=0" in message


def test_gate_rejects_an_unknown_fix_name() -> None:
    with pytest.raises(ValueError, match="unknown CPU fix 'flash'"):
        upstream_gate.check("flash", "0.32.0")


def test_installs_patch_nothing_on_an_unchecked_vllm() -> None:
    def forward_cpu(self: Any, *args: Any) -> None:
        return None

    def apply(self: Any, *args: Any) -> None:
        return None

    rotary = type("Rotary", (), {"forward_cpu": forward_cpu})
    experts = type("Experts", (), {"apply": apply})
    communicator = type("Communicator", (), {})
    with pytest.raises(upstream_gate.UpstreamGateError, match="rotary-embedding"):
        rope.install(rotary, vllm_version="0.34.0")
    with pytest.raises(upstream_gate.UpstreamGateError, match="expert_map"):
        expert_parallel.install(experts, communicator, vllm_version="0.34.0")
    assert rotary.forward_cpu is forward_cpu and experts.apply is apply
    assert not hasattr(communicator, "all_gatherv")
    assert rope.install(rotary, vllm_version="0.32.0") is True
    assert expert_parallel.install(experts, communicator, vllm_version="0.32.0") is True
    assert communicator.all_gatherv is expert_parallel.all_gatherv  # type: ignore[attr-defined]
