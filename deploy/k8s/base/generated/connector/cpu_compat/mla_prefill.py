"""MLA prefill attention on CPU with PyTorch's fused flash attention instead of dense matrices.

vLLM's CPU MLA prefill backend (``CPUSDPAMLAPrefillBackend._ragged_sdpa``,
``vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py`` in 0.32.0) loops over the requests and, for
each, upcasts q, k and v to fp32, materialises the whole ``[heads, Sq, Sk]`` score matrix, builds a
causal mask with ``torch.ones(Sq, Sk).triu(1)``, and runs ``softmax``, ``matmul`` and a separate
``logsumexp`` over the full scores. On the kit's PCP2 + EP2 prefill that was 44% of rank 0's busy
time at ~1,000 tokens and 80% at ~2,600.

PyTorch ships a fused CPU flash attention that returns the log-sum-exp too
(``aten::_scaled_dot_product_flash_attention_for_cpu``): blocked, never holding the score matrix,
causal without a mask. Its ``is_causal`` aligns the mask to the top left, which is what vLLM's
``triu(1)`` does, so this is a drop-in for every call vLLM makes: new tokens (causal, queries and
keys the same rows) and context chunks (not causal; the LSE feeds ``merge_attn_states``, which is
how MLA attends from new tokens to the cached prefix they follow).

Two things the kernel does not do itself:
* one head size for q, k and v: MLA has qk 192 (128 + 64 rope) and v 128, so v is padded with
  zeros to q's width and the output sliced back (zero columns add nothing), as vLLM's GPU MLA does;
* empty rows: a request with no query rows or no key rows (a context chunk can hold none of a
  request's context) crashes the process with SIGFPE in torch 2.13, so those are answered here
  exactly as the dense code answers them (no rows; zeros and an LSE of -inf).

It keeps vLLM's numerics: fp32 inside, the output in v's dtype, the LSE in fp32 as ``[heads,
tokens]``. It installs only on the vLLM releases ``upstream_gate`` lists for it; the tests in
``tests/connector/test_mla_prefill_attention.py`` compare it with vLLM's own function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from . import upstream_gate

MARKER = "_pcp_nixl_cpu_fused_mla_prefill"

Result: TypeAlias = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _request_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q ``[Sq, H, Dqk]``, k ``[Sk, H, Dqk]``, v ``[Sk, H, Dv]`` -> (out
    ``[Sq, H, Dv]`` in fp32, lse ``[H, Sq]``)."""
    sq, heads, _ = q.shape
    sk, dv = k.shape[0], v.shape[-1]
    if sq == 0 or sk == 0:  # the kernel divides by these; the dense code's answer instead
        out = q.new_zeros((sq, heads, dv), dtype=torch.float32)
        return out, q.new_full((heads, sq), float("-inf"), dtype=torch.float32)
    width = max(q.shape[-1], dv)
    qs, ks, vs = (
        torch.nn.functional.pad(t.float(), (0, width - t.shape[-1])).transpose(0, 1).unsqueeze(0)
        for t in (q, k, v)
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qs, ks, vs, 0.0, causal, scale=scale
    )
    return out[0, :, :, :dv].transpose(0, 1), lse[0]


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    return_softmax_lse: bool,
) -> Result:
    """vLLM's ``_ragged_sdpa`` contract on the fused kernel: q/k/v ``[tokens, heads, dim]``,
    concatenated per request at the ``*_cu_seq_lens`` offsets; out ``[q tokens, heads, Dv]`` in
    v's dtype, and with ``return_softmax_lse`` the fp32 LSE ``[heads, q tokens]``."""
    q_bounds = q_cu_seq_lens.tolist()
    kv_bounds = kv_cu_seq_lens.tolist()
    if len(q_bounds) != len(kv_bounds):
        raise ValueError(f"{len(q_bounds) - 1} query ranges but {len(kv_bounds) - 1} key ranges")
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    for r in range(len(q_bounds) - 1):
        qr = q[q_bounds[r] : q_bounds[r + 1]]
        kv = slice(kv_bounds[r], kv_bounds[r + 1])
        out, lse = _request_attention(qr, k[kv], v[kv], scale, causal)
        outs.append(out)
        lses.append(lse)
    if outs:
        output = torch.cat(outs, dim=0).to(v.dtype)
        lse_all = torch.cat(lses, dim=1)
    else:
        output = v.new_zeros((0, q.shape[1], v.shape[-1]))
        lse_all = q.new_zeros((q.shape[1], 0), dtype=torch.float32)
    return (output, lse_all) if return_softmax_lse else output


def fused_ragged_sdpa(original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``_ragged_sdpa`` method on the fused kernel; ``__wrapped__`` keeps vLLM's own (the tests
    compare against it)."""

    def _ragged_sdpa(
        self: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor,
        causal: bool,
        return_softmax_lse: bool,
    ) -> Result:
        return ragged_attention(
            q, k, v, q_cu_seq_lens, kv_cu_seq_lens, scale=self.scale, causal=causal,
            return_softmax_lse=return_softmax_lse,
        )  # fmt: skip

    setattr(_ragged_sdpa, MARKER, True)
    _ragged_sdpa.__wrapped__ = original  # type: ignore[attr-defined]
    return _ragged_sdpa


def install(backend_cls: Any, vllm_version: str | None = None) -> bool:
    """Patch ``backend_cls._ragged_sdpa`` once; False when it already is. Refuses a vLLM the fix
    was not checked against (``upstream_gate``; default: the installed vLLM)."""
    upstream_gate.check(upstream_gate.MLA_PREFILL, vllm_version)
    current = backend_cls._ragged_sdpa
    if getattr(current, MARKER, False):
        return False
    backend_cls._ragged_sdpa = fused_ragged_sdpa(current)
    return True


def installed(backend_cls: Any) -> bool:
    return bool(getattr(backend_cls._ragged_sdpa, MARKER, False))
