"""No silent path: with the CPU knobs on, a worker whose vLLM lacks the fixes stops the server.

vLLM leaves a general plugin out without failing - an allowlist (``VLLM_PLUGINS``) without it, a
``PYTHONPATH`` without connector/, an import error it only logs - and the rope defect then comes
back silently. The connector's worker-side constructor (run in every vLLM worker process) checks
the fixes' markers on vLLM's classes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from pcp_nixl_connector.cpu_compat import FIXES_ENV, TRITON_INTERPRETER_ENV, plugin
from tests.support.paths import CONNECTOR_DIR

pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's patched classes as they are now, restored after the test (which may patch them)."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", RotaryEmbedding.forward_cpu)
    monkeypatch.setattr(CPUUnquantizedExperts, "apply", CPUUnquantizedExperts.apply)
    from vllm.platforms.cpu import CpuPlatform

    for name in ("all_gatherv", "reduce_scatterv"):
        monkeypatch.setattr(CpuCommunicator, name, getattr(CpuCommunicator, name))
    # The classmethod object itself, so it is restored as a classmethod.
    platform_check = CpuPlatform.__dict__["check_and_update_config"]
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", platform_check)
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    ragged = CPUSDPAMLAPrefillBackend._ragged_sdpa
    monkeypatch.setattr(CPUSDPAMLAPrefillBackend, "_ragged_sdpa", ragged)
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    assert plugin.missing_fixes(), "another test left vLLM's classes patched"


def test_knob_on_without_the_fixes_names_what_is_missing_and_why(vllm_classes: None) -> None:
    with pytest.raises(plugin.CpuCompatError) as caught:
        plugin.verify_installed({FIXES_ENV: "1"})
    message = str(caught.value)
    for needle in ("RotaryEmbedding.forward_cpu", "CPUUnquantizedExperts.apply",
                   "CpuCommunicator.all_gatherv", "CpuPlatform.check_and_update_config",
                   "CPUSDPAMLAPrefillBackend._ragged_sdpa",
                   "VLLM_PLUGINS", "PYTHONPATH", "pcp_nixl_cpu_fixes"):  # fmt: skip
        assert needle in message
    plugin.verify_installed({})  # knob off: nothing is required


def test_the_fixes_installed_pass_and_one_missing_is_named(vllm_classes: None) -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    stock_rope = RotaryEmbedding.forward_cpu
    installed = plugin.apply_fixes()
    # The two fixes, then (once per process) the quantized experts' refusal under EP.
    assert [name.split(" ")[0] for name in installed[:2]] == ["rotary", "expert-parallel"]
    assert installed[-2].startswith("prefix caching for MLA")
    assert installed[-1] == plugin.FUSED_MLA_PREFILL
    assert plugin.missing_fixes() == []
    plugin.verify_installed({FIXES_ENV: "1"})
    RotaryEmbedding.forward_cpu = stock_rope  # restored by the fixture
    with pytest.raises(plugin.CpuCompatError, match=r"lacks the kit's CPU fixes \(RotaryEmb"):
        plugin.verify_installed({FIXES_ENV: "1"})


def _worker_connector(tiny_model_dir: Any, env_connector_names: Any, monkeypatch: Any) -> Any:
    """The kit's connector built in the WORKER role, over a stand-in NIXL worker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import pcp_nixl_connector.connector as kit
    from tests.connector.pcp_sim import StubPcpWorker, make_config, make_kv_cache_config

    name, module = env_connector_names
    cfg = make_config(tiny_model_dir, name, module, pcp=1)
    worker = StubPcpWorker(pcp_rank=0, xfer_stats=None)
    monkeypatch.setattr(kit, "NixlPullConnectorWorker", lambda *_a: worker)
    return kit.PcpCanonicalNixlConnector(cfg, KVConnectorRole.WORKER, make_kv_cache_config())


def test_the_connector_worker_stops_without_the_fixes(
    vllm_classes: None, tiny_model_dir: Any, env_connector_names: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv(FIXES_ENV, "1")
    monkeypatch.delenv(TRITON_INTERPRETER_ENV, raising=False)
    with pytest.raises(plugin.CpuCompatError, match=f"{FIXES_ENV}=1 but this vLLM process"):
        _worker_connector(tiny_model_dir, env_connector_names, monkeypatch)
    plugin.apply_fixes()
    assert _worker_connector(tiny_model_dir, env_connector_names, monkeypatch).pcp_rank == 0


def test_the_triton_knob_without_triton_names_the_package(monkeypatch: Any) -> None:
    from vllm.triton_utils import HAS_TRITON

    assert not HAS_TRITON  # this process never ran the interpreter hook
    monkeypatch.setattr(plugin, "triton_installed", lambda: False)
    with pytest.raises(plugin.CpuCompatError, match="package 'triton' is not installed"):
        plugin.verify_installed({TRITON_INTERPRETER_ENV: "1"})
    monkeypatch.setattr(plugin, "triton_installed", lambda: True)
    with pytest.raises(plugin.CpuCompatError, match="'pcp_nixl_triton' did not run"):
        plugin.verify_installed({TRITON_INTERPRETER_ENV: "1"})


def test_an_allowlist_without_the_general_plugin_is_caught_in_a_fresh_process() -> None:
    """vLLM honours VLLM_PLUGINS and skips the fixes without a word; the check does not."""
    code = (
        "import os\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from pcp_nixl_connector.cpu_compat import plugin\n"
        "print('missing:', plugin.missing_fixes())\n"
        "plugin.verify_installed(os.environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (FIXES_ENV, TRITON_INTERPRETER_ENV)}
    env.update(PYTHONPATH=str(CONNECTOR_DIR), VLLM_PLUGINS="pcp_nixl_triton", **{FIXES_ENV: "1"})
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "missing: ['RotaryEmbedding.forward_cpu (rope)'" in done.stdout
    assert "CpuCompatError" in done.stderr and "VLLM_PLUGINS" in done.stderr


def test_triton_is_declared_once_and_installed() -> None:
    """The CPU PCP path needs Triton: the cpu extra pins what constraints.txt pins, and it is
    installed here (before, it came only through xgrammar)."""
    import re
    from importlib.metadata import version

    import tomllib

    from tests.support.paths import REPO

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [d for d in extra["optional-dependencies"]["cpu"] if d.startswith("triton")]
    constraints = re.search(r"^triton==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert len(pins) == 1 and constraints is not None
    assert pins[0].startswith(f"triton=={constraints.group(1)};")
    assert plugin.triton_installed() and version("triton") == constraints.group(1)
