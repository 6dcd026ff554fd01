"""`pcp-pd-kit bench KIND`: every benchmark of the kit behind one command.

Two kinds run vLLM's serving benchmark through the local stack or a running deployment (serve,
local-prefill: bench.runner); the others are modules with the same four names: HELP (one line),
add_arguments(parser), check(args) -> a problem or None, and run(args, out_dir) -> Outcome. All
of them write the one layout of bench.results under results/<kind>-<UTC time>/, and share the
flags added here.

To add a kind, write such a module and add one line to MODULE_KINDS.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from pcp_pd_kit.bench import manifest as manifest_mod
from pcp_pd_kit.bench import results

# kind -> module with HELP, add_arguments, check, run (see the module docstring).
MODULE_KINDS: dict[str, str] = {
    "proxy": "pcp_pd_kit.bench.proxy",
    "connector": "pcp_pd_kit.bench.connector",
    "prefill": "pcp_pd_kit.bench.prefill_ep",
    "tokenize": "pcp_pd_kit.bench.tokenize_http",
    "xpyd": "pcp_pd_kit.bench.xpyd",
    "cache": "pcp_pd_kit.bench.cache",
    "prefix-ttft": "pcp_pd_kit.bench.prefix_ttft",
}
# kind -> (help, default --targets) for vllm bench serve (bench.runner).
SERVE_KINDS: dict[str, tuple[str, str | None]] = {
    "serve": ("vllm bench serve: single vLLM vs P/D and its proxy variants (docs/bench.md)", None),
    "local-prefill": (
        "vllm bench serve with the short-prompt workload: single, P/D and P/D with "
        "--local-prefill-max-tokens",
        "single,pd,pd-local",
    ),
}
KINDS = (*SERVE_KINDS, *MODULE_KINDS)


class BenchUsageError(ValueError):
    """A bad option of a module kind, found before anything starts or is written."""


def _module(kind: str) -> ModuleType:
    return importlib.import_module(MODULE_KINDS[kind])


def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every kind takes."""
    parser.add_argument(
        "--results-dir",
        default=None,
        help="where <kind>-<UTC time>/ is created (default: <repo>/results)",
    )


def add_kind_parsers(bench: argparse.ArgumentParser) -> None:
    from pcp_pd_kit.bench.runner import add_arguments as add_serve_arguments

    sub = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, (text, targets) in SERVE_KINDS.items():
        p = sub.add_parser(kind, help=text, description=text)
        add_serve_arguments(p, default_targets=targets)
        add_shared_arguments(p)
    for kind in MODULE_KINDS:
        module = _module(kind)
        p = sub.add_parser(kind, help=module.HELP, description=module.__doc__)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        module.add_arguments(p)
        add_shared_arguments(p)


def run_module_kind(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """check, make the run folder, run, write the layout, print the table: the exit status."""
    module = _module(args.kind)
    problem = module.check(args)
    if problem:
        raise BenchUsageError(f"bench {args.kind}: {problem}")
    started = manifest_mod.utc_stamp()
    out = results.run_dir(args.kind, args.results_dir, started)
    logging.getLogger("pcp_pd_kit.bench").info("results go to %s", out)
    manifest: dict[str, Any] = results.base_manifest(args.kind, started, argv)
    outcome = module.run(args, out)
    manifest.update(outcome.manifest)
    results.write_run(out, outcome.result, outcome.table, manifest)
    print(outcome.table)
    print(f"\nresults: {out}", file=sys.stderr)
    return int(outcome.rc)
