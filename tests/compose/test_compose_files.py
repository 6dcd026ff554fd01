"""The compose files, interpolated with .env.example, against the Compose spec and the topology
the kit promises (PCP/EP prefill producer, decode consumer, the kit's connector, monitoring)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import compose_checks as cc
import jsonschema
import pytest
from compose_env.interpolate import tree_references
from compose_env.load import load_compose, load_raw
from compose_paths import COMPOSE_DIR, COMPOSE_FILES, SHARED

SCHEMA_PATH = SHARED / "schemas" / "compose-spec.json"
MAIN = COMPOSE_DIR / "docker-compose.yml"


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    if not SCHEMA_PATH.is_file():
        pytest.fail(f"compose spec schema not found at {SCHEMA_PATH} (expected ../shared/schemas)")
    schema = json.loads(SCHEMA_PATH.read_text())
    # The spec declares draft-07 without the trailing '#', which jsonschema does not look up.
    if "draft-07" in schema.get("$schema", ""):
        cls = jsonschema.Draft7Validator
    else:
        cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.fixture(scope="module")
def compose(env_example: dict[str, str]) -> dict:
    return load_compose(MAIN, env_example)


def test_compose_files_found() -> None:
    assert MAIN in COMPOSE_FILES


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_validates_against_compose_spec(path: Path, validator, env_example) -> None:
    errors = sorted(validator.iter_errors(load_compose(path, env_example)), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def test_schema_rejects_a_broken_file(validator, compose) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["prefill"]["ipc"] = {"not": "a string"}
    broken["services"]["decode"]["bogus_key"] = 1
    assert len(list(validator.iter_errors(broken))) >= 2


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_variable_has_default_or_env_example_line(path: Path, env_example) -> None:
    refs = tree_references(load_raw(path))
    assert refs, "no ${VAR} found: the compose file should be configurable"
    bare = sorted({r.name for r in refs if not r.has_default and r.name not in env_example})
    assert not bare, f"variables with neither a default nor a line in .env.example: {bare}"


def test_defaults_match_env_example(env_example) -> None:
    """A ${VAR:-default} that disagrees with .env.example makes a missing .env change the stack."""
    refs = tree_references(load_raw(MAIN))
    raw = MAIN.read_text()
    mismatched = []
    for ref in {r.name for r in refs if r.has_default and r.name in env_example}:
        marker = "${" + ref + ":-"
        start = raw.find(marker)
        while start >= 0:
            end = raw.find("}", start)
            default = raw[start + len(marker) : end]
            if default != env_example[ref] and not default.startswith("$"):
                mismatched.append(
                    f"{ref}: compose {default!r} vs .env.example {env_example[ref]!r}"
                )
            start = raw.find(marker, end)
    assert not mismatched, mismatched


def test_env_example_reproduces_the_reference_run(env_example) -> None:
    want = {
        "MODEL_NAME": "deepseek-ai/DeepSeek-V2-Lite-Chat",
        "PREFILLER_PCP_SIZE": "2",
        "PREFILLER_TP_SIZE": "1",
        "DECODER_TP_SIZE": "1",
        "GPU_MEMORY_UTILIZATION": "0.3",
        "PREFILL_BLOCK_SIZE": "128",
        "DECODE_BLOCK_SIZE": "128",
        "KV_CONNECTOR": "PcpCanonicalNixlConnector",
        "KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector",
    }
    assert {k: env_example.get(k) for k in want} == want
    extra = env_example["VLLM_EXTRA_ARGS"].split()
    for arg in (
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "128",
        "--max-num-batched-tokens",
        "32768",
        "--trust-remote-code",
        "--moe-backend",
        "flashinfer_cutlass",
    ):
        assert arg in extra
    assert env_example["VLLM_IMAGE"] == "vllm/vllm-openai:v0.32.0"


def test_env_example_keeps_local_stack_section_last(repo) -> None:
    lines = [ln for ln in (repo / ".env.example").read_text().splitlines() if ln.strip()]
    header = "# --- Local CPU stack (make demo / make up) ---"
    assert header in lines
    after = lines[lines.index(header) + 1 :]
    compose_knobs = {"MODEL_NAME", "PREFILLER_PCP_SIZE", "VLLM_IMAGE", "PREFILL_PORT"}
    assert not [ln for ln in after if ln.split("=", 1)[0] in compose_knobs]


def test_services_present(compose) -> None:
    assert {"prefill", "decode", "proxy", "prometheus", "grafana"} <= set(compose["services"])
    cpu = {n for n, s in compose["services"].items() if "cpu" in s.get("profiles", [])}
    assert {"prefill-cpu", "decode-cpu", "proxy-cpu"} <= cpu


def test_kv_roles_and_connector(compose, env_example) -> None:
    assert cc.check_kv_roles(compose, env_example) == []


def test_kv_roles_check_catches_swapped_role(compose, env_example) -> None:
    broken = copy.deepcopy(compose)
    cmd = broken["services"]["decode"]["command"]
    broken["services"]["decode"]["command"] = cmd.replace("kv_consumer", "kv_producer")
    assert any("decode" in p for p in cc.check_kv_roles(broken, env_example))


def test_prefill_topology_and_gpu_reservations(compose, env_example) -> None:
    assert cc.check_gpu_prefill(compose, env_example) == []


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"PREFILLER_PCP_SIZE": "4"}, "TP x PCP"),
        ({"PREFILLER_TP_SIZE": "2"}, "TP x PCP"),
        ({"DECODER_GPU_0": "1"}, "overlap"),
    ],
)
def test_gpu_check_fails_when_env_disagrees(env_example, override, needle) -> None:
    env = {**env_example, **override}
    problems = cc.check_gpu_prefill(load_compose(MAIN, env), env)
    assert any(needle in p for p in problems), problems


def test_connector_mounted_read_only_at_module_path(compose, env_example) -> None:
    module = env_example["KV_CONNECTOR_MODULE_PATH"]
    assert cc.check_connector_mount(compose, COMPOSE_DIR, module) == []
    assert cc.check_connector_mount(compose, COMPOSE_DIR, "no_such_module")


def test_pd_runtime_requirements(compose) -> None:
    assert cc.check_pd_runtime(compose) == []


def test_pd_runtime_check_catches_regressions(compose) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["prefill"].pop("ipc")
    broken["services"]["decode"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "5600"
    broken["services"]["proxy"]["depends_on"]["decode"]["condition"] = "service_started"
    problems = cc.check_pd_runtime(broken)
    assert any("ipc" in p for p in problems)
    assert any("side-channel port" in p for p in problems)
    assert any("healthy" in p for p in problems)


def test_hf_token_comes_from_environment_only() -> None:
    raw = load_raw(MAIN)
    for name in ("prefill", "decode", "prefill-cpu", "decode-cpu"):
        assert raw["services"][name]["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}"


def test_images_pinned(compose) -> None:
    for name in ("prefill", "decode"):
        assert compose["services"][name]["image"].endswith(":v0.32.0")
    args = compose["services"]["prefill-cpu"]["build"]["args"]
    assert args["VLLM_CPU_IMAGE"] == "vllm/vllm-openai-cpu:v0.32.0-x86_64"


def test_build_contexts_and_dockerfiles_exist(compose) -> None:
    missing = []
    for name, service in compose["services"].items():
        build = service.get("build")
        if not build:
            continue
        context = (COMPOSE_DIR / build["context"]).resolve()
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        if not dockerfile.is_file():
            missing.append(f"{name}: {dockerfile}")
    assert not missing, missing
