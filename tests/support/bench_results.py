"""A `vllm bench serve --save-result` file's figures, built for the bench's table tests."""

from __future__ import annotations

from typing import Any


def bench_result(
    ttft: float, tput: float = 1.0, completed: int = 4, failed: int = 0
) -> dict[str, Any]:
    """One run's result keys as vLLM writes them, derived from a median TTFT and a throughput."""
    return {
        "completed": completed,
        "failed": failed,
        "median_ttft_ms": ttft,
        "mean_ttft_ms": ttft + 1,
        "p99_ttft_ms": ttft * 2,
        "median_tpot_ms": 5.0,
        "median_itl_ms": 5.0,
        "median_e2el_ms": ttft + 100,
        "request_throughput": tput,
        "output_throughput": tput * 16,
    }
