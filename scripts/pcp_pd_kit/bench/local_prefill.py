"""`bench serve` with the short-prompt workload: single, P/D and P/D through a pd-proxy with
--local-prefill-max-tokens N (short prompts on decode alone, long ones P/D, back to back).

    pcp-pd-kit bench local-prefill --concurrency 1
"""

from __future__ import annotations

import argparse

from pcp_pd_kit.bench.serve import check, run

HELP = "vllm bench serve, short prompts: single, P/D and P/D with --local-prefill-max-tokens"
__all__ = ["HELP", "add_arguments", "check", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pcp_pd_kit.bench.serve import add_arguments as serve_arguments

    serve_arguments(parser, default_targets="single,pd,pd-local")
