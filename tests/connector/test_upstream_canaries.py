"""Canaries: the installed vLLM still has each defect a kit CPU fix works around, every
supported release's code still has the defects the kit works around (read statically from its
wheel), and the version gate that keeps the CPU fixes off a vLLM nobody checked.

A canary that fails means upstream fixed (or changed) that code: re-read it, then drop the fix
or re-check it. The gate's ``READ_AGAINST`` lists only the releases with a CPU build, where the
runtime canaries run (``releases.CPU_CHECKED``). The unit tests below show each probe flags a
fake "fixed" class or source, so the canaries can fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pcp_nixl_connector import releases
from pcp_nixl_connector.cpu_compat import (
    FIXES_ENV,
    expert_parallel,
    prefix_caching,
    rope,
    upstream_gate,
)
from tests.connector import api_surface, static_canaries
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
def test_the_gate_lists_only_releases_the_runtime_canaries_run_on() -> None:
    """Only a release with a CPU build can run the canaries above; the installed one is it."""
    cpu_builds = {r.version for r in releases.RELEASES if r.cpu_build}
    assert upstream_gate.release(upstream_gate.installed_vllm_version()) in cpu_builds
    for fix, versions in upstream_gate.READ_AGAINST.items():
        assert set(versions) <= cpu_builds, f"{fix}: {versions} lists a release with no CPU build"


@pytest.mark.parametrize("version", [*releases.CPU_CHECKED, "0.32.0+cpu"])
def test_gate_lets_the_releases_read_through(version: str) -> None:
    for fix in upstream_gate.READ_AGAINST:
        upstream_gate.check(fix, version)


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


def test_prefix_caching_fix_restores_caching_only_where_its_rule_applies() -> None:
    """The fix's own decision, on a stand-in platform: caching comes back only for an MLA model
    (not DeepSeek-V4) that asked for it and lost it with chunked prefill off. That vLLM 0.32's
    real CpuPlatform takes exactly that is the canary's to show
    (test_canary_cpu_platform_still_forces_prefix_caching_off_for_mla)."""
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


def _platform_taking_caching(keep_chunked: bool) -> type:
    """A stand-in that turns prefix caching off for every model, for a reason of its own."""

    class Platform:
        @classmethod
        def check_and_update_config(cls, config: Any) -> None:
            config.cache_config.enable_prefix_caching = False
            config.scheduler_config.enable_chunked_prefill = keep_chunked

    return Platform


@pytest.mark.parametrize(
    ("mla", "keep_chunked"), [(False, False), (True, True)], ids=["not-mla", "chunked-kept"]
)
def test_prefix_caching_fix_leaves_caching_another_rule_took(mla: bool, keep_chunked: bool) -> None:
    """Caching turned off where the MLA rule does not apply (a model without MLA, or chunked
    prefill left on) stays off: the fix gives back nothing else."""
    platform = _platform_taking_caching(keep_chunked)
    prefix_caching.install(platform, vllm_version="0.32.0")
    config = _mla_config(mla=mla)
    platform.check_and_update_config(config)
    assert config.cache_config.enable_prefix_caching is False


def test_prefix_caching_fix_patches_nothing_on_an_unchecked_vllm() -> None:
    platform = _platform(True)
    original = platform.__dict__["check_and_update_config"]
    with pytest.raises(upstream_gate.UpstreamGateError, match="prefix caching"):
        prefix_caching.install(platform, vllm_version="0.33.0")
    assert platform.__dict__["check_and_update_config"] is original
    assert not prefix_caching.installed(platform)


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.33.0", "0.34.0", "0.33.0rc1", "1.0.0"])
def test_gate_refuses_other_releases_saying_what_to_do(version: str) -> None:
    with pytest.raises(upstream_gate.UpstreamGateError) as caught:
        upstream_gate.check(upstream_gate.EXPERT_MAP, version)
    message = str(caught.value)
    assert f"vLLM {version}" in message and "checked against vLLM 0.32.0, not" in message
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


# -- static canaries: each supported release's code, read from its wheel ------------------------
RELEASES = [r.version for r in releases.RELEASES]
NOT_READ = "{} was made before probe {!r} existed: regenerate it (see static_canaries.py)"


def _committed_canaries(version: str) -> dict[str, Any]:
    data = json.loads(static_canaries.canaries_file(version).read_text())
    assert data["vllm_version"] == version
    return data


@pytest.mark.parametrize("version", RELEASES)
def test_static_canaries_every_supported_release_still_has_the_defects(version: str) -> None:
    """The leak (count None, world_size fallback, rank > 0 reports at once and then cleared),
    the handshake skip, and the CPU fixes' Python-side defects, in each release's own code."""
    found = _committed_canaries(version)["defects"]
    for probe in static_canaries.PROBES:
        assert probe in found, NOT_READ.format(static_canaries.canaries_file(version).name, probe)
        assert found[probe] is True, f"{probe}: " + FIXED_BY_UPSTREAM.format(version)


def test_static_canaries_read_the_installed_vllm_as_its_committed_extract() -> None:
    """The probes on the installed vLLM's sources (where the runtime canaries above and the
    scheduler-leak test run) give what the extract made from that release's wheel holds."""
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))).parent
    live = static_canaries.read_tree(api_surface.tree_reader(root))
    committed = _committed_canaries(upstream_gate.release(upstream_gate.installed_vllm_version()))
    assert live == {"defects": committed["defects"], "digests": committed["digests"]}
    assert all(live["defects"].values())


NIXL_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
# Small stand-ins with the defects' shapes (written for these tests, not vLLM's code).
DEFECTIVE = {
    f"{NIXL_DIR}/connector.py": """
class NixlBaseConnector:
    def get_finished_count(self):
        return None

    def get_transfer_results(self, finished):
        results = self.connector_worker.get_transfer_results()
        if self.producer and self.connector_worker.pcp_rank > 0:
            results.finished_sending.clear()
        return results

    def get_handshake_metadata(self):
        if self.connector_worker.pcp_rank > 0:
            return None
        return self.connector_worker.meta

class NixlPullConnector(NixlBaseConnector):
    pass
""",
    f"{NIXL_DIR}/pull_worker.py": """
class NixlPullConnectorWorker:
    def start_load_kv(self, metadata):
        if self.pcp_rank > 0:
            self._replicated_pcp_done_sending.update(metadata.reqs_to_send)
            return
""",
    "vllm/distributed/kv_transfer/kv_connector/utils.py": """
class KVOutputAggregator:
    @classmethod
    def from_connector(cls, connector, world_size):
        return cls(connector.get_finished_count() or world_size)
""",
    "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py": """
class CPUUnquantizedExperts:
    def apply(self, out, hidden, w1, w2, weights, ids, act, n, expert_map):
        cpu_fused_moe(out, hidden, w1, w2, weights, ids)
""",
    "vllm/distributed/device_communicators/cpu_communicator.py": """
from .base_device_communicator import DeviceCommunicatorBase

class CpuCommunicator(DeviceCommunicatorBase):
    def all_reduce(self, x):
        return x
""",
    "vllm/distributed/device_communicators/base_device_communicator.py": """
class DeviceCommunicatorBase:
    def all_gatherv(self, x, dim=0, sizes=None):
        raise NotImplementedError

    def reduce_scatterv(self, x, dim=-1, sizes=None):
        raise NotImplementedError
""",
    "vllm/model_executor/layers/rotary_embedding/base.py": """
class RotaryEmbedding:
    def forward_cpu(self, positions, query, key=None):
        from vllm import _custom_ops as ops
        ops.rotary_embedding(positions, query, key, self.head_size)
        return query, key
""",
}
# probe -> (file, defective text, an upstream fix of it)
FIXES = {
    "finished_count_is_none": (f"{NIXL_DIR}/connector.py", "        return None\n\n    def get_t",
                               "        return self.tp * self.pp\n\n    def get_t"),
    "aggregator_falls_back_to_world_size": ("vllm/distributed/kv_transfer/kv_connector/utils.py",
                                            "or world_size", "or 1"),
    "ranks_above_zero_report_sent_at_once": (f"{NIXL_DIR}/pull_worker.py",
                                             "self._replicated_pcp_done_sending.update(", "print("),
    "ranks_above_zero_clear_finished_sending": (f"{NIXL_DIR}/connector.py",
                                                "results.finished_sending.clear()", "pass"),
    "ranks_above_zero_skip_handshake": (f"{NIXL_DIR}/connector.py",
                                        "pcp_rank > 0:\n            return None",
                                        "pcp_rank > 0:\n            return self.rank0_meta"),
    "cpu_experts_ignore_expert_map": ("vllm/model_executor/layers/fused_moe/experts/cpu_moe.py",
                                      "weights, ids)", "weights, expert_map[ids])"),
    "cpu_communicator_lacks_variable_collectives": (
        "vllm/distributed/device_communicators/cpu_communicator.py",
        "    def all_reduce(self, x):", "    def all_gatherv(self, x, dim=0, sizes=None):"),
    "rope_forward_cpu_passes_views_to_the_kernel": (
        "vllm/model_executor/layers/rotary_embedding/base.py",
        "        ops.rotary_embedding(",
        "        query = query.flatten(1)\n        ops.rotary_embedding(",
    ),
}  # fmt: skip


def test_static_probes_know_each_defect() -> None:
    assert static_canaries.read_tree(DEFECTIVE.get)["defects"] == dict.fromkeys(
        static_canaries.PROBES, True
    )
    assert set(FIXES) == set(static_canaries.PROBES)


@pytest.mark.parametrize("probe", sorted(FIXES))
def test_static_probe_flags_an_upstream_fix(probe: str) -> None:
    path, defective, fixed = FIXES[probe]
    assert defective in DEFECTIVE[path]
    files = {**DEFECTIVE, path: DEFECTIVE[path].replace(defective, fixed)}
    found = static_canaries.read_tree(files.get)["defects"]
    assert found[probe] is False
    assert [name for name, present in found.items() if not present] == [probe]


def test_static_probes_treat_moved_code_as_not_the_known_defect() -> None:
    assert not any(static_canaries.read_tree({}.get)["defects"].values())


def test_static_digests_tell_changed_code_from_reformatted_code() -> None:
    path = "vllm/model_executor/layers/rotary_embedding/base.py"
    call = "(positions, query, key, self.head_size)"
    variants = (
        DEFECTIVE[path],
        DEFECTIVE[path].replace(call, "(\n  positions, query, key, self.head_size  # note\n)"),
        DEFECTIVE[path].replace(call, "(positions, query, key, self.rotary_dim)"),
    )
    key = f"{static_canaries.ROTARY}.forward_cpu"
    digests = [
        static_canaries.read_tree({**DEFECTIVE, path: v}.get)["digests"][key] for v in variants
    ]
    assert digests[0] == digests[1] != digests[2]
