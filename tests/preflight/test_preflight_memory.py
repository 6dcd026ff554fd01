"""The pure memory arithmetic on the GPUs the kit meets: DeepSeek-V2-Lite(-Chat) in bf16 on
A100-80GB, H100-80GB, H200-141GB and L40S-48GB (MiB as nvidia-smi reports them)."""

from __future__ import annotations

import re

import pytest

from pcp_pd_kit.preflight import memory, weights
from tests.support.paths import DOCS_DIR

A100_MIB, H100_MIB, H200_MIB, L40S_MIB, L4_MIB = 81920, 81559, 143771, 46068, 23034


@pytest.fixture(scope="module")
def dsv2() -> weights.ModelSize:
    size = weights.from_table("deepseek-ai/DeepSeek-V2-Lite-Chat")
    assert size is not None
    return size


def decode_need(size: weights.ModelSize, tp: int = 1, max_len: int = 4096) -> memory.Need:
    rank = memory.weights_per_rank(size.total_params, size.expert_params, size.bytes_per_param,
                                   tp, tp)  # fmt: skip
    return memory.need(rank, memory.kv_reserve(size.kv_bytes_per_token, max_len))


def prefill_need(size: weights.ModelSize, tp: int = 1, pcp: int = 2) -> memory.Need:
    rank = memory.weights_per_rank(size.total_params, size.expert_params, size.bytes_per_param,
                                   tp, tp * pcp)  # fmt: skip
    return memory.need(rank, memory.kv_reserve(size.kv_bytes_per_token, 4096))


def test_decode_holds_all_weights(dsv2: weights.ModelSize) -> None:
    need = decode_need(dsv2)
    assert need.weights == dsv2.total_params * 2
    assert need.describe() == "31.4 GB of weights + 3 GiB runtime + 4 GiB KV"


def test_prefill_splits_only_the_routed_experts(dsv2: weights.ModelSize) -> None:
    need = prefill_need(dsv2)
    replicated = (dsv2.total_params - dsv2.expert_params) * 2
    assert need.weights == replicated + dsv2.expert_params  # experts x 2 bytes / 2 ranks
    assert round(need.weights / memory.GB, 1) == 17.0


@pytest.mark.parametrize(
    ("gpu_mib", "fraction", "fits", "least", "suggested"),
    [
        (A100_MIB, 0.30, False, 0.46, 0.50),
        (A100_MIB, 0.46, True, 0.46, 0.50),
        (H100_MIB, 0.30, False, 0.46, 0.50),
        (H100_MIB, 0.85, True, 0.46, 0.50),
        (H200_MIB, 0.30, True, 0.26, 0.30),
        (H200_MIB, 0.25, False, 0.26, 0.30),
        (L40S_MIB, 0.80, False, 0.81, 0.85),
        (L40S_MIB, 0.85, True, 0.81, 0.85),
    ],
)
def test_decode_tp1(dsv2, gpu_mib: int, fraction: float, fits: bool, least: float,
                    suggested: float) -> None:  # fmt: skip
    verdict = memory.judge(decode_need(dsv2).total, gpu_mib, fraction)
    assert verdict.fits is fits
    assert memory.ceil2(verdict.required) == least
    assert verdict.suggested == suggested


@pytest.mark.parametrize(
    ("gpu_mib", "least", "suggested"),
    [
        (A100_MIB, 0.29, 0.30),
        (H100_MIB, 0.29, 0.30),
        (H200_MIB, 0.17, 0.20),
        (L40S_MIB, 0.51, 0.55),
    ],
)
def test_prefill_tp1_pcp2(dsv2, gpu_mib: int, least: float, suggested: float) -> None:
    verdict = memory.judge(prefill_need(dsv2).total, gpu_mib, 0.85)
    assert verdict.fits
    assert (memory.ceil2(verdict.required), verdict.suggested) == (least, suggested)


def test_too_big_for_the_gpu_has_no_fraction(dsv2: weights.ModelSize) -> None:
    verdict = memory.judge(decode_need(dsv2).total, L4_MIB, 0.95)
    assert not verdict.fits and verdict.suggested is None and verdict.required > 1
    split = memory.judge(decode_need(dsv2, tp=2).total, L40S_MIB, 0.45)  # 15.7 GB per rank
    assert (split.fits, memory.ceil2(split.required), split.suggested) == (False, 0.49, 0.5)


def test_kv_reserve_grows_with_a_long_context(dsv2: weights.ModelSize) -> None:
    assert memory.kv_reserve(dsv2.kv_bytes_per_token, 4096) == 4 * memory.GIB
    long = memory.kv_reserve(dsv2.kv_bytes_per_token, 163840)
    assert long == dsv2.kv_bytes_per_token * 163840 > 4 * memory.GIB


@pytest.mark.parametrize(
    ("required", "suggested"),
    [(0.10, 0.10), (0.1000001, 0.15), (0.52, 0.55), (0.95, 0.95), (0.9501, None), (1.6, None)],
)
def test_suggest_rounds_up_to_a_step(required: float, suggested: float | None) -> None:
    assert memory.suggest(required) == suggested


def test_the_table_in_the_docs_matches_the_arithmetic(dsv2: weights.ModelSize) -> None:
    """docs/preflight.md's DeepSeek-V2-Lite-Chat table is what the code computes."""
    docs = (DOCS_DIR / "preflight.md").read_text()
    rows = re.findall(r"^\| \S+ \((\d+)\) \| ([^|]+) \| ([^|]+) \|$", docs, flags=re.M)
    assert len(rows) == 5
    for mib, decode_cell, prefill_cell in rows:
        for need, cell in ((decode_need(dsv2), decode_cell), (prefill_need(dsv2), prefill_cell)):
            verdict = memory.judge(need.total, int(mib), 1.0)
            least = f"{memory.ceil2(verdict.required):.2f}"
            if verdict.suggested is None:
                assert cell.strip() == f"{least}: does not fit"
            else:
                assert re.fullmatch(rf"{least} \((set )?{verdict.suggested:.2f}\)", cell.strip())
