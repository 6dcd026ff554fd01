"""bench xpyd's pure parts: each topology's `bench serve` command."""

from __future__ import annotations

import argparse
from pathlib import Path

from pcp_pd_kit.bench.xpyd import serve_argv


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_topology_sends_prompts_of_its_own() -> None:
    # The decode keeps its prefix cache from 1P1D to 2P1D: the same prompts would be answered
    # from it (0 prefills on the new replicas, a TTFT a third of 1P1D's, seen once).
    args = argparse.Namespace(concurrency="1,8", prompts=48, input_len=1000, output_len=4)
    one, two = (serve_argv("http://p", Path("/k"), args, Path("/o"), r) for r in (1, 2))
    assert _flag(one, "--seed") != _flag(two, "--seed")
    assert [_flag(one, f) for f in ("--concurrency", "--prompts", "--input-len")] == [
        "1,8",
        "48",
        "1000",
    ]
    assert one[: one.index("--seed")] == two[: two.index("--seed")]
