"""xPyD on the compose cpu profile: 1P1D against 2P1D at a prefill-bound load, side by side
(docs/bench.md). Heavy: two or three vLLM servers, the images of `make images`; the stack is taken
down with `down -v` at the end, also on a failure or Ctrl-C.

    pcp-pd-kit bench xpyd --concurrency 4,8 --input-len 1000 --output-len 4
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.bench.tables import fmt_ratio, markdown_table, ratio
from pcp_pd_kit.localstack.host import free_port
from pcp_pd_kit.localstack.keys import write_credentials
from pcp_pd_kit.localstack.live import prometheus_query

HELP = "compose cpu profile: 1P1D vs 2P1D at a prefill-bound load (needs Docker, make images)"
REPO = repo_root()
PROJECT = "pcp-pd-kit-bench-xpyd"
SUBNET = "172.29.252.0/24"
UP_TIMEOUT_S = 900
SERVED = 'sum by (instance) (vllm:request_success_total{job="prefill"})'
HEALTHY = 'sum(pd_proxy_backend_healthy{role="prefill"})'


class Stack:
    """The cpu profile under PROJECT, driven with the real Compose binary."""

    def __init__(self, work: Path) -> None:
        secrets_dir = work / "secrets"
        secrets_dir.mkdir(mode=0o700)
        key = f"sk-bench-{secrets.token_urlsafe(12)}\n"
        self.key_file = write_credentials(key, secrets_dir / "api_keys")
        proxy, prom = free_port(), free_port()
        self.proxy_url, self.prom_url = f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{prom}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "KIT_"))}
        self.env = {**env, "COMPOSE_PROJECT_NAME": PROJECT, "COMPOSE_BAKE": "false",
                    "PROXY_BIND_ADDRESS": "127.0.0.1", "PROXY_PORT": str(proxy),
                    "PROMETHEUS_PORT": str(prom), "KIT_SECRETS_DIR": str(secrets_dir),
                    "PD_SUBNET": SUBNET}  # fmt: skip

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "--env-file", str(REPO / ".env.example"), "--profile", "cpu"]
        return subprocess.run(
            [*argv, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def up(self, prefill_replicas: int) -> float:
        self.env["PREFILL_REPLICAS"] = str(prefill_replicas)
        start = time.monotonic()
        wait = ["up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S)]
        proc = self.compose(*wait, timeout=UP_TIMEOUT_S + 120)
        # A new count recreates the role: meanwhile pd-proxy has no prefill and fails its
        # healthcheck, which ends --wait at once though it is healthy one check after them.
        if proc.returncode != 0 and not self.all_healthy(UP_TIMEOUT_S):
            logs = self.compose("logs", "--no-color", "--tail", "40").stdout
            raise SystemExit(
                f"compose up failed ({proc.returncode}):\n{proc.stderr[-2000:]}\n{logs}"
            )
        deadline = time.monotonic() + 180
        while sum(float(r["value"][1]) for r in self.query(HEALTHY)) < prefill_replicas:
            if time.monotonic() > deadline:
                raise SystemExit(f"pd-proxy's prefill pool: {HEALTHY} not reached within 180s")
            time.sleep(3)
        return time.monotonic() - start

    def all_healthy(self, timeout_s: float) -> bool:
        """Every running container with a healthcheck reports healthy, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.compose("ps", "--format", "{{.Service}} {{.Health}}").stdout.split("\n")
            states = [row.split()[1] for row in rows if len(row.split()) == 2]
            if states and all(state == "healthy" for state in states):
                return True
            time.sleep(3)
        return False

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300)

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(prometheus_query(self.prom_url, expr)["data"]["result"])

    def served(self) -> dict[str, float]:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in self.query(SERVED)}


def serve_argv(
    proxy_url: str, key_file: Path, args: argparse.Namespace, out: Path, replicas: int
) -> list[str]:
    """Pure: the `bench serve` command for one topology. Each topology gets prompts of its own (a
    seed per replica count): the decode outlives the switch to 2P1D, and with the same prompts
    its prefix cache (and cache-aware routing) would answer them without a prefill."""
    return [
        sys.executable, "-m", "pcp_pd_kit", "bench", "serve",
        "--base-url", proxy_url, "--api-key-file", str(key_file),
        "--targets", "pd", "--concurrency", args.concurrency, "--prompts", str(args.prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--seed", str(1000 * replicas), "--results-dir", str(out),
    ]  # fmt: skip


def run_bench(
    stack: Stack, args: argparse.Namespace, out: Path, replicas: int
) -> dict[int, dict[str, Any]]:
    """`pcp-pd-kit bench serve` against the proxy; the per-level `vllm bench serve` results."""
    out.mkdir(parents=True, exist_ok=True)
    argv = serve_argv(stack.proxy_url, stack.key_file, args, out, replicas)
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
    (out / "bench.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"bench failed ({proc.returncode}), see {out / 'bench.log'}")
    [run_dir] = sorted(out.glob("serve-*"))[-1:]
    levels = [int(c) for c in args.concurrency.split(",")]
    return {c: json.loads((run_dir / f"pd-c{c}.json").read_text()) for c in levels}


def table(results: dict[int, dict[int, dict[str, Any]]], served: dict[int, list[float]]) -> str:
    """Pure: the side-by-side Markdown table of 1P1D and 2P1D per concurrency level."""
    keys = (("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
            ("median_e2el_ms", "E2E p50 ms"), ("request_throughput", "req/s"))  # fmt: skip
    rows = []
    for level in sorted(results.get(1, {})):
        for key, label in keys:
            one = results[1][level].get(key)
            two = results.get(2, {}).get(level, {}).get(key)
            cells = [f"{v:.1f}" if isinstance(v, float | int) else "n/a" for v in (one, two)]
            rows.append([level, label, *cells, fmt_ratio(ratio(two or None, one))])
    lines = [markdown_table(["concurrency", "metric", "1P1D", "2P1D", "2P/1P"], rows)]
    for replicas, counts in sorted(served.items()):
        lines.append(f"\nprefills per replica, {replicas}P1D: {sorted(int(c) for c in counts)}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [("--concurrency", str, "8", "levels, comma-separated (8)"),
                       ("--prompts", int, 48, "prompts per level (48)"),
                       ("--input-len", int, 1000, "(1000: prefill-bound)"),
                       ("--output-len", int, 4, "(4)")])  # fmt: skip


def check(args: argparse.Namespace) -> str | None:
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        return f"--concurrency {args.concurrency!r}: comma-separated integers"
    if min(levels) < 1 or args.prompts < 1 or args.input_len < 1 or args.output_len < 1:
        return "--concurrency, --prompts, --input-len and --output-len must be >= 1"
    return None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    results: dict[int, dict[int, dict[str, Any]]] = {}
    served: dict[int, list[float]] = {}
    up_s: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="kit-xpyd-") as tmp:
        stack = Stack(Path(tmp))
        stack.down()  # leftovers of an interrupted run
        try:
            for replicas in (1, 2):
                up_s[replicas] = stack.up(replicas)
                print(f"{replicas}P1D up and in pd-proxy's pool after {up_s[replicas]:.0f}s")
                before = stack.served()
                results[replicas] = run_bench(stack, args, out / f"{replicas}p1d", replicas)
                after = stack.served()
                served[replicas] = [after[i] - before.get(i, 0.0) for i in after]
        finally:
            stack.down()
    medians = {r: statistics.median(v["median_ttft_ms"] for v in res.values())
               for r, res in results.items()}  # fmt: skip
    by_replicas: dict[str, dict[int, Any]] = {
        "results": {r: {str(c): v for c, v in res.items()} for r, res in results.items()},
        "prefills_per_replica": served, "ttft_median_over_levels_ms": medians,
        "up_s": {r: round(s, 1) for r, s in up_s.items()}}  # fmt: skip
    data = {key: {f"{r}p1d": v for r, v in by.items()} for key, by in by_replicas.items()}
    used = knobs(args, "concurrency", "prompts", "input_len", "output_len")
    return Outcome(data, table(results, served), {"bench": used, "project": PROJECT})
