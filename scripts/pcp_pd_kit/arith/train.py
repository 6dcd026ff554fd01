"""Train the tiny DeepSeek-V2 on the templated problems: seeded, single-process, CPU float32.

Why this loop and not a trainer library: a fixed thread count, a fixed batch order and
deterministic ops are all that reproducibility needs, and a plain loop keeps the whole recipe
readable in one screen. The loss covers only the completion (worked answer, ``#### N``, EOS), the
exact tokens greedy decoding must produce after lm-eval's zero-shot GSM8K prompt.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.arith.problems import Problem, completion, prompt

log = logging.getLogger("pcp_pd_kit.arith.train")
IGNORE = -100  # label of a token the loss skips (transformers' convention)


@dataclass(frozen=True)
class TrainSpec:
    """Every knob of the recipe; part of the model's cache key."""

    seed: int = 1234
    # One thread: the same sums in the same order on any host, and no OpenMP barrier stalls
    # when the two cores are shared (two threads there ran several times slower).
    threads: int = 1
    steps: int = 450
    batch_size: int = 32
    lr: float = 4e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    n_train: int = 20000
    n_heldout: int = 150
    # The latent KV width trained; widen() embeds it exactly into the served model's (vLLM's CPU
    # MLA kernels need 512). A narrow latent cuts the two largest matmuls of every layer.
    kv_lora_rank: int = 64


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


def encode(problem: Problem, tokenizer: Any, eos_id: int) -> Example:
    """Prompt and completion tokenized apart, as vLLM sees them: the prompt is what lm-eval sends,
    the completion what the model writes after it."""
    p_ids: list[int] = tokenizer(prompt(problem.question), add_special_tokens=False)["input_ids"]
    c_ids: list[int] = tokenizer(completion(problem.answer), add_special_tokens=False)["input_ids"]
    c_ids = [*c_ids, eos_id]
    return Example([*p_ids, *c_ids], [IGNORE] * len(p_ids) + c_ids)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _batch(examples: Sequence[Example], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = [e.input_ids + [pad_id] * (width - len(e.input_ids)) for e in examples]
    labels = [e.labels + [IGNORE] * (width - len(e.labels)) for e in examples]
    # Right padding under a causal mask changes nothing before it, and its labels are ignored.
    return torch.tensor(ids), torch.tensor(labels)


def completion_loss(model: Any, ids: Any, labels: Any) -> Any:
    """Cross-entropy at the completion's positions only: lm_head runs where the loss looks."""
    import torch

    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != IGNORE
    logits = model.lm_head(hidden[keep])
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def widen(small: Any, wide: Any) -> None:
    """Copy ``small`` (latent width r) into ``wide`` (latent R > r) so both compute the same.

    The extra latent channels are zero in kv_a_proj's output and unused by kv_b_proj. Their
    zeros shrink the latent RMS norm's mean square by r/R, so its weights scale by sqrt(r/R)
    (exact up to the norm's epsilon).
    """
    import torch

    r, big = small.config.kv_lora_rank, wide.config.kv_lora_rank
    theirs = small.state_dict()
    with torch.no_grad():
        for name, param in wide.state_dict().items():
            src = theirs[name]
            if name.endswith("kv_a_proj_with_mqa.weight"):
                param.zero_()
                param[:r] = src[:r]
                param[big:] = src[r:]
            elif name.endswith("kv_a_layernorm.weight"):
                param.zero_()
                param[:r] = src * math.sqrt(r / big)
            elif name.endswith("kv_b_proj.weight"):
                param.zero_()
                param[:, :r] = src
            else:
                param.copy_(src)


def train(model: Any, examples: Sequence[Example], spec: TrainSpec, pad_id: int) -> float:
    """Train ``model`` in place; return the last logged loss."""
    import torch

    torch.manual_seed(spec.seed)
    torch.set_num_threads(spec.threads)
    order = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.98)
    )
    model.train()
    start, loss_value, pool = time.monotonic(), float("nan"), list(examples)
    for step in range(spec.steps):
        batch = order.sample(pool, spec.batch_size)
        ids, labels = _batch(batch, pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = completion_loss(model, ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == spec.steps - 1:
            loss_value = float(loss.detach())
            log.info(
                "step %d/%d loss %.4f (%.0fs)",
                step,
                spec.steps,
                loss_value,
                time.monotonic() - start,
            )
    model.eval()
    return loss_value
