"""The fused MLA prefill attention against vLLM's own ``CPUSDPAMLAPrefillBackend._ragged_sdpa``.

Both run on the same random ragged batches through vLLM's real backend class: its
``run_prefill_new_tokens`` (causal, queries and keys the same rows) and
``run_prefill_context_chunk`` (not causal, with the LSE), requests of 1 to 4,000 tokens, empty
ranges, fp32 and bf16. A last test checks what MLA builds from the two: new tokens that follow a
cached context, merged by vLLM's ``merge_attn_states``, equal dense attention whose causal mask is
offset by the context (the queries are a suffix of the keys).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pcp_nixl_connector.cpu_compat import mla_prefill, upstream_gate

pytestmark = pytest.mark.vllm

QK, V = 192, 128  # DeepSeek-V2's MLA prefill head sizes (128 nope + 64 rope; v 128)


@pytest.fixture
def backend_cls(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """vLLM's CPU MLA prefill backend, its ``_ragged_sdpa`` restored after the test."""
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    monkeypatch.setattr(
        CPUSDPAMLAPrefillBackend, "_ragged_sdpa", vllms_own(CPUSDPAMLAPrefillBackend)
    )
    yield CPUSDPAMLAPrefillBackend


def vllms_own(backend_cls: type) -> Any:
    """vLLM's function, whether or not the fix is on the class now."""
    method = backend_cls._ragged_sdpa
    return getattr(method, "__wrapped__", method)


def backend(backend_cls: type, heads: int) -> Any:
    return backend_cls(
        num_heads=heads, scale=1 / math.sqrt(QK), kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=V, vllm_config=None,
    )  # fmt: skip


def cu(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def qkv(
    q_tokens: int, kv_tokens: int, heads: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(q_tokens, heads, QK, generator=gen).to(dtype),
        torch.randn(kv_tokens, heads, QK, generator=gen).to(dtype),
        torch.randn(kv_tokens, heads, V, generator=gen).to(dtype),
    )


def both(backend_cls: type, run: Any) -> tuple[Any, Any]:
    """``run(instance)`` with vLLM's function on the class, then with the fused one."""
    stock = vllms_own(backend_cls)
    backend_cls._ragged_sdpa = stock
    want = run()
    assert mla_prefill.install(backend_cls, vllm_version="0.32.0") is True
    assert backend_cls._ragged_sdpa is not stock
    return want, run()


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride()  # merge_attn_states needs the head strides to agree
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


NEW_TOKENS = [
    pytest.param([1], 16, id="one-token"),
    pytest.param([7, 1, 33, 250], 16, id="small-ragged"),
    pytest.param([1000, 17, 600], 8, id="long-ragged"),
    pytest.param([4000, 3], 2, id="4k"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "heads"), NEW_TOKENS)
def test_new_tokens_equal_vllms_causal_attention(
    backend_cls: type, lengths: list[int], heads: int, dtype: torch.dtype
) -> None:
    q, k, v = qkv(sum(lengths), sum(lengths), heads, dtype, seed=sum(lengths))
    impl = backend(backend_cls, heads)
    impl.prepare_metadata(SimpleNamespace(query_start_loc=cu(lengths)))
    want, got = both(backend_cls, lambda: impl.run_prefill_new_tokens(q, k, v, False))
    assert_close(got, want, dtype)
    backend_cls._ragged_sdpa = vllms_own(backend_cls)
    want, got = both(backend_cls, lambda: impl.run_prefill_new_tokens(q, k, v, True))
    assert_close(got[0], want[0], dtype)
    assert_close(got[1], want[1], torch.float32)


CONTEXT = [
    pytest.param([5, 1, 40], [100, 7, 3], id="ragged"),
    pytest.param([300, 2], [2000, 0], id="a-request-without-context-in-this-chunk"),
    pytest.param([0, 9], [16, 64], id="a-request-without-queries"),
    pytest.param([64], [4000], id="4k-context"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lengths", "kv_lengths"), CONTEXT)
def test_context_chunks_equal_vllms_attention_and_lse(
    backend_cls: type, q_lengths: list[int], kv_lengths: list[int], dtype: torch.dtype
) -> None:
    heads = 4
    q, k, v = qkv(sum(q_lengths), sum(kv_lengths), heads, dtype, seed=sum(kv_lengths))
    chunk = SimpleNamespace(query_start_loc=cu(q_lengths), cu_seq_lens=cu(kv_lengths))
    impl = backend(backend_cls, heads)
    want, got = both(backend_cls, lambda: impl.run_prefill_context_chunk(chunk, q, k, v))
    assert_close(got[0], want[0], dtype)
    assert_close(got[1], want[1], torch.float32)
    if 0 in kv_lengths:  # no keys: zeros and -inf, as the dense code gives
        empty = q_lengths[kv_lengths.index(0)]
        assert bool(torch.isneginf(got[1][:, -empty:]).all())


def dense_suffix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Reference: the last Sq of Sk positions attend causally, row i to keys 0..Sk-Sq+i."""
    sq, sk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_new_tokens_after_a_cached_context_equal_attention_offset_by_the_context(
    backend_cls: type,
) -> None:
    """MLA's path for a prompt whose first blocks were cached: the new tokens causally among
    themselves, the context without a mask, merged by LSE (vLLM's merge_attn_states)."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    heads, scale, contexts, news = 4, 1 / math.sqrt(QK), [48, 500], [16, 300]
    q, k_new, v_new = qkv(sum(news), sum(news), heads, torch.float32, seed=1)
    _, k_ctx, v_ctx = qkv(0, sum(contexts), heads, torch.float32, seed=2)
    assert mla_prefill.install(backend_cls, vllm_version="0.32.0") is True
    impl = backend(backend_cls, heads)
    impl.prepare_metadata(SimpleNamespace(query_start_loc=cu(news)))
    suffix, suffix_lse = impl.run_prefill_new_tokens(q, k_new, v_new, True)
    chunk = SimpleNamespace(query_start_loc=cu(news), cu_seq_lens=cu(contexts))
    prefix, prefix_lse = impl.run_prefill_context_chunk(chunk, q, k_ctx, v_ctx)
    merged = torch.empty_like(suffix)
    merge_attn_states(merged, prefix, prefix_lse, suffix, suffix_lse)
    q_at, ctx_at = cu(news).tolist(), cu(contexts).tolist()
    for r in range(len(news)):
        rows, ctx = slice(q_at[r], q_at[r + 1]), slice(ctx_at[r], ctx_at[r + 1])
        keys = torch.cat([k_ctx[ctx], k_new[rows]])
        values = torch.cat([v_ctx[ctx], v_new[rows]])
        want = dense_suffix_attention(q[rows], keys, values, scale)
        torch.testing.assert_close(merged[rows], want, atol=1e-5, rtol=1e-5)


def test_installs_once_and_refuses_an_unchecked_vllm(backend_cls: type) -> None:
    stock = backend_cls._ragged_sdpa
    with pytest.raises(upstream_gate.UpstreamGateError, match="dense per-request attention"):
        mla_prefill.install(backend_cls, vllm_version="0.34.0")
    assert backend_cls._ragged_sdpa is stock and not mla_prefill.installed(backend_cls)
    assert mla_prefill.install(backend_cls, vllm_version="0.32.0+cpu") is True
    assert mla_prefill.install(backend_cls, vllm_version="0.32.0") is False
    assert mla_prefill.installed(backend_cls)
    assert backend_cls._ragged_sdpa.__wrapped__ is stock


def test_mismatched_request_counts_are_refused() -> None:
    q, k, v = qkv(4, 4, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="2 query ranges but 1 key ranges"):
        mla_prefill.ragged_attention(
            q, k, v, cu([2, 2]), cu([4]), scale=1.0, causal=False, return_softmax_lse=False
        )
