import hashlib
from pathlib import Path

import pytest

from pcp_pd_kit.localstack.tiny_model import TinyModelSpec, build, is_built

SMALL = TinyModelSpec(corpus_lines=400)
PROMPTS = (
    "James has 3 apples and buys 5 more. How many",
    "Mary has 12 cookies and gives half to her friend. How many left?",
    " ".join(f"On day {d} the farmer sold {d * 7} eggs for {d * 3} dollars." for d in range(1, 9)),
)


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
    assert not is_built(built, TinyModelSpec(corpus_lines=400, lm_head_scale=1.0))


def test_mla_and_moe_shape_vllm_cpu_serves(built: Path) -> None:
    """What PCP (MLA only) and EP2 (routed experts in halves) need, and CPU MLA's head size."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built)
    assert config.model_type == "deepseek_v2" and config.q_lora_rank is None
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576  # CPU MLA's only head size
    assert config.first_k_dense_replace < config.num_hidden_layers  # at least one MoE layer
    assert config.n_routed_experts % 2 == 0 and config.num_experts_per_tok == 2
    assert (config.hidden_size, config.vocab_size) == (128, 2048)


def test_tokenizer_and_chat_template(built: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    text = "James has 12 apples."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert max(tok(text)["input_ids"]) < 2048
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n") and "<|user|>\nhi" in chat


def test_greedy_margins_are_wide(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The served model (default spec): every greedy step's best token leads the runner-up by a
    wide logit gap, so sums reordered by P/D, PCP or batching cannot flip it (0.46 measured; with
    lm_head_scale=1 the same steps come down to 0.06)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    served = build(tmp_path_factory.mktemp("default") / "tiny", TinyModelSpec())
    tok = AutoTokenizer.from_pretrained(served)
    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
    gaps = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        for scores in out.scores:
            best, second = torch.topk(scores[0], 2).values.tolist()
            gaps.append(best - second)
    assert min(gaps) > 0.2, f"smallest greedy logit gap {min(gaps):.3f}"
