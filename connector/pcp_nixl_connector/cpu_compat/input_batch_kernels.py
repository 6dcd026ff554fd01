"""Model Runner V2's per-step input kernels (``vllm.v1.worker.gpu.input_batch``) in torch.

After the first four kernels moved to torch (``native_kernels``), py-spy on the PCP2 + EP2
prefill's rank 0 at ~1,000-token prompts still found 14% of its busy samples in Triton's
interpreter, spread evenly over five kernels that every step launches once: positions and
sequence lengths, the prefill's input ids, the logits indices (with the last sampled token),
the sampled/rejected counts, and the post-step update of the request state. Each function here
is the body of one of them: it takes the launch's grid and the kernel's own arguments, in the
kernel's order, and writes the same buffers with the same values. vLLM's Python wrappers stay
as they are; only the kernel object they launch is replaced (``native_kernels.TorchKernel``).

A body returns False, having written nothing, for a case it leaves to vLLM's kernel: only
speculative decoding's draft tokens today, which the CPU stack does not run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Body = Callable[..., bool]


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views as the kernels see them: one element per pointer step (vLLM's
    ``last_sampled_tokens`` is ``[max_num_reqs, 1]``, indexed ``ptr + req``)."""
    return [tensor.view(-1) for tensor in tensors]


def _runs(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive runs of ``lens[i]`` items: each item's run and its offset in the run."""
    total = int(lens.sum()) if lens.numel() else 0
    run = torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=total)
    offset = torch.arange(total) - (torch.cumsum(lens, 0) - lens)[run]
    return run, offset


def prepare_pos_seq_lens(
    grid: tuple[int, ...], pos: torch.Tensor, seq_lens: torch.Tensor,
    idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor, max_num_reqs: int, **_constexprs: Any,
) -> bool:  # fmt: skip
    """Each request's positions (computed tokens onwards) and sequence length; the lengths of
    the rows past the batch zeroed (the kernel's extra last program)."""
    num_reqs = grid[0] - 1
    bounds = query_start_loc[: num_reqs + 1].long()
    lens = bounds[1:] - bounds[:-1]
    computed = num_computed_tokens[idx_mapping[:num_reqs].long()].long()
    seq_lens[:num_reqs] = computed + lens
    seq_lens[num_reqs:max_num_reqs] = 0
    run, offset = _runs(lens)
    pos[bounds[:-1][run] + offset] = computed[run] + offset
    return True


def prepare_prefill_inputs(
    grid: tuple[int, ...], input_ids: torch.Tensor, next_prefill_tokens: torch.Tensor,
    _next_stride: int, num_lookahead: int, idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor, all_token_ids: torch.Tensor, _all_stride: int,
    prefill_lens: torch.Tensor, num_computed_tokens: torch.Tensor, **_constexprs: Any,
) -> bool:  # fmt: skip
    """For each request still in its prompt: its next query tokens as input ids, and the
    ``num_lookahead`` prompt tokens after them (0 past the prompt's end)."""
    num_reqs = grid[0]
    req = idx_mapping[:num_reqs].long()
    computed = num_computed_tokens[req].long()
    prompt_len = prefill_lens[req].long()
    bounds = query_start_loc[: num_reqs + 1].long()
    starts, lens = bounds[:-1], bounds[1:] - bounds[:-1]
    prefilling = computed < prompt_len
    req, computed, prompt_len = req[prefilling], computed[prefilling], prompt_len[prefilling]
    starts, lens = starts[prefilling], lens[prefilling]
    run, offset = _runs(lens)
    input_ids[starts[run] + offset] = all_token_ids[req[run], computed[run] + offset].to(
        input_ids.dtype
    )
    if num_lookahead and req.numel():
        ahead = torch.arange(num_lookahead)
        at = (computed + lens).unsqueeze(1) + ahead
        inside = at < prompt_len.unsqueeze(1)
        rows = req.unsqueeze(1).expand_as(at)
        tokens = all_token_ids[rows, torch.where(inside, at, 0)]
        next_prefill_tokens[ahead.expand_as(at), rows] = torch.where(inside, tokens, 0).to(
            next_prefill_tokens.dtype
        )
    return True


def combine_sampled_and_draft_tokens(
    grid: tuple[int, ...], input_ids: torch.Tensor, idx_mapping: torch.Tensor,
    last_sampled_tokens: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    prefill_len: torch.Tensor, _draft_tokens: torch.Tensor, _draft_stride: int,
    cu_num_logits: torch.Tensor, logits_indices: torch.Tensor, *, BLOCK_SIZE: int,
    NUM_NEW_SAMPLED_TOKENS: int = 1, **_constexprs: Any,
) -> bool:  # fmt: skip
    """The logits indices (each request's last ``num_logits`` query tokens), and the last
    sampled token as the input of a request past its prompt. Draft tokens: vLLM's kernel."""
    num_reqs = grid[0]
    input_ids, last_sampled_tokens, logits_indices = _flat(
        input_ids, last_sampled_tokens, logits_indices
    )
    req = idx_mapping[:num_reqs].long()
    cu = cu_num_logits[: num_reqs + 1].long()
    num_logits = cu[1:] - cu[:-1]
    ends = query_start_loc[1 : num_reqs + 1].long()
    seq = seq_lens[:num_reqs].long()
    prompt_len = prefill_len[req].long()
    generating = seq > prompt_len
    if bool((generating & (num_logits > NUM_NEW_SAMPLED_TOKENS)).any()):
        return False
    run, offset = _runs(num_logits.clamp(max=BLOCK_SIZE))  # the kernel's one block per request
    logits_indices[cu[:-1][run] + offset] = (ends - num_logits)[run] + offset
    if NUM_NEW_SAMPLED_TOKENS > 0:
        fed = generating & (seq - num_logits >= prompt_len)
        input_ids[(ends - num_logits)[fed]] = last_sampled_tokens[req[fed]].to(input_ids.dtype)
    return True


def get_num_sampled_and_rejected(
    grid: tuple[int, ...], num_sampled: torch.Tensor, num_rejected: torch.Tensor,
    seq_lens: torch.Tensor, cu_num_logits: torch.Tensor, idx_mapping: torch.Tensor,
    prefill_len: torch.Tensor, **_constexprs: Any,
) -> bool:  # fmt: skip
    """A request in a prompt chunk samples and rejects nothing; otherwise its logits that were
    not sampled count as rejected."""
    num_reqs = grid[0]
    chunked = seq_lens[:num_reqs] < prefill_len[idx_mapping[:num_reqs].long()]
    sampled = torch.where(chunked, 0, num_sampled[:num_reqs])
    num_sampled[:num_reqs] = sampled
    cu = cu_num_logits[: num_reqs + 1]
    num_rejected[:num_reqs] = torch.where(chunked, 0, cu[1:] - cu[:-1] - sampled)
    return True


def post_update(
    grid: tuple[int, ...], idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor,
    last_sampled_tokens: torch.Tensor, output_bin_counts: torch.Tensor | None,
    _bin_stride: int, sampled_tokens: torch.Tensor, _sampled_stride: int,
    num_sampled: torch.Tensor, num_rejected: torch.Tensor,
    query_start_loc: torch.Tensor | None, all_token_ids: torch.Tensor, _all_stride: int,
    total_len: torch.Tensor, **_launch: Any,
) -> bool:  # fmt: skip
    """After a step, for each request (rows mapped to -1 skipped): append its sampled tokens
    (and count them per token id), note the last one, and advance its computed tokens by the
    query less the rejected tokens."""
    num_reqs = grid[0]
    last_sampled_tokens, num_computed_tokens, total_len = _flat(
        last_sampled_tokens, num_computed_tokens, total_len
    )
    rows = (idx_mapping[:num_reqs] >= 0).nonzero().squeeze(1)
    req = idx_mapping[rows].long()
    count = num_sampled[rows].long()
    length = total_len[req].long()
    some = count > 0
    if bool(some.any()):
        rows_s, req_s, count_s, length_s = rows[some], req[some], count[some], length[some]
        last_sampled_tokens[req_s] = sampled_tokens[rows_s, count_s - 1].to(
            last_sampled_tokens.dtype
        )
        run, offset = _runs(count_s)
        tokens = sampled_tokens[rows_s[run], offset]
        all_token_ids[req_s[run], length_s[run] + offset] = tokens.to(all_token_ids.dtype)
        if output_bin_counts is not None:
            ones = torch.ones(tokens.numel(), dtype=output_bin_counts.dtype)
            output_bin_counts.index_put_((req_s[run], tokens.long()), ones, accumulate=True)
        total_len[req_s] = (length_s + count_s).to(total_len.dtype)
    if query_start_loc is None:
        query_len = torch.zeros_like(rows)
    else:
        query_len = (query_start_loc[rows + 1] - query_start_loc[rows]).long()
    delta = query_len - num_rejected[rows].long()
    num_computed_tokens.index_add_(0, req, delta.to(num_computed_tokens.dtype))
    return True


#: ``input_batch``'s kernel name -> its body.
BODIES: dict[str, Body] = {
    "_prepare_pos_seq_lens_kernel": prepare_pos_seq_lens,
    "_prepare_prefill_inputs_kernel": prepare_prefill_inputs,
    "_combine_sampled_and_draft_tokens_kernel": combine_sampled_and_draft_tokens,
    "_get_num_sampled_and_rejected_kernel": get_num_sampled_and_rejected,
    "_post_update_kernel": post_update,
}
