"""`pcp-pd-kit bench KIND`: a kind is a module (or a namespace in one, `module:NAME`) with HELP,
add_arguments(parser), check(args) -> a problem or None (before anything starts or is written; it
may raise the stack's user errors, a busy port) and run(args, out_dir) -> results.Outcome."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from pcp_pd_kit.bench import results

KINDS: dict[str, str] = {
    "serve": "pcp_pd_kit.bench.serve", "local-prefill": "pcp_pd_kit.bench.serve:LOCAL_PREFILL",
    "proxy": "pcp_pd_kit.bench.proxy", "connector": "pcp_pd_kit.bench.connector",
    "prefill": "pcp_pd_kit.bench.prefill_ep", "tokenize": "pcp_pd_kit.bench.tokenize_cost",
    "prefill-profile": "pcp_pd_kit.bench.prefill_profile",
    "xpyd": "pcp_pd_kit.bench.xpyd", "cache": "pcp_pd_kit.bench.cache",
    "prefix-ttft": "pcp_pd_kit.bench.prefix_ttft", "overload": "pcp_pd_kit.bench.overload",
    "scale": "pcp_pd_kit.bench.scale",
}  # fmt: skip


class BenchUsageError(ValueError):
    """A bad option of a kind, found before anything starts or is written."""


def add_flags(parser: Any, flags: Sequence[tuple[Any, ...]]) -> None:
    """A kind's options, one (flag, type, default, help[, {other add_argument keywords}]) each."""
    for flag, kind, default, text, *more in flags:
        parser.add_argument(flag, type=kind, default=default, help=text, **dict(*more))


def module(kind: str) -> Any:
    """The kind's module, or a namespace of the same four names in one (`module:NAME`)."""
    name, _, attr = KINDS[kind].partition(":")
    found = importlib.import_module(name)
    return getattr(found, attr) if attr else found


def add_kind_parsers(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind in KINDS:
        mod = module(kind)
        p = sub.add_parser(kind, help=mod.HELP, description=mod.__doc__)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        mod.add_arguments(p)
        add_flags(p, [
            ("--results-dir", str, None, "where <kind>-<UTC time>/ is created (default "
             "<repo>/results)"),
            ("--summary-dir", str, None, "also write the run's summary as DIR/<kind>-<UTC "
             "time>.{json,md} (docs/results: to commit it with the figures it backs)"),
        ])  # fmt: skip


def run_kind(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """check, make the run folder, run, write the layout, print the table: the exit status."""
    mod = module(args.kind)
    if problem := mod.check(args):
        raise BenchUsageError(f"bench {args.kind}: {problem}")
    started = results.utc_stamp()
    out = results.run_dir(args.kind, args.results_dir, started)
    logging.getLogger("pcp_pd_kit.bench").info("results go to %s", out)
    manifest = results.base_manifest(args.kind, started, argv)
    wall = time.monotonic()
    outcome = mod.run(args, out)
    manifest.update(outcome.manifest)
    manifest["load_average"]["end"] = results.load_average()
    manifest["wall_s"] = round(time.monotonic() - wall, 1)
    results.write_run(out, outcome, manifest, args.summary_dir)
    print(outcome.table)
    print(f"\nresults: {out} (wall time {manifest['wall_s']:.0f}s)", file=sys.stderr)
    return int(outcome.rc)
