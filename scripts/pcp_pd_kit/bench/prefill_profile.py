"""Where the CPU PCP2 + EP2 prefill's time goes: py-spy on its rank-0 worker while it serves prompts
one after another, the busy samples grouped by what they do (the fused or dense MLA attention,
Triton's interpreter, collectives and waits, the model, the rest), with ``--before REF``
beside another revision's ``connector/`` (as `bench prefill`). Needs py-spy (the dev extra).

    pcp-pd-kit bench prefill-profile --before 50fca72 --length 1000 --seconds 30
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

from pcp_pd_kit.bench import prefill_ep
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.bench.tables import markdown_table
from pcp_pd_kit.settings import StackSettings, kit_env, settings_from_env

HELP = "py-spy on the CPU PCP2 + EP2 prefill's rank 0: busy samples by function group"
WORKER = "VLLM::Worker_PCP0"  # the rank-0 worker's process title
# (group, substrings of a stack that put it there), first match wins: what a stack is *doing*
# at its innermost recognisable frame comes first (a wait inside a collective is a wait).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("waiting for the next step (vLLM's spin, or the kit's sleep)",
     ("SpinCondition.wait", "cpu_compat/idle_wait.py")),
    ("MLA prefill attention", ("_ragged_sdpa", "ragged_attention")),
    ("Triton interpreter", ("triton/runtime/interpreter",)),
    ("collectives (all-gather, reduce-scatter, all-reduce)",
     ("all_gather", "reduce_scatter", "all_reduce", "cpu_communicator")),
    ("the model's other layers (MoE, linear, rope, norms)", ("Module._call_impl", "forward")),
    ("the model runner, other", ("model_runner", "execute_model", "sample_tokens")),
)  # fmt: skip
OTHER = "other"


def group_of(stack: str) -> str:
    for group, needles in GROUPS:
        if any(needle in stack for needle in needles):
            return group
    return OTHER


def shares(lines: Iterable[str]) -> Counter[str]:
    """Samples per group from py-spy's raw output (``frame;frame;... count`` per line)."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            counts[group_of(stack)] += int(count)
    return counts


def format_table(by_variant: dict[str, Counter[str]]) -> str:
    """Markdown: a row per group, each variant's share of its busy samples and its count."""
    groups = [g for g, _ in GROUPS] + [OTHER]
    head = ["group"] + [f"{v} ({sum(c.values())} samples)" for v, c in by_variant.items()]
    rows = [
        [g] + [f"{c[g] / max(1, sum(c.values())):.0%}" for c in by_variant.values()] for g in groups
    ]
    return markdown_table(head, rows)


def rank0_pid(stack_pid: int) -> int:
    """The rank-0 worker among the server's descendants (its process title names it)."""
    for child in psutil.Process(stack_pid).children(recursive=True):
        try:
            if WORKER in " ".join(child.cmdline()) or WORKER in child.name():
                return int(child.pid)
        except psutil.Error:
            continue
    raise RuntimeError(f"no {WORKER} process under the prefill server (pid {stack_pid})")


def profile(
    settings: StackSettings, connector_dir: Path, work_dir: Path, length: int, seconds: float,
    rate: int, out_file: Path,
) -> tuple[Counter[str], int, float]:  # fmt: skip
    """Samples per group, requests served, their median ms, while py-spy records rank 0."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("py-spy is not installed: pip install -e '.[dev]' (it pins py-spy)")
    with prefill_ep.ConnectorStack(settings, connector_dir, work_dir) as stack:
        url, model = stack.urls["prefill"], stack.served_model_name
        for i in range(prefill_ep.WARMUP):
            prefill_ep.request_ms(url, model, prefill_ep.prompt_ids(length, -1 - i))
        popen = stack.processes["prefill"].popen
        assert popen is not None
        target = str(rank0_pid(popen.pid))
        argv = [spy, "record", "--nonblocking", "-r", str(rate), "-f", "raw", "-d",
                str(int(seconds)), "-p", target, "-o", str(out_file)]  # fmt: skip
        recorder = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            took: list[float] = []
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                ids = prefill_ep.prompt_ids(length, len(took))
                took.append(prefill_ep.request_ms(url, model, ids))
            recorder.wait(timeout=seconds + 60)
        finally:
            if recorder.poll() is None:
                recorder.kill()
    took.sort()
    return shares(out_file.read_text().splitlines()), len(took), took[len(took) // 2]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--before", help="git revision whose connector/ is profiled too")
    ap.add_argument("--placement", default="0,1", help="PREFILL_CPUS (%(default)s)")
    ap.add_argument("--length", type=int, default=1000, help="prompt tokens (%(default)s)")
    ap.add_argument("--seconds", type=float, default=30.0, help="recorded per variant")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")


def check(args: argparse.Namespace) -> str | None:
    if args.length < 1 or args.seconds <= 0 or args.rate < 1:
        return "--length, --seconds and --rate must be > 0"
    return None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    env = kit_env(os.environ, prefill_ep.REPO)
    env.update({"CPU_PREFILL_PCP_SIZE": "2", "CPU_PREFILL_EXPERT_PARALLEL": "1",
                "PREFILL_CPUS": args.placement})  # fmt: skip
    settings = settings_from_env(env)
    variants: Sequence[str] = (["before"] if args.before else []) + ["after"]
    found: dict[str, Counter[str]] = {}
    served: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefill-profile-") as tmp:
        dirs = {"after": prefill_ep.REPO / "connector"}
        if args.before:
            dirs["before"] = prefill_ep.export_connector(args.before, Path(tmp))
        for variant in variants:
            print(f"profiling {variant} ...", file=sys.stderr, flush=True)
            counts, n, median = profile(
                settings, dirs[variant], out / "servers" / variant, args.length, args.seconds,
                args.rate, out / f"py-spy-{variant}.txt",
            )  # fmt: skip
            found[variant] = counts
            served[variant] = {"requests": n, "median_ms": round(median, 1)}
    title = (
        f"py-spy record -r {args.rate} -f raw on {WORKER} (PREFILL_CPUS={args.placement}), "
        f"{args.length}-token prompts one after another for {args.seconds:g} s; shares of its busy "
        f"samples (before: connector/ at {args.before or '-'}; after: this checkout)"
    )
    medians = "; ".join(f"{v}: {s['requests']:.0f} requests, median {s['median_ms']} ms"
                        for v, s in served.items())  # fmt: skip
    table = f"{title}\n\n{format_table(found)}\n\nrequests while recording: {medians}"
    result = {"groups": {v: dict(c) for v, c in found.items()}, "served": served}
    return Outcome(result, table, {"bench": knobs(args, "before", "placement", "length",
                                                 "seconds", "rate")})  # fmt: skip
