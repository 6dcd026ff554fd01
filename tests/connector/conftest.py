"""Shared fixtures for the connector tests: .env.example names, a tiny model dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.env import example_env

# A 2-layer Llama: config only, no weights (the scheduler never runs a model).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture(scope="session")
def env_connector_names() -> tuple[str, str]:
    env = example_env()
    return env["KV_CONNECTOR"], env["KV_CONNECTOR_MODULE_PATH"]


def write_tiny_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
