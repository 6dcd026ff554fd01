"""`pcp-pd-kit bench xpyd`'s pure part: the 1P1D / 2P1D table (live: `make bench-xpyd`)."""

from __future__ import annotations

from pcp_pd_kit.bench import xpyd as bench


def run(ttft: float, rps: float) -> dict[str, float]:
    return {"median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_e2el_ms": ttft + 5,
            "request_throughput": rps}  # fmt: skip


def test_the_table_puts_the_topologies_side_by_side_with_the_ratio() -> None:
    text = bench.table({1: {8: run(400.0, 2.0)}, 2: {8: run(300.0, 3.0)}}, {2: [20.0, 28.0]})
    assert "| 8 | TTFT p50 ms | 400.0 | 300.0 | 0.75x |" in text
    assert "| 8 | req/s | 2.0 | 3.0 | 1.50x |" in text
    assert "prefills per replica, 2P1D: [20, 28]" in text


def test_a_topology_that_did_not_run_is_not_a_ratio() -> None:
    text = bench.table({1: {8: run(400.0, 2.0)}}, {})
    assert "| 8 | TTFT p50 ms | 400.0 | n/a | n/a |" in text
