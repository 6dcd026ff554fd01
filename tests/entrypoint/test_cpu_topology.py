"""The entrypoint's CPU topology (compose's cpu profile) and KV lease, from the environment."""

from __future__ import annotations

import json
import sys

import pytest
from vllm_serve import command, cpu_topology, kv_config
from vllm_serve import main as entry

from tests.entrypoint.loader import main_env

CPU_PREFILL = {
    "KIT_KV_CONNECTOR": "PcpCanonicalNixlConnector",
    "KIT_KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector",
    "KIT_KV_ROLE": "kv_producer",
    "KIT_KV_BUFFER_DEVICE": "cpu",
    "KIT_NIXL_PROGRESS_DELAY_US": "1000",
    "KIT_NIXL_KV_LEASE_S": "30",
    "KIT_CPU_PCP_SIZE": "2",
    "KIT_CPU_EXPERT_PARALLEL": "1",
}


def test_a_pcp2_ep2_prefill_gets_flags_core_groups_and_plugin_knobs() -> None:
    flags, env = cpu_topology.cpu_topology(CPU_PREFILL, [2, 3])
    assert flags == ["--prefill-context-parallel-size", "2", "--enable-expert-parallel"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    assert env["PCP_NIXL_CPU_FIXES"] == "1" and env["PCP_NIXL_CPU_TRITON_INTERPRETER"] == "1"


def test_a_one_core_cpuset_serves_both_ranks() -> None:
    assert cpu_topology.cpu_topology(CPU_PREFILL, [0])[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"


def test_decode_and_gpu_services() -> None:
    flags, env = cpu_topology.cpu_topology({**CPU_PREFILL, "KIT_CPU_PCP_SIZE": "1"}, [1])
    assert flags == [] and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "PCP_NIXL_CPU_TRITON_INTERPRETER" not in env
    assert cpu_topology.cpu_topology({"KIT_KV_ROLE": "kv_producer"}, [0, 1]) == ([], {})


@pytest.mark.parametrize(
    ("changes", "cores", "needle"),
    [
        ({"KIT_CPU_PCP_SIZE": "two"}, [0, 1], "KIT_CPU_PCP_SIZE='two'"),
        ({"KIT_CPU_PCP_SIZE": "0"}, [0, 1], "KIT_CPU_PCP_SIZE='0'"),
        ({"KIT_CPU_EXPERT_PARALLEL": "yes"}, [0, 1], "KIT_CPU_EXPERT_PARALLEL='yes'"),
        ({}, [0, 1, 2], "cannot be split evenly over 2"),
    ],
)
def test_bad_topology_is_one_clear_error(changes: dict, cores: list[int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        cpu_topology.cpu_topology({**CPU_PREFILL, **changes}, cores)


@pytest.mark.parametrize(
    ("value", "flag"),
    [("true", "--enable-prefix-caching"), ("False", "--no-enable-prefix-caching")],
)
def test_prefix_caching_switch_reaches_both_cpu_servers(value: str, flag: str) -> None:
    env = {**CPU_PREFILL, "KIT_PREFIX_CACHING": value}
    assert cpu_topology.cpu_topology(env, [0, 1])[0][-1] == flag
    decode = {**env, "KIT_KV_ROLE": "kv_consumer", "KIT_CPU_PCP_SIZE": "1"}
    assert cpu_topology.cpu_topology(decode, [1])[0] == [flag]
    assert "prefix" not in " ".join(
        cpu_topology.cpu_topology(CPU_PREFILL, [0, 1])[0]
    )  # unset: vLLM's


@pytest.mark.parametrize(
    ("value", "argv", "needle"),
    [
        ("maybe", [], "KIT_PREFIX_CACHING='maybe' \\(PREFIX_CACHING\\): want true or false"),
        ("true", ["--no-enable-prefix-caching"], "set PREFIX_CACHING=true or false in .env"),
        ("false", ["--enable_prefix_caching"], "VLLM_CPU_EXTRA_ARGS"),
    ],
)
def test_prefix_caching_refuses_a_bad_value_or_a_second_switch(
    value: str, argv: list[str], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        cpu_topology.cpu_topology({**CPU_PREFILL, "KIT_PREFIX_CACHING": value}, [0, 1], argv)


def test_lease_reaches_the_connector_config_on_cpu_and_gpu() -> None:
    cpu = kv_config.kv_transfer_config(CPU_PREFILL)
    assert cpu["kv_connector_extra_config"]["kv_lease_duration"] == 30
    gpu = {k: v for k, v in CPU_PREFILL.items() if k != "KIT_KV_BUFFER_DEVICE"}
    assert kv_config.kv_transfer_config(gpu)["kv_connector_extra_config"] == {
        "kv_lease_duration": 30
    }
    without = {k: v for k, v in gpu.items() if k != "KIT_NIXL_KV_LEASE_S"}
    assert "kv_connector_extra_config" not in kv_config.kv_transfer_config(without)
    for bad in ("5", "30s", "-1"):
        with pytest.raises(ValueError, match=f"KIT_NIXL_KV_LEASE_S='{bad}'"):
            kv_config.kv_transfer_config({**CPU_PREFILL, "KIT_NIXL_KV_LEASE_S": bad})


def test_main_runs_the_topology_with_the_containers_own_cores(monkeypatch, tmp_path) -> None:
    main_env(monkeypatch, tmp_path, CPU_PREFILL)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(entry.os, "sched_getaffinity", lambda pid: {5, 4})
    seen = []
    monkeypatch.setattr(entry, "supervise", lambda cmd, env, **kw: seen.append((cmd, env)) or 0)
    with pytest.raises(SystemExit):
        entry.main(["--port", "8100"])
    ((cmd, env),) = seen
    assert cmd[:3] == [sys.executable, "-m", command.API_SERVER]
    assert "--prefill-context-parallel-size" in cmd and "--enable-expert-parallel" in cmd
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4|5"
    assert json.loads(cmd[-1])["kv_connector_extra_config"]["kv_lease_duration"] == 30
