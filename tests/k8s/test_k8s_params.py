"""One place for defaults: the knobs in deploy/k8s equal .env.example's (the file compose's
defaults equal too), so the two deployments cannot drift apart silently."""

from __future__ import annotations

import pytest

from tests.k8s import checks as ck
from tests.k8s.manifests import BASE, env_example, find, params_file, role_templates
from tests.k8s.renders import needs_kubectl, rendered

PARAMS = BASE / "params.env"
# Knobs compose does not have (it mounts the host's HF_CACHE_DIR): params.env is their one place,
# and .env.example must not grow a second copy.
K8S_ONLY = {"HF_CACHE_SIZE"}


def params_problems(params: dict[str, str], env: dict[str, str]) -> list[str]:
    """Every params.env key is a .env.example knob with the same value (K8S_ONLY: only here)."""
    problems = []
    for key, value in params.items():
        if key in K8S_ONLY:
            if key in env:
                problems.append(f"{key} is Kubernetes-only: remove it from .env.example")
        elif key not in env:
            problems.append(f"{key} is in deploy/k8s/base/params.env but not in .env.example")
        elif env[key] != value:
            problems.append(
                f"{key}: params.env {value!r} != .env.example {env[key]!r} "
                f"(copy the line: {key}={env[key]})"
            )
        if value.startswith(('"', "'")):
            problems.append(f"{key}: quoted value (kustomize keeps the quotes)")
    return problems


def test_params_equal_env_example() -> None:
    assert params_problems(params_file(PARAMS), env_example()) == []


def test_params_cover_the_serving_knobs() -> None:
    """The knobs the vLLM command lines use are all here (none hard-coded in the manifests)."""
    assert {
        "MODEL_NAME",
        "PREFILLER_TP_SIZE",
        "PREFILLER_PCP_SIZE",
        "DECODER_TP_SIZE",
        "BLOCK_SIZE",
        "MAX_MODEL_LEN",
        "PREFILL_GPU_MEMORY_UTILIZATION",
        "DECODE_GPU_MEMORY_UTILIZATION",
        "MOE_BACKEND",
        "VLLM_EXTRA_ARGS",
        "KV_CONNECTOR",
        "KV_CONNECTOR_MODULE_PATH",
        "UCX_TLS",
        "UCX_NET_DEVICES",
        "PREFILL_NIXL_SIDE_CHANNEL_PORT",
        "DECODE_NIXL_SIDE_CHANNEL_PORT",
        "ENFORCE_EAGER",
        "HF_CACHE_SIZE",
    } <= set(params_file(PARAMS))


def test_params_check_can_fail() -> None:
    env = env_example()
    params = params_file(PARAMS)
    assert params_problems({**params, "MOE_BACKEND": "triton"}, env)
    assert params_problems({**params, "NOT_A_KNOB": "1"}, env)
    assert params_problems(params, {**env, "HF_CACHE_SIZE": params["HF_CACHE_SIZE"]})
    assert params_problems(
        {**params, "VLLM_EXTRA_ARGS": '"--x 1"'}, {**env, "VLLM_EXTRA_ARGS": '"--x 1"'}
    )


@needs_kubectl
def test_rendered_params_are_params_env() -> None:
    assert ck.params(rendered("base")) == params_file(PARAMS)


@needs_kubectl
@pytest.mark.parametrize("name", ["base", "overlay:1p1d", "overlay:xpyd"])
def test_images_and_sizes_follow_env_example(name: str) -> None:
    env = env_example()
    objs = rendered(name)
    problems = []
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            if t.container("vllm")["image"] != env["VLLM_IMAGE"]:
                problems.append(f"{t.owner}: image is not VLLM_IMAGE {env['VLLM_IMAGE']}")
    for dep in find(objs, "Deployment", "pcp-pd-prometheus"):
        image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
        if image != env["KIT_PROMETHEUS_BASE_IMAGE"]:
            problems.append(f"Prometheus image {image} != KIT_PROMETHEUS_BASE_IMAGE")
    problems += ck.check_shm(objs, ck.docker_size_bytes(env["SHM_SIZE"]))
    problems += ck.check_vllm_http(objs, ck.duration_seconds(env["VLLM_START_PERIOD"]))
    assert problems == []


def test_size_and_duration_parsers() -> None:
    assert ck.docker_size_bytes("16g") == ck.quantity_bytes("16Gi")
    assert ck.duration_seconds("30m0s") == 1800
    assert ck.duration_seconds("1h") == ck.duration_seconds("60m") == 3600
    with pytest.raises(ValueError):
        ck.quantity_bytes("16g")
