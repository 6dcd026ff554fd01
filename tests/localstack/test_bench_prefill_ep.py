"""`pcp-pd-kit bench prefill`'s pure parts: prompts, the version check, the table."""

from __future__ import annotations

import pytest

from pcp_pd_kit.bench import prefill_ep as bench


def test_prompts_have_the_exact_length_and_differ_by_seed() -> None:
    a, b = bench.prompt_ids(250, 0), bench.prompt_ids(250, 1)
    assert len(a) == 250 and a != b and a == bench.prompt_ids(250, 0)
    assert min(a) >= 0 and max(a) < 2048


def test_the_version_check_tells_the_columns_apart() -> None:
    current = f"... pcp_nixl_connector CPU fix: {bench.CURRENT_FIX_LINE} (CPUExpertsFp8)"
    bench.check_version(current, True, "after")
    bench.check_version("an older server's log", False, "before")
    with pytest.raises(RuntimeError, match="before: the prefill log has"):
        bench.check_version(current, False, "before")
    with pytest.raises(RuntimeError, match="after: the prefill log lacks"):
        bench.check_version("an older server's log", True, "after")


def test_table_pairs_before_and_after_per_length() -> None:
    results = {
        ("0", "before"): {250: 100.04, 1000: 400.0},
        ("0", "after"): {250: 140.0, 1000: 400.0},
        ("0,1", "before"): {250: 130.0, 1000: 260.0},
        ("0,1", "after"): {250: 120.0, 1000: 250.0},
    }
    table = bench.format_table(results, ["0", "0,1"], ["before", "after"], [250, 1000], 2)
    assert table.splitlines() == [
        "| placement | 250 tokens, before | 250 tokens, after | 1000 tokens, before "
        "| 1000 tokens, after |",
        "|---|---|---|---|---|",
        "| both ranks on core 0 | 100.0 ms | 140.0 ms | 400.0 ms | 400.0 ms |",
        "| ranks on cores 0 and 1 | 130.0 ms | 120.0 ms | 260.0 ms | 250.0 ms |",
    ]
