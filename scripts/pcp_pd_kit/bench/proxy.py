"""Benchmark pd-proxy against its floor, a client that does both P/D legs itself, on fake vLLM
prefill and decode processes (docs/proxy/benchmark.md). Each round runs every mode once, the order
flipped every round: medians over rounds, each proxy's ratios to the floor of its endpoint, and
CPU microseconds per request by process (from /proc), which barely move on a busy machine.

    pcp-pd-kit bench proxy --endpoint chat --workers 1 2 --first-token
    pcp-pd-kit bench proxy --proxy-cmd 'vllm-router --port {port} ...'  # another proxy

``--proxy-cmd`` is a template with ``{port}``, ``{prefill}``, ``{decode}`` (base URLs) and
``{workers}``; ``--also NAME=CMD`` adds another proxy (the code before a change, say).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import string
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pcp_pd_kit.bench.client import BenchError, http
from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.bench.tables import markdown_table
from pcp_pd_kit.localstack.host import free_port

try:  # the event loop pd-proxy runs on when installed, else asyncio's
    from uvloop import run as run_loop
except ImportError:
    from asyncio import run as run_loop  # type: ignore[assignment]

# The floor's prefill leg as vLLM's P/D protocol wants it (pd-proxy's internals are not imported).
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


HELP = "pd-proxy against its floor (a client doing both legs) on fake vLLMs: latency, CPU"
GOALS = "goals: p50 <= 1.15x, throughput >= 0.9x the floor of the same endpoint"
DEFAULT_PROXY_CMD = (
    f"{shlex.quote(sys.executable)} -m pd_proxy --host 127.0.0.1 --port {{port}} "
    "--prefill {prefill} --decode {decode} --workers {workers}"
)
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
OTHER_CPUS = ("prefill", "decode", "generator")
FIELDS = {"port", "prefill", "decode"}  # an --also CMD's (--proxy-cmd's also {workers})
RATIOS = {"p50": "p50_ms", "p99": "p99_ms", "throughput": "req_s"}  # to the floor, of these


@dataclass
class Round:
    mode: str  # "side:endpoint", e.g. "floor:chat", "proxy:completions", "proxy-w2:chat"
    latencies: list[float]
    wall: float
    errors: int  # requests without all their tokens and [DONE]
    cpu_us: dict[str, float]  # CPU microseconds per request, by process

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's threads and its live descendants (-pid: alone), in nanoseconds'
    resolution (schedstat; /proc/PID/stat counts 10 ms ticks, coarse for a few hundred
    requests). A thread that has ended no longer counts: the measured ones live throughout."""
    total, todo = 0.0, [abs(pid)]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
                todo += map(int, (task / "children").read_text().split()) if pid > 0 else ()
    return total


def start_fake(role: str, token_delay: float, port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd_proxy.testing.fake_vllm", "--role", role, "--port", str(port),
         "--token-delay", str(token_delay)],
        stdout=subprocess.PIPE, text=True, env=None,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"fake {role} did not start: {line!r}")
    return proc, line.split()[-1]


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(BenchError):
            http(f"{url}/health", timeout_s=timeout)
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready after {timeout}s")
        time.sleep(0.1)


async def run_round(
    mode: str, session: aiohttp.ClientSession, urls: dict[str, str], args: argparse.Namespace
) -> Round:
    side, endpoint = mode.split(":")
    path, chat, text = ENDPOINTS[endpoint], endpoint == "chat", "hello " * 8
    prompt: Any = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body = {"model": "fake-model", "max_tokens": args.tokens, "stream": True, **prompt}
    latencies: list[float] = []
    remaining = args.requests
    hdr = {"Content-Type": "application/json"}
    proxy_payload = dumps(body)
    # the prefill leg: non-streaming, one token, the KV kept for a remote decode
    prefill = dumps({**body, "kv_transfer_params": PREFILL_KV, "stream": False, "max_tokens": 1})

    async def one() -> bytes:
        """One request through the proxy, or both legs from here (the floor)."""
        url, data, headers = urls.get(side, ""), proxy_payload, hdr
        if side == "floor":
            headers = {**hdr, "X-Request-Id": uuid.uuid4().hex}
            async with session.post(urls["prefill"] + path, data=prefill, headers=headers) as r:
                kv = json.loads(await r.read())["kv_transfer_params"]
            url, data = urls["decode"], dumps({**body, "kv_transfer_params": kv})
        async with session.post(url + path, data=data, headers=headers) as r:
            return await r.read() if r.status == 200 else b""

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            try:
                raw = await one()
            except (aiohttp.ClientError, ValueError, KeyError):
                raw = b""
            # all tokens and [DONE] (a chat stream starts with a role-only chunk)
            if raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") == args.tokens + 1 + chat:
                latencies.append(time.perf_counter() - t0)

    # The generator's own CPU only: the fakes and proxies are its children.
    pids = {**args.pids, "generator": -os.getpid()}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    n = max(1, args.requests)
    cpu = {name: (cpu_seconds(pid) - cpu0[name]) * 1e6 / n for name, pid in pids.items()}
    return Round(mode, latencies, wall, max(0, args.requests) - len(latencies), cpu)


async def bench(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for mode in args.modes:  # warm-up: connections, caches
            await run_round(mode, session, urls, argparse.Namespace(**{
                **vars(args), "requests": args.warmup}))  # fmt: skip
        rounds: list[Round] = []
        for i in range(args.rounds):
            for mode in args.modes if i % 2 == 0 else args.modes[::-1]:  # noise hits all alike
                r = await run_round(mode, session, urls, args)
                rounds.append(r)
                cpu = " ".join(f"{k}={v:.0f}" for k, v in r.cpu_us.items())
                print(
                    f"round {i + 1} {mode:22s}: p50 {r.pct(0.5):7.2f} ms  p99 {r.pct(0.99):7.2f}"
                    f" ms  {r.rps:8.1f} req/s  errors {r.errors}  cpu us/req: {cpu}",
                    flush=True,
                )
    errors = sum(r.errors for r in rounds)
    summary: dict[str, Any] = {}
    for mode in args.modes:
        rs = [r for r in rounds if r.mode == mode]
        # CPU microseconds per request by process: unlike latency, robust to a busy machine.
        per_req = {name: statistics.median(r.cpu_us[name] for r in rs) for name in rs[0].cpu_us}
        summary[mode] = {"p50_ms": statistics.median(r.pct(0.5) for r in rs),
                         "p99_ms": statistics.median(r.pct(0.99) for r in rs),
                         "req_s": statistics.median(r.rps for r in rs),
                         "errors": sum(r.errors for r in rs),
                         "cpu_us_per_req": per_req}  # fmt: skip
    ratios: dict[str, dict[str, float]] = {}
    for mode, s in summary.items():
        side, endpoint = mode.split(":")
        if side != "floor" and (floor := summary.get(f"floor:{endpoint}")) is not None:
            ratios[mode] = {k: s[key] / floor[key] for k, key in RATIOS.items()}
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"summary": summary, "ratios": ratios, "load": list(load), "errors": errors}


def format_table(data: dict[str, Any], args: argparse.Namespace) -> str:
    """Markdown: per mode the medians over rounds, ratios to the floor, CPU us per request."""
    summary, ratios, load = data["summary"], data["ratios"], data["load"]
    title = (
        f"{args.concurrency} concurrent streams x {args.tokens} tokens, {args.requests} requests"
        f" per round, medians of {args.rounds} rounds; load average at the end"
        f" {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs"
    )
    head = ["mode", "p50 ms", "p99 ms", "req/s", "errors", "p50 x", "p99 x", "thru x"]
    head += ["cpu us/req: proxy", *OTHER_CPUS]
    rows = []
    for mode, s in summary.items():
        cpu = s["cpu_us_per_req"]
        proxy_cpu = cpu.get(mode.split(":")[0], 0.0)  # the floor has no process of its own
        r = ratios.get(mode)
        rcells = [f"{r[k]:.2f}" for k in RATIOS] if r else ["", "", ""]
        rows.append([mode, f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}", f"{s['req_s']:.1f}",
                     s["errors"], *rcells, f"{proxy_cpu:.0f}",
                     *(f"{cpu.get(p, 0):.0f}" for p in OTHER_CPUS)])  # fmt: skip
    return f"{title}\n\n{markdown_table(head, rows)}" + (f"\n\n{GOALS}" if ratios else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--concurrency", int, 32, None), ("--tokens", int, 16, None),
        ("--requests", int, 2000, "requests per round"), ("--rounds", int, 5, None),
        ("--warmup", int, 300, None), ("--token-delay", float, 0.0, "fake decode, seconds"),
        ("--endpoint", str, "both", "which OpenAI endpoint to drive (both: side by side, each "
         "with its own floor)", {"choices": ("completions", "chat", "both")}),
        ("--workers", int, [1], "proxy worker counts (pd-proxy --workers); several start one "
         "proxy each, compared side by side in the same rounds (default 1)",
         {"nargs": "+", "metavar": "N"}),
        ("--proxy-cmd", str, DEFAULT_PROXY_CMD, None),
        ("--also", str, [], "one more proxy to compare in the same rounds, e.g. 'old=env "
         "PYTHONPATH=/tmp/old python -m pd_proxy --port {port} --prefill {prefill} --decode "
         "{decode}' (repeatable)", {"action": "append", "metavar": "NAME=CMD"}),
        ("--port-base", int, 0, "listen on this port and the next ones (prefill, decode, "
         "proxies); 0: ephemeral"),
    ])  # fmt: skip
    parser.add_argument("--first-token", action="store_true", help="also run the default proxy "
                        "with --first-token-from-prefill (named first-token)")  # fmt: skip
    add_flags(parser, [("--only", str, None, "run one side only (for profiling; no ratios)",
                        {"choices": ("floor", "proxy")})])  # fmt: skip


def check(args: argparse.Namespace) -> str | None:
    if len(set(args.workers)) != len(args.workers) or min(args.workers) < 1:
        return "--workers takes distinct counts >= 1"
    if len(args.workers) > 1 and "{workers}" not in args.proxy_cmd:
        return "several --workers counts need {workers} in --proxy-cmd"
    reserved = {"floor", "prefill", "decode", "proxy", "first-token"}
    for item in args.also:
        name, sep, cmd = item.partition("=")
        if not sep or not name or ":" in name or name in reserved or name.startswith("proxy-w"):
            return f"--also {item!r}: expected a new NAME=CMD (NAME without ':')"
        if unknown := {f for _, f, _, _ in string.Formatter().parse(cmd) if f} - FIELDS:
            bad, fields = (", ".join(f"{{{f}}}" for f in sorted(x)) for x in (unknown, FIELDS))
            return f"--also {name}: {bad} unknown; CMD may use {fields}"
    return None


def run(args: argparse.Namespace, out: Path) -> Outcome:
    many = len(args.workers) > 1
    proxies = {(f"proxy-w{n}" if many else "proxy"): args.proxy_cmd.replace("{workers}", str(n))
               for n in args.workers}  # fmt: skip
    if args.first_token:
        first = DEFAULT_PROXY_CMD.replace("{workers}", "1") + " --first-token-from-prefill"
        proxies["first-token"] = first
    proxies.update(item.partition("=")[::2] for item in args.also)
    sides = {"floor": ["floor"], "proxy": list(proxies)}.get(args.only, ["floor", *proxies])
    endpoints = ["completions", "chat"] if args.endpoint == "both" else [args.endpoint]
    args.modes = [f"{side}:{endpoint}" for endpoint in endpoints for side in sides]
    procs: dict[str, subprocess.Popen[Any]] = {}  # by name: the fakes', then the proxies'
    with (out / "proxy.log").open("wb") as log:
        try:
            base, urls = args.port_base, {}
            for i, (role, delay) in enumerate((("prefill", 0.0), ("decode", args.token_delay))):
                procs[role], urls[role] = start_fake(role, delay, base + i if base else 0)
            for i, (name, template) in enumerate(proxies.items()):
                port = base + 2 + i if base else free_port()
                cmd = template.format(port=port, prefill=urls["prefill"], decode=urls["decode"])
                procs[name] = subprocess.Popen(shlex.split(cmd), stdout=log, stderr=log, env=None)
                urls[name] = f"http://127.0.0.1:{port}"
                print(f"{name}: {cmd}", flush=True)
            print(f"proxy log: {log.name}", flush=True)
            args.pids = {name: proc.pid for name, proc in procs.items()}
            for name in proxies:
                wait_ready(urls[name])
            data = run_loop(bench(args, urls))
        finally:
            for proc in reversed(procs.values()):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    used = knobs(args, "concurrency", "tokens", "requests", "rounds", "warmup", "token_delay")
    used.update(endpoint=args.endpoint, workers=args.workers, proxies=proxies)
    return Outcome(data, format_table(data, args), {"bench": used}, rc=1 if data["errors"] else 0)
