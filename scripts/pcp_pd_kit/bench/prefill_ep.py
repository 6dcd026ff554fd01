"""Prefill latency of the CPU PCP2 + EP2 prefill server, before and after a connector change: the
prefill server alone per core placement and connector version, one request at a time (`max_tokens`
1, fixed token counts), median ms side by side. "before" runs `connector/` of ``--before REF`` (`git
archive`, first on PYTHONPATH); each server's log must show which EP fix it loaded.

    pcp-pd-kit bench prefill --before d68f419 --placements 0 0,1 --lengths 250 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pcp_nixl_connector.cpu_compat.plugin import FUSED_MLA_PREFILL
from pcp_pd_kit import repo_root
from pcp_pd_kit.bench.client import http
from pcp_pd_kit.bench.prefix_ttft import token_ids
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.bench.tables import markdown_table
from pcp_pd_kit.localstack.commands import ProcessSpec
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import StackSettings, kit_env, settings_from_env

HELP = "prefill latency of the CPU PCP2 + EP2 prefill server, connector/ before vs after"
REPO = repo_root()
# A line only the newest CPU fix logs (cpu_compat/plugin.py), to tell the two servers apart.
CURRENT_FIX_LINE = FUSED_MLA_PREFILL
WARMUP = 2


class ConnectorStack(Stack):
    """The local stack, with the servers' plugins and connector from another folder."""

    def __init__(self, settings: StackSettings, connector_dir: Path, work_dir: Path) -> None:
        super().__init__(settings, parts=("prefill",), work_dir=work_dir)
        self.connector_dir = connector_dir

    def _spec(self, part: str, settings: StackSettings | None = None) -> ProcessSpec:
        spec = super()._spec(part, settings)
        return dataclasses.replace(spec, env={**spec.env, "PYTHONPATH": str(self.connector_dir)})


def export_connector(ref: str, into: Path) -> Path:
    """``connector/`` as it is at git revision ``ref``, unpacked under ``into``."""
    archive = into / "connector.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", archive, ref, "connector"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "connector"


def prompt_ids(length: int, seed: int) -> list[int]:
    """A prompt of exactly ``length`` token ids (no tokenizer round trip)."""
    return token_ids(seed, length, first=100)


def request_ms(url: str, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    answer = json.loads(http(f"{url}/v1/completions", None, body, timeout_s=300))
    took = (time.perf_counter() - start) * 1000
    if answer["usage"]["prompt_tokens"] != len(ids):
        raise RuntimeError(f"server saw {answer['usage']['prompt_tokens']} prompt tokens")
    return took


def measure(
    settings: StackSettings, connector_dir: Path, work_dir: Path, lengths: Sequence[int],
    repeats: int,
) -> tuple[dict[int, float], str]:  # fmt: skip
    """Median ms per length for one server, and its log (which fix it ran)."""
    with ConnectorStack(settings, connector_dir, work_dir) as stack:
        url, model = stack.urls["prefill"], stack.served_model_name
        medians = {}
        for length in lengths:
            for i in range(WARMUP):
                request_ms(url, model, prompt_ids(length, -1 - i))
            samples = [request_ms(url, model, prompt_ids(length, i)) for i in range(repeats)]
            medians[length] = statistics.median(samples)
        log = stack.processes["prefill"].log_path.read_text(errors="replace")
    return medians, log


def check_version(log: str, current: bool, label: str) -> None:
    if (CURRENT_FIX_LINE in log) != current:
        raise RuntimeError(
            f"{label}: the prefill log {'lacks' if current else 'has'} {CURRENT_FIX_LINE!r}: "
            "the server did not run the connector folder it was given"
        )


def placement_label(cpus: str, ranks: int) -> str:
    cores = cpus.split(",")
    if len(cores) == 1:
        return f"both ranks on core {cpus}" if ranks > 1 else f"core {cpus}"
    return f"ranks on cores {' and '.join(cores)}"


def format_table(
    results: dict[tuple[str, str], dict[int, float]], placements: Sequence[str],
    variants: Sequence[str], lengths: Sequence[int], ranks: int,
) -> str:  # fmt: skip
    """Markdown: one row per placement, a before/after column pair per prompt length."""
    head = ["placement"] + [f"{n} tokens, {v}" for n in lengths for v in variants]
    rows = [
        [placement_label(cpus, ranks)]
        + [f"{results[(cpus, v)][n]:.1f} ms" for n in lengths for v in variants]
        for cpus in placements
    ]
    return markdown_table(head, rows)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--before", help="git revision whose connector/ is the 'before' column")
    ap.add_argument("--placements", nargs="+", default=["0", "0,1"], help="PREFILL_CPUS values")
    ap.add_argument("--lengths", nargs="+", type=int, default=[250, 1000])
    ap.add_argument("--repeats", type=int, default=8, help="timed requests; the median is shown")


def check(args: argparse.Namespace) -> str | None:
    return "--repeats and --lengths must be >= 1" if min(args.repeats, *args.lengths) < 1 else None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    env = kit_env(os.environ, REPO)
    env.update({"CPU_PREFILL_PCP_SIZE": "2", "CPU_PREFILL_EXPERT_PARALLEL": "1"})
    variants = (["before"] if args.before else []) + ["after"]
    results: dict[tuple[str, str], dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefill-ep-") as tmp:
        dirs = {"after": REPO / "connector"}
        if args.before:
            dirs["before"] = export_connector(args.before, Path(tmp))
        for cpus in args.placements:
            settings = settings_from_env({**env, "PREFILL_CPUS": cpus})
            for variant in variants:
                label = f"PREFILL_CPUS={cpus} {variant}"
                print(f"measuring {label} ...", file=sys.stderr, flush=True)
                work = out / "servers" / f"{cpus.replace(',', '_')}-{variant}"
                medians, log = measure(settings, dirs[variant], work, args.lengths, args.repeats)
                check_version(log, variant == "after", label)
                results[(cpus, variant)] = medians
    ranks = int(env["CPU_PREFILL_PCP_SIZE"])
    title = (
        f"prefill, PCP{ranks} + EP{ranks}, median of {args.repeats} requests one at a time, "
        f"max_tokens 1 (before: connector/ at {args.before or '-'}; after: this checkout)"
    )
    table = title + "\n\n" + format_table(results, args.placements, variants, args.lengths, ranks)
    result = [
        {"placement": cpus, "variant": v, "median_ms": {str(n): ms for n, ms in medians.items()}}
        for (cpus, v), medians in results.items()
    ]
    used = {**knobs(args, "before", "placements", "lengths", "repeats"), "ranks": ranks}
    return Outcome(result, table, {"bench": used})
