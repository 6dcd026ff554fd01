"""Random cases for ``input_batch_kernels``, run by ``native_kernels_probe`` (under Triton's
interpreter): vLLM's wrapper from ``vllm.v1.worker.gpu.input_batch`` is called once with the
original kernel and once with the torch stand-in, on copies of the same buffers, and every
buffer is compared."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import torch

MAX_REQS = 8
MAX_LEN = 2000
VOCAB = 300


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def cumulative(lens: list[int]) -> torch.Tensor:
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    return int32(starts)


def run_both(name: str, originals: dict[str, Any], wrapper: Callable[..., Any], *args: Any,
             **kwargs: Any) -> bool:  # fmt: skip
    """Call vLLM's ``wrapper`` with the original kernel and with the stand-in, each on its own
    copy of ``args``; True when every tensor argument (and the return value) came out equal."""
    from vllm.v1.worker.gpu import input_batch

    stand_in = getattr(input_batch, name)
    runs = []
    for kernel in (originals[name], stand_in):
        setattr(input_batch, name, kernel)
        state = copy.deepcopy(args)
        runs.append((state, wrapper(*state, **kwargs)))
    setattr(input_batch, name, stand_in)
    (want, want_ret), (got, got_ret) = runs
    pairs = [(a, b) for a, b in zip(want, got, strict=True) if isinstance(a, torch.Tensor)]
    if isinstance(want_ret, torch.Tensor):
        pairs.append((want_ret, got_ret))
    elif isinstance(want_ret, tuple):
        pairs.extend(zip(want_ret, got_ret, strict=True))
    return all(torch.equal(a, b) for a, b in pairs)


def requests(rng: random.Random) -> tuple[list[int], list[int], list[int], list[int]]:
    """Request slots, prompt lengths, computed tokens and query lengths: some requests in
    their prompt (a chunk of it, or its end), some past it (one query token)."""
    slots = rng.sample(range(MAX_REQS), rng.randint(1, 6))
    prompts, computed, queries = [], [], []
    for _ in slots:
        prompt = rng.randint(1, 1500)
        kind = rng.random()
        if kind < 0.3:  # a chunk inside the prompt
            done = rng.randrange(prompt)
            query = rng.randint(1, min(prompt - done, 120))
        elif kind < 0.6:  # the prompt's last chunk: the lookahead runs past its end
            query = rng.randint(1, min(prompt, 120))
            done = prompt - query
        else:
            done = prompt + rng.randint(0, 300)
            query = 1
        prompts.append(prompt)
        computed.append(done)
        queries.append(query)
    return slots, prompts, computed, queries


def per_slot(slots: list[int], values: list[int], rng: random.Random) -> torch.Tensor:
    """A [MAX_REQS] state tensor holding ``values`` at ``slots`` and noise elsewhere."""
    state = [rng.randint(0, 1500) for _ in range(MAX_REQS)]
    for slot, value in zip(slots, values, strict=True):
        state[slot] = value
    return int32(state)


def cases(originals: dict[str, Any]) -> dict[str, bool]:
    from vllm.v1.worker.gpu import input_batch

    out: dict[str, bool] = {}
    for seed in range(8):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        slots, prompts, computed, queries = requests(rng)
        idx = int32(slots)
        qsl = cumulative(queries)
        tokens = int(qsl[-1])
        prompt_len = per_slot(slots, prompts, rng)
        done = per_slot(slots, computed, rng)
        seq_lens = int32([c + q for c, q in zip(computed, queries, strict=True)])
        all_ids = torch.randint(0, VOCAB, (MAX_REQS, MAX_LEN), dtype=torch.int32)

        pos = torch.randint(0, 9, (tokens + 5,))
        lens = torch.randint(0, 9, (MAX_REQS,), dtype=torch.int32)
        out[f"prepare_pos_seq_lens #{seed}"] = run_both(
            "_prepare_pos_seq_lens_kernel", originals, input_batch.prepare_pos_seq_lens,
            idx, qsl, done, pos, lens,
        )  # fmt: skip

        lookahead = 1 + seed % 3
        input_ids = torch.randint(0, 9, (tokens + 5,), dtype=torch.int32)
        ahead = torch.randint(0, 9, (lookahead, MAX_REQS), dtype=torch.int32)
        out[f"prepare_prefill_inputs lookahead {lookahead} #{seed}"] = run_both(
            "_prepare_prefill_inputs_kernel", originals, input_batch.prepare_prefill_inputs,
            input_ids, ahead, idx, qsl, all_ids, prompt_len, done,
        )  # fmt: skip

        steps, new = [(0, 1), (2, 1), (2, 0)][seed % 3]
        logits = [
            (1 if new else 0) + (rng.randint(0, steps) if c + q > p else 0)
            for c, q, p in zip(computed, queries, prompts, strict=True)
        ]
        logits = [min(n, q) for n, q in zip(logits, queries, strict=True)]
        cu_logits = cumulative(logits)
        drafts = torch.randint(0, VOCAB, (MAX_REQS, steps), dtype=torch.int32)
        last = torch.randint(0, VOCAB, (MAX_REQS, 1))  # vLLM's shape and dtype
        out[f"combine_sampled_and_draft_tokens steps {steps} new {new} #{seed}"] = run_both(
            "_combine_sampled_and_draft_tokens_kernel", originals,
            input_batch.combine_sampled_and_draft_tokens, input_ids, idx, last, qsl, seq_lens,
            prompt_len, drafts, cu_logits, int(cu_logits[-1]), num_new_sampled_tokens=new,
        )  # fmt: skip

        sampled = int32([rng.randint(0, n) for n in logits])
        out[f"get_num_sampled_and_rejected #{seed}"] = run_both(
            "_get_num_sampled_and_rejected_kernel", originals,
            input_batch.get_num_sampled_and_rejected, sampled, seq_lens, cu_logits, idx,
            prompt_len,
        )  # fmt: skip

        mapped = idx.clone()
        if seed % 4 == 1:
            mapped[-1] = -1
        width = steps + 1
        bins = None if seed % 2 else torch.randint(0, 3, (MAX_REQS, VOCAB), dtype=torch.int32)
        total = int32([rng.randint(0, MAX_LEN - width - 1) for _ in range(MAX_REQS)])
        samples = torch.randint(0, VOCAB, (len(slots), width), dtype=torch.int64)
        samples[0, :] = samples[0, 0]  # one request samples the same token twice: counted twice
        counts = int32([rng.randint(0, width) for _ in slots])
        rejected = int32([rng.randint(0, 2) for _ in slots])
        starts = None if seed % 3 == 2 else qsl
        out[f"post_update bins={bins is not None} #{seed}"] = run_both(
            "_post_update_kernel", originals, input_batch.post_update,
            mapped, done, last, bins, samples, counts, rejected, starts, all_ids, total,
        )  # fmt: skip
    return out
