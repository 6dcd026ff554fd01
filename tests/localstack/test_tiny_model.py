import hashlib
from pathlib import Path

import pytest

from pcp_pd_kit.localstack.tiny_model import TinyModelSpec, build, is_built

SMALL = TinyModelSpec(corpus_lines=400)


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("a") / "tiny", SMALL)


def test_build_is_deterministic(built: Path, tmp_path: Path) -> None:
    assert _digest(build(tmp_path / "tiny", SMALL)) == _digest(built)


def test_second_build_is_skipped_and_spec_change_rebuilds(built: Path) -> None:
    weights = built / "model.safetensors"
    before = weights.stat().st_mtime_ns
    build(built, SMALL)
    assert weights.stat().st_mtime_ns == before
    assert is_built(built, SMALL)
    assert not is_built(built, TinyModelSpec(corpus_lines=401))


def test_model_shape_tokenizer_and_chat_template(built: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(built)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 128, 2048)
    tok = AutoTokenizer.from_pretrained(built)
    text = "James has 12 apples."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert max(tok(text)["input_ids"]) < 2048
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n") and "<|user|>\nhi" in chat
