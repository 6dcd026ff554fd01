"""The vLLM containers' entrypoint: each role's GPUs inside a container that sees both roles'."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "compose" / "entrypoint" / "vllm_serve.py"
spec = importlib.util.spec_from_file_location("kit_vllm_serve", PATH)
assert spec and spec.loader
serve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve)


@pytest.mark.parametrize(
    ("role", "all_ids", "want"),
    [
        (["0", "1"], ["0", "1", "2"], "0,1"),  # the defaults: prefill
        (["2"], ["0", "1", "2"], "2"),  # the defaults: decode
        (["4", "5"], ["4", "5", "6"], "0,1"),  # host ids are not container ids
        (["6"], ["4", "5", "6"], "2"),
        (["3"], ["5", "3", "4"], "0"),  # order of the list does not matter, PCI-bus order does
        (["10", "2"], ["2", "10", "11"], "1,0"),  # numeric, not string, order
        (["GPU-a", "GPU-b"], ["GPU-a", "GPU-b", "GPU-c"], "GPU-a,GPU-b"),
    ],
)
def test_role_gpus_map_to_in_container_ids(role, all_ids, want) -> None:
    assert serve.cuda_visible_devices(role, all_ids) == want


@pytest.mark.parametrize(
    ("role", "all_ids", "needle"),
    [(["7"], ["0", "1"], "not among"), (["0"], ["0", "GPU-x"], "mix of GPU indices")],
)
def test_bad_gpu_lists_are_refused(role, all_ids, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        serve.cuda_visible_devices(role, all_ids)


def test_environment_sets_devices_and_secrets_from_files(tmp_path, monkeypatch) -> None:
    token, key = tmp_path / "hf_token", tmp_path / "key"
    token.write_text("hf_secret\n")
    key.write_text("vllm-key")
    monkeypatch.setattr(serve, "HF_TOKEN_FILE", token)
    monkeypatch.setattr(serve, "VLLM_KEY_FILE", key)
    env = serve.serve_environment({"KIT_ROLE_GPUS": "2", "KIT_ALL_GPUS": "0,1,2", "X": "y"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (env["HF_TOKEN"], env["VLLM_API_KEY"], env["X"]) == ("hf_secret", "vllm-key", "y")


def test_cpu_containers_and_absent_secrets_change_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(serve, "HF_TOKEN_FILE", tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setattr(serve, "VLLM_KEY_FILE", empty)
    assert serve.serve_environment({"A": "b"}) == {"A": "b"}
