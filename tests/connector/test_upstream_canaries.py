"""Canaries: the installed vLLM still has each defect a kit CPU fix works around, and the
version gate that keeps the fixes off a vLLM nobody checked.

A canary that fails means upstream fixed (or changed) that code: re-read it, then drop the fix
or re-check it, and only then list the new release in ``cpu_compat/upstream_gate.READ_AGAINST``.
The unit tests below show each probe flags a fake "fixed" class, so the canaries can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pcp_nixl_connector.cpu_compat import (
    FIXES_ENV,
    expert_parallel,
    prefix_caching,
    rope,
    upstream_gate,
)
from tests.connector.upstream_canaries import (
    LATENT,
    NOPE,
    collectives_defect_present,
    expert_map_defect_present,
    mla_rope_inputs,
    prefix_caching_defect_present,
    rope_defect_present,
)
from tests.support.paths import CONNECTOR_DIR, REPO

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


# The canary in a fresh interpreter: building a VllmConfig makes the CPU platform set process
# environment (LD_PRELOAD, LOCAL_WORLD_SIZE) that must not leak into this test session.
PREFIX_CACHING_PROBE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.cpu import CpuPlatform
from pcp_nixl_connector.cpu_compat import prefix_caching
from tests.connector.upstream_canaries import prefix_caching_defect_present

config = EngineArgs(
    model=sys.argv[1], block_size=16, max_model_len=4096, dtype="float32",
    attention_backend="CPU_MLA", enforce_eager=True, skip_tokenizer_init=True,
).create_engine_config()
stock = prefix_caching_defect_present(CpuPlatform.check_and_update_config, config)
installed = prefix_caching.install(CpuPlatform)
fixed = prefix_caching_defect_present(CpuPlatform.check_and_update_config, config)
print(json.dumps({"stock": stock, "installed": installed, "fixed": fixed,
                  "chunked": config.scheduler_config.enable_chunked_prefill,
                  "caching": config.cache_config.enable_prefix_caching}))
"""


@pytest.mark.vllm
def test_canary_cpu_platform_still_forces_prefix_caching_off_for_mla() -> None:
    """The CPU platform, unpatched, turns prefix caching off for the kit's tiny MLA model on
    CPU_MLA (chunked prefill off too); the kit's fix, installed on the same class, keeps it on
    and chunked prefill off."""
    from pcp_pd_kit.localstack import tiny_model

    model = tiny_model.build(REPO / tiny_model.DEFAULT_DIR)
    env = {k: v for k, v in os.environ.items() if k != FIXES_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(CONNECTOR_DIR), str(REPO)])
    done = subprocess.run(
        [sys.executable, "-c", PREFIX_CACHING_PROBE, str(model)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["stock"] is True, FIXED_BY_UPSTREAM.format(_vllm_version())
    assert seen["installed"] is True and seen["fixed"] is False
    assert seen["caching"] is True and seen["chunked"] is False


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
@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.32.0+cpu"])
def test_gate_lets_the_releases_read_through(version: str) -> None:
    for fix in (upstream_gate.ROPE, upstream_gate.EXPERT_MAP, upstream_gate.COLLECTIVES):
        upstream_gate.check(fix, version)


def test_gate_holds_the_prefix_caching_fix_to_the_release_it_was_read_in() -> None:
    upstream_gate.check(upstream_gate.PREFIX_CACHING, "0.32.0+cpu")
    with pytest.raises(upstream_gate.UpstreamGateError, match="prefix caching off for MLA"):
        upstream_gate.check(upstream_gate.PREFIX_CACHING, "0.33.0")


# -- the prefix-caching probe and fix on fake platforms (no vLLM needed) ---------------------------
def _mla_config(caching: bool = True, model_type: str = "deepseek_v2", mla: bool = True) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla, hf_config=SimpleNamespace(model_type=model_type)),
        cache_config=SimpleNamespace(enable_prefix_caching=caching),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
    )


def _platform(forces_off: bool) -> type:
    """A CPU platform stand-in: with ``forces_off`` it applies vLLM 0.32's MLA rule."""

    class Platform:
        calls = 0

        @classmethod
        def check_and_update_config(cls, config: Any) -> None:
            cls.calls += 1
            if forces_off and config.model_config.use_mla:
                config.scheduler_config.enable_chunked_prefill = False
                config.cache_config.enable_prefix_caching = False

    return Platform


def test_prefix_caching_probe_flags_a_platform_that_keeps_caching() -> None:
    assert prefix_caching_defect_present(_platform(True).check_and_update_config, _mla_config())
    kept = _platform(False).check_and_update_config
    assert not prefix_caching_defect_present(kept, _mla_config())


def test_prefix_caching_fix_gives_back_only_what_the_mla_rule_took() -> None:
    platform = _platform(True)
    assert prefix_caching.install(platform, vllm_version="0.32.0") is True
    assert prefix_caching.install(platform, vllm_version="0.32.0") is False  # once
    asked = _mla_config()
    platform.check_and_update_config(asked)
    assert asked.cache_config.enable_prefix_caching is True
    assert asked.scheduler_config.enable_chunked_prefill is False  # stays off
    refused = _mla_config(caching=False)  # --no-enable-prefix-caching is honoured
    platform.check_and_update_config(refused)
    assert refused.cache_config.enable_prefix_caching is False
    v4 = _mla_config(model_type=prefix_caching.DEEPSEEK_V4)  # vLLM's own AMX-only path
    platform.check_and_update_config(v4)
    assert v4.cache_config.enable_prefix_caching is False
    assert platform.calls == 3


def test_prefix_caching_fix_patches_nothing_on_an_unchecked_vllm() -> None:
    platform = _platform(True)
    original = platform.__dict__["check_and_update_config"]
    with pytest.raises(upstream_gate.UpstreamGateError, match="prefix caching"):
        prefix_caching.install(platform, vllm_version="0.33.0")
    assert platform.__dict__["check_and_update_config"] is original
    assert not prefix_caching.installed(platform)


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.34.0", "0.33.0rc1", "1.0.0"])
def test_gate_refuses_other_releases_saying_what_to_do(version: str) -> None:
    with pytest.raises(upstream_gate.UpstreamGateError) as caught:
        upstream_gate.check(upstream_gate.EXPERT_MAP, version)
    message = str(caught.value)
    assert f"vLLM {version}" in message and "0.32.0 and 0.33.0" in message
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
    assert rope.install(rotary, vllm_version="0.33.0") is True
    assert expert_parallel.install(experts, communicator, vllm_version="0.33.0") is True
    assert communicator.all_gatherv is expert_parallel.all_gatherv  # type: ignore[attr-defined]
