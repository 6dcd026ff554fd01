"""How big a model is: parameter count (and how much of it is routed experts, which expert
parallelism splits), bytes per parameter and KV bytes per token, from the model's config.json
when it is in the HF cache, else from a small table of the kit's models."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: vLLM's `--dtype auto` runs float32 checkpoints in 16 bits, so 2 bytes for all three.
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 2}


@dataclass(frozen=True)
class ModelSize:
    """Parameters of a checkpoint and its KV cache per token (all layers, before any split)."""

    total_params: int
    expert_params: int  # routed experts only; 0 for a dense model
    bytes_per_param: int
    kv_bytes_per_token: int
    kv_split_by_tp: bool  # MLA's latent cache is the same on every TP rank; GQA heads split

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.bytes_per_param

    @property
    def is_moe(self) -> bool:
        return self.expert_params > 0


def _deepseek_v2_lite() -> dict[str, Any]:
    return {
        "hidden_size": 2048, "num_hidden_layers": 27, "vocab_size": 102400,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    }  # fmt: skip


#: The published config.json fields the estimate needs, for models the kit documents.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-ai/deepseek-v2-lite": _deepseek_v2_lite(),
    "deepseek-ai/deepseek-v2-lite-chat": _deepseek_v2_lite(),
    "qwen/qwen2.5-0.5b-instruct": {
        "hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864,
    },
}  # fmt: skip


def estimate(config: dict[str, Any]) -> ModelSize | None:
    """Count the parameters of a decoder-only transformer config (MLA or GQA attention, dense
    or MoE MLP). None for what it cannot count honestly: quantized or unfamiliar configs."""
    if config.get("quantization_config"):
        return None
    try:
        return _count(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _count(cfg: dict[str, Any]) -> ModelSize | None:
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        return None
    width = _DTYPE_BYTES[dtype]
    hidden, layers, vocab = (
        int(cfg["hidden_size"]),
        int(cfg["num_hidden_layers"]),
        int(cfg["vocab_size"]),
    )
    heads = int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3)
        rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        qk_dim = int(cfg["qk_nope_head_dim"]) + rope
        v_dim = int(cfg["v_head_dim"])
        q_rank = cfg.get("q_lora_rank")
        q = (
            hidden * heads * qk_dim
            if not q_rank
            else hidden * q_rank + q_rank + q_rank * heads * qk_dim
        )
        attention = q + hidden * (rank + rope) + rank + rank * heads * (qk_dim - rope + v_dim)
        attention += heads * v_dim * hidden
        kv_per_layer, split = (rank + rope) * width, False
    else:  # grouped-query attention
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        kv_per_layer, split = 2 * kv_heads * head_dim * width, True

    experts = int(
        cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    )
    dense_mlp = 3 * hidden * int(cfg["intermediate_size"])
    if experts:
        expert_size = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        every = int(cfg.get("moe_layer_freq") or cfg.get("decoder_sparse_step") or 1)
        moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % every == 0)
        shared = int(cfg.get("n_shared_experts") or 0) * expert_size
        shared = shared or int(cfg.get("shared_expert_intermediate_size") or 0)
        routed = moe_layers * experts * 3 * hidden * expert_size
        mlp = (layers - moe_layers) * dense_mlp + moe_layers * (
            3 * hidden * shared + hidden * experts
        )
    else:
        routed, mlp = 0, layers * dense_mlp
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    norms = layers * 2 * hidden + hidden
    total = embeddings + layers * attention + mlp + routed + norms
    return ModelSize(total, routed, width, kv_per_layer * layers, split)


def from_table(model: str) -> ModelSize | None:
    config = KNOWN_CONFIGS.get(model.lower())
    return None if config is None else estimate(config)


def read_config(path: Path) -> dict[str, Any] | None:
    """A config.json as a dict; None when unreadable (a half-written download, say)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
