"""The follow-up-turn TTFT bench's pure parts (the live figures are in docs/cpu.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pcp_pd_kit.bench import prefix_ttft
from pcp_pd_kit.bench.prefix_ttft import request_body, summarize, token_ids


def test_prompts_are_seeded_token_ids_past_the_special_tokens() -> None:
    ids = token_ids(3, 500)
    assert ids == token_ids(3, 500) and ids != token_ids(4, 500)
    assert min(ids) >= 10 and len(ids) == 500


def test_only_the_uncached_request_carries_a_salt() -> None:
    plain, salted = request_body("m", [11, 12], None), request_body("m", [11, 12], "s1")
    assert "cache_salt" not in plain and salted["cache_salt"] == "s1"
    assert plain["stream"] is True and plain["max_tokens"] == 1 and plain["prompt"] == [11, 12]


def test_summary_is_medians_and_their_ratio() -> None:
    summary = summarize([0.04, 0.03, 0.05], [0.30, 0.29, 0.90])
    assert (summary.cached_ms, summary.uncached_ms, summary.rounds) == (40.0, 300.0, 3)
    assert summary.ratio == pytest.approx(7.5)
    assert "cached 40.0 ms, uncached 300.0 ms, uncached/cached 7.5x" in summary.line(1440, 40)
    with pytest.raises(ValueError, match="same number"):
        summarize([0.1], [])


def test_the_kind_prints_one_markdown_row_of_medians(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = []

    def fake_rounds(*args: object) -> prefix_ttft.Summary:
        calls.append(args)
        return summarize([0.04, 0.03, 0.05], [0.30, 0.29, 0.90])

    monkeypatch.setattr(prefix_ttft, "run_rounds", fake_rounds)
    parser = argparse.ArgumentParser()
    prefix_ttft.add_arguments(parser)
    args = parser.parse_args(["--url", "http://h:1/", "--rounds", "3"])
    outcome = prefix_ttft.run(args, tmp_path)
    assert calls == [("http://h:1", "tiny-mla-moe", 1440, 40, 3, 7000)]
    assert "| 1440 cached + 40 new tokens, c=1 | 40.0 | 300.0 | 7.5x | 3 |" in outcome.table
    assert outcome.result["ratio"] == pytest.approx(7.5)
