"""Build a deterministic tiny random-weights DeepSeek-V2 (MLA + MoE) with its own BPE tokenizer.

No model hub is reachable on CI or on a fresh machine, so the demo and the tests need a model that
is made locally in seconds. It has the shape the kit's topology needs: multi-head latent attention
(vLLM's PCP runs MLA models only) and routed experts (what expert parallelism splits). Same spec ->
same files (seeded weights, seeded tokenizer corpus), and a marker file records the spec's
fingerprint so a second call is a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("pcp_pd_kit.localstack.tiny_model")

MARKER_FILE = "pcp-pd-kit-tiny-model.json"
SERVED_NAME = "tiny-mla-moe"
DEFAULT_DIR = Path(".models") / SERVED_NAME
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
# A plain role-tagged template: vLLM's /v1/chat/completions needs one and the tiny tokenizer has
# no upstream template to inherit.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (
    "the a an and or but if then so of to in on at by for with from as is are was were be been "
    "has have had do does did will would can could should may might must shall not no yes "
    "how many much more less than each every all some any total left per half twice times "
    "he she they we you it his her their our its him them who what which when where why "
    "buy buys bought sell sells sold pay pays paid cost costs earn earns earned spend spent "
    "give gives gave take takes took make makes made need needs use uses used get gets got "
    "apple apples orange box boxes book books car cars dog dogs cat cats egg eggs cookie "
    "cookies dollar dollars cent cents hour hours minute minutes day days week weeks month "
    "year years mile miles meter meters pound pounds student students friend friends class "
    "school store farm farmer garden money price number answer question step first second "
    "third last next after before during again same other new old big small long short "
    "James Mary John Sarah Tom Anna Mike Lisa Janet Weng Betty Julie Albert Ken Alexis"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the output files; its hash is the idempotency key."""

    seed: int = 1234
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256  # the dense first layer's MLP
    num_hidden_layers: int = 2
    first_k_dense_replace: int = 1  # layer 0 dense, layer 1 MoE (as DeepSeek-V2-Lite starts)
    n_routed_experts: int = 4  # split 2 + 2 over an EP2 prefill
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    num_attention_heads: int = 4
    # MLA: vLLM's CPU MLA kernels support only a latent of 512 + 64 (head size 576).
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    max_position_embeddings: int = 4096
    initializer_range: float = 0.5
    # The last hidden state is RMS-normalised, so the logit gap between the two best tokens grows
    # linearly with this factor on lm_head: measured over 96 greedy steps, the smallest gap is
    # 0.058 logits at 1x and 0.46 at 8x. Wide gaps keep greedy argmax stable when P/D, PCP and
    # batching sum the same math in a different order.
    lm_head_scale: float = 8.0
    corpus_lines: int = 4000

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True) + CHAT_TEMPLATE + "|".join(SPECIAL_TOKENS)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def seeded_corpus(spec: TinyModelSpec) -> list[str]:
    """Word-salad with numbers and punctuation, so GSM8K-like text tokenizes compactly."""
    rng = random.Random(spec.seed)
    lines = []
    for _ in range(spec.corpus_lines):
        words = []
        for _ in range(rng.randint(6, 24)):
            roll = rng.random()
            if roll < 0.15:
                words.append(str(rng.randint(0, 2000)))
            elif roll < 0.2:
                words.append(rng.choice(["$", "+", "-", "*", "/", "=", "%", "####", "(", ")"]))
            else:
                words.append(rng.choice(_WORDS))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]))
    return lines


class Fingerprinted(Protocol):
    def fingerprint(self) -> str: ...


def is_built(out_dir: Path, spec: Fingerprinted) -> bool:
    """True when out_dir holds a complete build of exactly this spec."""
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return recorded.get("fingerprint") == spec.fingerprint() and all(
        (out_dir / name).is_file() for name in needed
    )


def build_into(
    out_dir: Path, spec: Fingerprinted, record: dict[str, Any], make: Callable[[Path], None]
) -> Path:
    """Run make(folder) unless out_dir already holds this spec's build; the cache-key scheme
    both kit models share (a marker file with the spec's fingerprint)."""
    out_dir = out_dir.resolve()
    if is_built(out_dir, spec):
        log.info("model already built at %s (fingerprint %s)", out_dir, spec.fingerprint())
        return out_dir
    # A private temp dir, renamed into place at the end: two concurrent builds (make demo beside
    # make test) never see each other's half-written files.
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    make(tmp)
    (tmp / MARKER_FILE).write_text(
        json.dumps({"fingerprint": spec.fingerprint(), **record}, indent=2) + "\n"
    )
    if is_built(out_dir, spec):  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("built model at %s (fingerprint %s)", out_dir, spec.fingerprint())
    return out_dir


def _build_tokenizer(spec: TinyModelSpec, out_dir: Path) -> None:
    train_tokenizer(seeded_corpus(spec), spec.vocab_size, spec.max_position_embeddings, out_dir)


def train_tokenizer(corpus: list[str], vocab_size: int, max_length: int, out_dir: Path) -> None:
    """A byte-level BPE with the kit's special tokens and chat template, saved to out_dir.

    Shared with the trained demo model, so both answer chat requests the same way.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def deepseek_config(spec: TinyModelSpec, bos_id: int, eos_id: int) -> Any:
    """The DeepSeek-V2 config of this spec: MLA with vLLM's CPU latent size, routed + shared
    experts, greedy top-k (shared with the trained demo model, so both have one shape)."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        first_k_dense_replace=spec.first_k_dense_replace,
        n_routed_experts=spec.n_routed_experts,
        n_shared_experts=spec.n_shared_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        q_lora_rank=None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def _build_weights(spec: TinyModelSpec, out_dir: Path, bos_id: int, eos_id: int) -> None:
    import torch
    from transformers import DeepseekV2ForCausalLM

    config = deepseek_config(spec, bos_id, eos_id)
    torch.manual_seed(spec.seed)
    model = DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(spec.lm_head_scale)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build(out_dir: Path, spec: TinyModelSpec | None = None) -> Path:
    """Build (or keep) the tiny model in out_dir and return its path."""
    chosen = spec or TinyModelSpec()

    def make(folder: Path) -> None:
        _build_tokenizer(chosen, folder)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        _build_weights(chosen, folder, tokenizer.bos_token_id, tokenizer.eos_token_id)

    return build_into(out_dir, chosen, {"spec": asdict(chosen)}, make)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcp_pd_kit.localstack.tiny_model", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
