"""scripts/preflight.sh with faked `docker` and `nvidia-smi`: each failure is one sentence that
names the fix, and a healthy host passes."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest
from compose_paths import REPO

SCRIPT = REPO / "scripts" / "preflight.sh"

FAKE_DOCKER = """#!/usr/bin/env bash
# fake docker: behaviour from FAKE_* variables
case "$1 ${2:-}" in
  "compose version") [[ -n "${FAKE_COMPOSE_VERSION:-}" ]] || exit 1; echo "$FAKE_COMPOSE_VERSION" ;;
  "info --format") [[ -z "${FAKE_DOCKER_DOWN:-}" ]] || exit 1; echo "${FAKE_RUNTIMES:-{}}" ;;
  *) exit 64 ;;
esac
"""
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# fake nvidia-smi: one index per line from FAKE_GPUS
[[ -z "${FAKE_NVIDIA_FAIL:-}" ]] || exit 9
for i in ${FAKE_GPUS:-}; do echo "$i"; done
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def host(tmp_path):
    """A fake healthy GPU host: 3 GPUs, Compose 2.29, NVIDIA runtime, cached model, free ports."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "docker", FAKE_DOCKER)
    _executable(bin_dir / "nvidia-smi", FAKE_NVIDIA_SMI)
    cache = tmp_path / "hf"
    (cache / "hub/models--deepseek-ai--DeepSeek-V2-Lite-Chat/snapshots/abc").mkdir(parents=True)
    (tmp_path / "empty.env").write_text("")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "PREFLIGHT_"))}
    for key in list(base):  # the settings under test come from the files, not this shell
        if key.endswith(("_PORT", "_TP_SIZE", "_PCP_SIZE")) or key.startswith(
            ("PREFILLER_GPU", "DECODER_GPU", "HF_", "MODEL_NAME", "COMPOSE_")
        ):
            del base[key]
    ports = _free_ports(5)
    env = {
        **base,
        "PATH": f"{bin_dir}:{base['PATH']}",
        "FAKE_COMPOSE_VERSION": "2.29.1",
        "FAKE_RUNTIMES": '{"runc":{},"nvidia":{"path":"nvidia-container-runtime"}}',
        "FAKE_GPUS": "0 1 2",
        "HF_CACHE_DIR": str(cache),
        **dict(zip(("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT"),
                   map(str, ports), strict=True)),
    }  # fmt: skip
    return {"env": env, "env_file": tmp_path / "empty.env", "tmp": tmp_path}


def _free_ports(count: int) -> list[int]:
    import procs

    return procs.free_ports(count)


def run(host, **overrides: str) -> subprocess.CompletedProcess:
    env = {**host["env"], **overrides}
    for key, value in overrides.items():
        if value is None:
            env.pop(key)
    argv = [str(SCRIPT), "--env-file", str(host["env_file"])]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def fails(res: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in res.stdout.splitlines() if ln.startswith("FAIL")]


def test_healthy_host_passes(host) -> None:
    res = run(host)
    assert res.returncode == 0, res.stdout + res.stderr
    assert fails(res) == []
    assert "3 GPU(s) for 3 needed (prefill 1 x 2, decode 1)" in res.stdout


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"FAKE_COMPOSE_VERSION": ""}, "Docker Compose v2 is missing"),
        ({"FAKE_COMPOSE_VERSION": "1.29.2"}, "the compose files need v2 or later"),
        ({"FAKE_RUNTIMES": '{"runc":{}}'}, "install the NVIDIA Container Toolkit"),
        ({"FAKE_DOCKER_DOWN": "1"}, "the Docker daemon is not reachable"),
        ({"FAKE_GPUS": "0 1"}, "found 2 GPU(s) but prefill needs"),
        ({"FAKE_NVIDIA_FAIL": "1"}, "the NVIDIA driver is not working"),
        ({"PREFILLER_PCP_SIZE": "4", "FAKE_GPUS": "0 1 2 3 4 5"}, "reserves 2 prefill GPU(s)"),
        ({"DECODER_GPU_0": "1"}, "GPU 1 is given to both"),
        ({"DECODER_GPU_0": "7"}, "DECODER_GPU_0=7 but nvidia-smi lists GPU ids 0 1 2"),
        ({"PREFILLER_TP_SIZE": "two"}, "PREFILLER_TP_SIZE='two' is not a positive integer"),
        ({"PROXY_PORT": "70000"}, "PROXY_PORT='70000' is not a TCP port"),
    ],
)
def test_each_failure_is_a_sentence_with_a_fix(host, overrides, needle) -> None:
    res = run(host, **overrides)
    lines = fails(res)
    assert res.returncode == len(lines) >= 1, res.stdout
    assert any(needle in ln for ln in lines), res.stdout
    assert all(ln.rstrip().endswith(".") and ":" in ln for ln in lines), lines


def test_missing_docker_and_nvidia_smi(host, tmp_path) -> None:
    res = run(host, PREFLIGHT_DOCKER="no-such-docker", PREFLIGHT_NVIDIA_SMI=str(tmp_path / "nope"))
    text = "\n".join(fails(res))
    assert "docker is not installed" in text
    assert "nvidia-smi is not installed" in text


def test_busy_port_is_named(host) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", int(host["env"]["GRAFANA_PORT"])))
        sock.listen()
        res = run(host)
    assert any(
        f"port {host['env']['GRAFANA_PORT']} (GRAFANA_PORT) is already in use" in ln
        for ln in fails(res)
    )


def test_model_needs_cache_or_token(host, tmp_path) -> None:
    res = run(host, HF_CACHE_DIR=str(tmp_path / "empty-cache"))
    assert any("HF_TOKEN is empty" in ln for ln in fails(res))
    res = run(host, HF_CACHE_DIR=str(tmp_path / "empty-cache"), HF_TOKEN="hf_x")
    assert fails(res) == []


def test_env_file_values_are_read_and_env_wins(host) -> None:
    host["env_file"].write_text('PREFILLER_PCP_SIZE="4"  # four\nFAKE_IGNORED=1\n')
    res = run(host, FAKE_GPUS="0 1 2 3")
    assert "found 4 GPU(s) but prefill needs" in res.stdout and "5 in all" in res.stdout
    res = run(host, FAKE_GPUS="0 1 2", PREFILLER_PCP_SIZE="2")
    assert fails(res) == []


def test_cpu_profile_skips_gpu_checks(host) -> None:
    (host["tmp"] / "hf/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/x").mkdir(parents=True)
    res = run(host, COMPOSE_PROFILES="cpu", FAKE_GPUS="", FAKE_RUNTIMES="{}")
    assert res.returncode == 0, res.stdout
    assert "GPU checks skipped" in res.stdout


def test_missing_env_file_is_an_error(host, tmp_path) -> None:
    host["env_file"] = tmp_path / "absent.env"
    res = run(host)
    assert res.returncode == 100
    assert "does not exist" in res.stderr
