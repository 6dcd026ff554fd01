"""scripts/preflight.sh end to end on a fake host: arguments, output formats, the exit status,
profiles, loading settings through Compose, and the Docker/Compose/runtime checks (moved here
from tests/compose/test_preflight.py and extended)."""

from __future__ import annotations

import json

import pytest

from tests.preflight.fake_host import FakeHost, cache_model, consistent


def test_healthy_host_passes_every_check(host: FakeHost) -> None:
    out = consistent(host.run())
    assert out.returncode == 0, out.dump()
    assert {r["status"] for r in out.results} == {"ok"}, out.dump()
    expected = {"compose", "settings", "profile", "nvidia-runtime", "gpus", "gpu-ids",
                "moe-backend", "memory", "driver-cuda", "nixl", "kv-transport", "cdi", "subnet",
                "disk",
                "model", "secrets", "ports", "vllm-version"}  # fmt: skip
    assert {r["check"] for r in out.results} == expected
    assert "3 GPU(s) for 3 needed (prefill 1 x 2, decode 1)" in out.text("gpus")


def test_text_output_is_one_line_per_result_and_a_summary(host: FakeHost) -> None:
    host.gpus = host.gpus[:2] if host.gpus else None
    text = host.run(json_output=False)
    as_json = host.run()
    lines = text.stdout.splitlines()
    assert len(as_json.results) == lines.index("")  # the results, a blank line, the summary
    for line, result in zip(lines[: lines.index("")], as_json.results, strict=True):
        assert line == f"{result['status']:<4}  {result['message']}"
    assert lines[-1].startswith(f"{len(as_json.fails)} check(s) failed")
    assert text.returncode == as_json.returncode == len(as_json.fails) >= 1


def test_summary_names_the_env_file_in_the_next_command(host: FakeHost) -> None:
    env_file = host.tmp / "site.env"
    env_file.write_text("")
    out = host.run("--env-file", str(env_file), json_output=False)
    assert out.returncode == 0, out.dump()
    assert (
        out.stdout.splitlines()[-1]
        == f"all checks passed: docker compose --env-file {env_file} up -d"
    )


def test_env_file_and_profiles_are_passed_to_compose(host: FakeHost) -> None:
    env_file = host.tmp / "site.env"
    env_file.write_text("")
    host.run("--env-file", str(env_file), "--profile", "gpu")
    config_call = next(c for c in host.calls() if c.startswith("compose") and "config" in c)
    assert config_call == (f"compose --env-file {env_file} --profile gpu -f {host.compose_file} "
                           "config --format json")  # fmt: skip


def test_missing_env_file_is_a_usage_error(host: FakeHost) -> None:
    out = host.run("--env-file", str(host.tmp / "absent.env"), json_output=False)
    assert out.returncode == 100
    assert "does not exist" in out.stderr
    assert host.calls() == []


def test_unknown_argument_is_a_usage_error(host: FakeHost) -> None:
    out = host.run("--frobnicate", json_output=False)
    assert out.returncode == 100
    assert "unrecognized arguments: --frobnicate" in out.stderr


def test_help_describes_the_checks(host: FakeHost) -> None:
    out = host.run("--help", json_output=False)
    assert out.returncode == 0
    for word in ("--env-file", "--json", "--profile", "PREFLIGHT_DOCKER", "docs/preflight.md"):
        assert word in out.stdout
    assert host.calls() == []


# -- docker and compose --------------------------------------------------------------------------
def test_missing_docker_and_nvidia_smi(host: FakeHost) -> None:
    out = consistent(host.run(PREFLIGHT_DOCKER="no-such-docker",
                              PREFLIGHT_NVIDIA_SMI=str(host.tmp / "nope")))  # fmt: skip
    assert "docker is not installed (no 'no-such-docker' on PATH)" in out.text("docker")
    assert "nvidia-smi is not installed" in out.text("gpus")
    assert out.status("settings") == ["WARN"]  # the rest needs Compose's settings
    assert out.returncode == 2


@pytest.mark.parametrize(
    ("change", "check", "needle"),
    [
        ({"compose_version": None}, "compose", "Docker Compose v2 plugin missing"),
        ({"compose_version": "1.29.2"}, "compose", "compose.yaml needs v2 or later"),
        ({"info": None}, "docker-daemon", "the Docker daemon is not reachable"),
        ({"info": {"ServerErrors": ["Cannot connect"]}}, "docker-daemon", "not reachable"),
        ({"info": {"Runtimes": {"runc": {}}}}, "nvidia-runtime", "NVIDIA Container Toolkit"),
    ],
)
def test_docker_failures_name_the_fix(host: FakeHost, change, check, needle) -> None:
    for name, value in change.items():
        setattr(host, name, value)
    out = consistent(host.run())
    assert out.status(check) == ["FAIL"], out.dump()
    assert needle in out.text(check)


def test_cdi_devices_count_as_nvidia_support(host: FakeHost) -> None:
    host.info = {"Runtimes": {"runc": {}}, "DockerRootDir": str(host.tmp),
                 "DiscoveredDevices": [{"Source": "cdi", "ID": "nvidia.com/gpu=all"}]}  # fmt: skip
    out = consistent(host.run())
    assert out.status("nvidia-runtime") == ["ok"]
    assert "CDI" in out.text("nvidia-runtime")


# -- settings through Compose ---------------------------------------------------------------------
def test_missing_compose_file(host: FakeHost) -> None:
    host.compose_file.unlink()
    out = consistent(host.run())
    assert out.status("settings") == ["FAIL", "WARN"]
    assert f"{host.compose_file} does not exist" in out.text("settings")
    assert not any("config" in call for call in host.calls())


def test_compose_config_failure_is_quoted(host: FakeHost) -> None:
    host.compose_config = "service 'prefill' refers to undefined volume hf: invalid project"
    host.compose_config_rc = 15
    out = consistent(host.run())
    assert out.status("settings") == ["FAIL", "WARN"]
    assert ("'docker compose config' failed (service 'prefill' refers to undefined volume hf: "
            "invalid project): fix compose.yaml or .env") in out.text("settings")  # fmt: skip


def test_settings_block_missing_or_incomplete(host: FakeHost) -> None:
    host.compose_config = json.dumps({"name": "pcp-pd-kit", "services": {}})
    out = consistent(host.run())
    assert "has no top-level x-kit-settings block" in out.text("settings")
    host.compose_config = None
    del host.settings["pd_subnet"], host.settings["bind_address"]
    out = consistent(host.run())
    assert "lacks pd_subnet, bind_address" in out.text("settings")


def test_bad_sizes_are_named(host: FakeHost) -> None:
    host.settings["prefill_tp_size"] = "two"
    out = consistent(host.run())
    assert "PREFILLER_TP_SIZE='two' is not a positive integer: fix it in .env." in out.text("gpus")


# -- profiles -------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["env", "flag"])
def test_cpu_profile_skips_gpu_checks(host: FakeHost, how: str) -> None:
    host.gpus, host.info = None, {"Runtimes": {}, "DockerRootDir": str(host.tmp)}
    cpu_model = "Qwen/Qwen2.5-0.5B-Instruct"
    host.settings["cpu_model_name"] = cpu_model
    cache_model(host.cache, cpu_model, {"hidden_size": 896})
    args, env = (("--profile", "cpu"), {}) if how == "flag" else ((), {"COMPOSE_PROFILES": "cpu"})
    out = consistent(host.run(*args, **env))
    assert out.returncode == 0, out.dump()
    assert "GPU checks skipped" in out.text("profile")
    checks = {r["check"] for r in out.results}
    assert not checks & {"nvidia-runtime", "gpus", "gpu-ids", "moe-backend", "memory", "nixl"}
    assert f"model {cpu_model} found" in out.text("model")


def test_services_without_gpus_skip_gpu_checks(host: FakeHost) -> None:
    """COMPOSE_PROFILES=cpu in .env reaches preflight through Compose's resolved services."""
    host.services = {"prefill-cpu": {"image": "x"}, "prometheus": {"image": "y"}}
    host.gpus = None
    out = consistent(host.run())
    assert "no selected service reserves a GPU" in out.text("profile")
    assert out.status("gpus") == []


def test_no_selected_service_is_a_warning(host: FakeHost) -> None:
    host.services = {}
    out = consistent(host.run())
    assert out.status("profile") == ["WARN"]
    assert "set COMPOSE_PROFILES=gpu" in out.text("profile")


def test_a_kv_pull_left_to_tcp_fails_before_anything_starts(host: FakeHost) -> None:
    """GET zero-copy at UCX's `auto` (off without NVLink) and UCX_TLS without cuda_ipc: the
    entrypoint's own rule (compose/entrypoint/vllm_serve/transport.py) names both, per server."""
    host.services["decode"]["environment"] = {"UCX_TLS": "tcp,self"}
    out = host.run()
    assert out.status("kv-transport") == ["FAIL"], out.dump()
    text = out.text("kv-transport")
    assert "decode: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=(unset: auto)" in text
    assert "decode: UCX_TLS=tcp,self has no cuda_ipc" in text and "prefill:" not in text
