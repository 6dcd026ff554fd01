"""Settings through the real Docker Compose binary (skipped where it is not installed): the
environment beats the env file, which beats compose.yaml's defaults, exactly as for `up`; and
the repo's compose.yaml carries every setting preflight reads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pcp_pd_kit.preflight import settings
from tests.preflight.fake_host import MODEL, REAL_COMPOSE, REPO, FakeHost, consistent

needs_compose = pytest.mark.skipif(
    not REAL_COMPOSE.is_file(),
    reason=f"no Docker Compose plugin at {REAL_COMPOSE} (install docker-compose-plugin)",
)

BLOCK = """\
name: ${COMPOSE_PROJECT_NAME:-pcp-pd-kit}
x-kit-settings:
  model_name: ${MODEL_NAME:-deepseek-ai/DeepSeek-V2-Lite-Chat}
  vllm_image: ${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}
  prefill_tp_size: ${PREFILLER_TP_SIZE:-1}
  prefill_pcp_size: ${PREFILLER_PCP_SIZE:-2}
  decode_tp_size: ${DECODER_TP_SIZE:-1}
  prefill_gpus: ${PREFILL_GPUS:-0,1}
  decode_gpus: ${DECODE_GPUS:-2}
  prefill_gpu_memory_utilization: ${PREFILL_GPU_MEMORY_UTILIZATION:-0.85}
  decode_gpu_memory_utilization: ${DECODE_GPU_MEMORY_UTILIZATION:-0.85}
  moe_backend: ${MOE_BACKEND:-auto}
  max_model_len: ${MAX_MODEL_LEN:-4096}
  hf_cache_dir: ${HF_CACHE_DIR:-~/.cache/huggingface}
  hf_token_file: ${HF_TOKEN_FILE:-./secrets/hf_token}
  pd_subnet: ${PD_SUBNET:-172.28.0.0/24}
  proxy_port: ${PROXY_PORT:-8000}
  prometheus_port: ${PROMETHEUS_PORT:-9090}
  grafana_port: ${GRAFANA_PORT:-3000}
  bind_address: ${BIND_ADDRESS:-127.0.0.1}
services:
  prefill:
    profiles: [gpu]
    image: ${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}
    deploy:
      resources:
        reservations:
          devices:
            - driver: nvidia
              device_ids: ["0", "1"]
              capabilities: [gpu]
  prefill-cpu:
    profiles: [cpu]
    image: cpu-image
  prometheus:
    image: prom/prometheus
"""


@pytest.fixture
def real(host: FakeHost) -> FakeHost:
    """The fake host, but `docker compose` is the real plugin reading a real compose.yaml."""
    host.compose_real = REAL_COMPOSE
    host.compose_file.write_text(BLOCK)
    for key in ("proxy_port", "prometheus_port", "grafana_port"):
        host.env[key.upper()] = host.settings[key]
    host.env["HF_CACHE_DIR"] = str(host.cache)
    host.env["HF_TOKEN_FILE"] = str(host.token_file)
    return host


@needs_compose
def test_env_file_beats_defaults_and_environment_beats_env_file(real: FakeHost) -> None:
    env_file = real.tmp / "site.env"
    env_file.write_text("COMPOSE_PROFILES=gpu\nDECODE_GPU_MEMORY_UTILIZATION=0.3\n"
                        "PREFILL_GPUS=0,5\nMOE_BACKEND=bogus\n")  # fmt: skip
    out = consistent(real.run("--env-file", str(env_file), PREFILL_GPUS="0,1"))
    assert "services reserving GPUs: prefill" in out.text("profile")
    assert f"--env-file {env_file}" in next(c for c in real.calls() if "config" in c)
    assert "set DECODE_GPU_MEMORY_UTILIZATION=0.50" in out.text("memory")  # from the env file
    assert out.status("gpu-ids") == ["ok"]  # PREFILL_GPUS from the environment wins
    assert "MOE_BACKEND='bogus'" in out.text("moe-backend")
    assert "PD_SUBNET=172.28.0.0/24" in out.text("subnet")  # compose.yaml's default
    assert MODEL in out.text("model")


@needs_compose
def test_profiles_from_the_env_file_select_the_services(real: FakeHost) -> None:
    env_file = real.tmp / "cpu.env"
    env_file.write_text("COMPOSE_PROFILES=cpu\n")
    real.gpus = None  # a CPU-only host
    out = consistent(real.run("--env-file", str(env_file)))
    assert "no selected service reserves a GPU (prefill-cpu, prometheus)" in out.text("profile")
    assert out.status("gpus") == []


@needs_compose
def test_compose_errors_are_reported(real: FakeHost) -> None:
    real.compose_file.write_text(BLOCK + "  broken: ${UNCLOSED\n")
    out = consistent(real.run())
    assert out.status("settings")[0] == "FAIL"
    assert "'docker compose config' failed" in out.text("settings")


REPO_COMPOSE = REPO / "compose.yaml"


@needs_compose
@pytest.mark.skipif(not REPO_COMPOSE.is_file(), reason="compose.yaml is not at the repo root yet")
def test_repo_compose_file_has_every_setting(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    argv = settings.config_argv(str(REAL_COMPOSE), REPO_COMPOSE, empty, [])
    proc = subprocess.run([str(REAL_COMPOSE), *argv[2:]], capture_output=True, text=True,
                          timeout=60, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    view = settings.parse_config(proc.stdout)
    assert set(settings.REQUIRED) <= set(view.settings)
    assert json.loads(proc.stdout)["x-kit-settings"]["moe_backend"]


@needs_compose
@pytest.mark.skipif(not REPO_COMPOSE.is_file(), reason="compose.yaml is not at the repo root yet")
def test_repo_compose_file_on_a_healthy_fake_host(host: FakeHost) -> None:
    """The real compose.yaml, resolved by the real Compose, on the fake 3 x H100 host."""
    host.compose_real = REAL_COMPOSE
    empty = host.tmp / "empty.env"
    empty.write_text("")
    env = {key.upper(): host.settings[key] for key in ("proxy_port", "prometheus_port",
                                                       "grafana_port")}  # fmt: skip
    out = consistent(host.run("--env-file", str(empty), PREFLIGHT_COMPOSE_FILE=None,
                              HF_CACHE_DIR=str(host.cache), **env))  # fmt: skip
    assert out.status("settings") == ["ok"], out.dump()
    assert "decode, prefill" in out.text("profile")
    assert out.returncode == 0, out.dump()
