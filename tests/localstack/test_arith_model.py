"""The trained demo model's build: the served shape, seeded bytes, the random model's cache key."""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from pcp_pd_kit.arith import build
from pcp_pd_kit.arith.train import TrainSpec
from pcp_pd_kit.localstack.tiny_model import TinyModelSpec, is_built

# A few steps on a few problems: the recipe's code path, in seconds, not its accuracy.
QUICK = build.ArithModelSpec(train=TrainSpec(steps=3, batch_size=4, n_train=64, n_heldout=12))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.build(tmp_path_factory.mktemp("a") / "arith", QUICK)


def test_fingerprint_covers_the_recipe_and_the_shape() -> None:
    assert QUICK.fingerprint() == dataclasses.replace(QUICK).fingerprint()
    other_train = dataclasses.replace(QUICK, train=dataclasses.replace(QUICK.train, seed=1))
    other_model = dataclasses.replace(QUICK, model=TinyModelSpec())
    assert len({QUICK.fingerprint(), other_train.fingerprint(), other_model.fingerprint()}) == 3


def test_build_is_seeded_and_cached(built: Path, tmp_path: Path) -> None:
    again = build.build(tmp_path / "arith", QUICK)
    digest = [
        hashlib.sha256((d / "model.safetensors").read_bytes()).digest() for d in (built, again)
    ]
    assert digest[0] == digest[1]
    before = (built / "model.safetensors").stat().st_mtime_ns
    build.build(built, QUICK)
    assert (built / "model.safetensors").stat().st_mtime_ns == before
    assert is_built(built, QUICK)
    assert not is_built(built, dataclasses.replace(QUICK, train=TrainSpec(steps=4)))


def _weights(folder: Path) -> bytes:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).digest()


def test_the_weights_do_not_depend_on_the_cpus_kernels(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a host's CPU offers (here: ATen's AVX2 build instead of the best one, and MKL's
    AVX2 path) changes no byte: the training runs under REPRODUCIBLE_ENV whatever the caller's."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert _weights(build.build(tmp_path / "arith", QUICK)) == _weights(built)


def test_the_training_interpreter_refuses_another_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    with pytest.raises(SystemExit) as exit_info:
        build.main(["--make-into", "/nonexistent"])
    assert exit_info.value.code == 2
    assert "ATEN_CPU_CAPABILITY" in capsys.readouterr().err


def test_served_shape_is_the_random_models(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    shape = TinyModelSpec()
    for key in ("kv_lora_rank", "qk_rope_head_dim", "n_routed_experts", "n_shared_experts"):
        assert config[key] == getattr(shape, key), key
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]


def test_task_data_and_chat_template(built: Path) -> None:
    from transformers import AutoTokenizer

    rows = (build.task_dir(built) / "test.jsonl").read_text().splitlines()
    assert len(rows) == QUICK.train.n_heldout
    assert json.loads(rows[0])["answer"].rsplit("\n", 1)[-1].startswith("#### ")
    assert (build.task_dir(built) / "train.jsonl").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(built))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|bos|><|user|>\nHi<|eos|>\n<|assistant|>\n"
