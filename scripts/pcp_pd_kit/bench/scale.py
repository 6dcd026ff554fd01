"""pd-proxy at a fleet's scale, on fake replicas that answer the P/D legs at once and
publish KV events the way vLLM does (pd_proxy.testing.fake_fleet): routing's cost per request
against routing off by replicas and prompt length, the KV events the proxy applies and its lag,
the relay's inter-token gap meanwhile, the index's memory per block, and admission with many
client keys. Every process it starts is stopped by its PID's group, also on failure.

    pcp-pd-kit bench scale                     # about 3 minutes on 2 cores
    pcp-pd-kit bench scale --proxy-ref HEAD    # the committed pd-proxy, whatever the tree holds
    pcp-pd-kit bench scale --before main       # routing: main's pd-proxy too, in the same turns
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from pcp_pd_kit import repo_root
from pcp_pd_kit.bench import scale_load as load
from pcp_pd_kit.bench import scale_report as report
from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.proxy import cpu_seconds, dumps, run_loop
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.localstack.commands import ProcessSpec
from pcp_pd_kit.localstack.host import free_port
from pcp_pd_kit.localstack.process import ManagedProcess, StackProcessError, wait_healthy

HELP = "pd-proxy on a fleet of fake replicas: routing cost, KV events, memory, many flows"
log = logging.getLogger("pcp_pd_kit.bench")
PHASES = ("routing", "events", "memory", "flows")
KEY = "sk-scale-admin"  # the flows phase's key for /metrics
HEARTBEAT_S = 0.2  # while a proxy subscribes: its first batch asks the replay for the rest
TURN = 10  # routing: requests per proxy per turn, off and on alternating (docs/bench.md: why)
READY_TIMEOUT_S = 120.0
BOUND_FLAG = "--cache-index-max-blocks"  # the index's bound, where pd-proxy has one
# A loaded 2-core host answers a health check late now and then: no replica taken out for it.
HEALTH = ("--health-timeout", "5", "--health-failures", "3")
FAILED = (StackProcessError, RuntimeError, aiohttp.ClientError, asyncio.TimeoutError, OSError)


_MANY = {"nargs": "+", "metavar": "N"}
FLAGS = [  # the options, also recorded as they were in the manifest
    ("--replicas", int, [1, 8, 32, 64], "fleet sizes: prefills, and as many decodes", _MANY),
    ("--prompt-tokens", int, [1024, 8192, 32768], "prompt lengths", _MANY),
    ("--prefixes", int, 2, "prompts of each length, 7/8 of each held by every replica"),
    ("--requests", int, 100, "requests per proxy, length and round (c=1)"),
    ("--rounds", int, 2, f"rounds of --requests per proxy, in turns of {TURN} alternating"),
    ("--event-replicas", int, 32, "fleet size of the events and relay phase"),
    ("--event-rates", int, [10000, 20000, 40000, 80000, 160000, 320000],
     "KV events/s sent, one block each; past 40000 it stops at the first not kept up", _MANY),
    ("--step-seconds", float, 3.0, "seconds per event rate"),
    ("--streams", int, 8, "concurrent streams through the proxy during each rate"),
    ("--stream-tokens", int, 64, None), ("--token-delay", float, 0.01, "fake decode, s"),
    ("--memory-pairs", int, 1_000_000, "block-replica pairs added to the index"),
    ("--memory-replicas", int, 8, None),
    ("--flows", int, [10, 1000, 10000], "client key counts, one flow each", _MANY),
    ("--requests-per-flow", int, 2, None), ("--flow-requests-min", int, 2000, None),
    ("--flow-concurrency", int, 32, None),
    ("--skip", str, "", f"phases left out, comma separated: {','.join(PHASES)}"),
    ("--proxy-ref", str, None, "run pd-proxy as committed at this git ref (unpacked into the "
     "run folder) instead of this checkout's, e.g. HEAD while others edit the tree"),
    ("--before", str, None, "routing: pd-proxy at this git ref too, off and on in the same "
     "turns (a host's drift between runs is larger than what a change moves)"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, FLAGS)


def check(args: argparse.Namespace) -> str | None:
    if {s for s in args.skip.split(",") if s} - set(PHASES):
        return f"--skip {args.skip!r}: phases are {', '.join(PHASES)}"
    sizes = [*args.replicas, *args.prompt_tokens, *args.flows, *args.event_rates, args.prefixes,
             args.requests, args.rounds, args.event_replicas, args.memory_replicas,
             args.memory_pairs, args.streams, args.stream_tokens,
             args.flow_concurrency]  # fmt: skip
    if min(sizes) < 1 or min(args.prompt_tokens) < 64:
        return "every count must be at least 1, --prompt-tokens at least 64"
    for flag, ref in (("--proxy-ref", args.proxy_ref), ("--before", args.before)):
        verify = ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"]
        if ref and subprocess.run(verify, cwd=repo_root(), capture_output=True).returncode:
            return f"{flag} {ref}: not a commit of this repository"
    return None


def proxy_source(ref: str, out: Path) -> tuple[dict[str, str], str]:
    """pd-proxy at ``ref`` unpacked under ``out``: its environment (PYTHONPATH) and commit."""
    out.mkdir(parents=True, exist_ok=True)

    def git(*argv: str) -> bytes:
        done = subprocess.run(["git", *argv], cwd=repo_root(), check=True, capture_output=True)
        return done.stdout

    commit = git("rev-parse", ref).decode().strip()
    subprocess.run(["tar", "-x", "-C", str(out)], input=git("archive", commit, "proxy"), check=True)
    build = [sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_ext"]
    subprocess.run([*build, "--inplace"], cwd=out / "proxy", check=True)  # its C chain, in place
    return {"PYTHONPATH": str(out / "proxy")}, commit


def body(ids: Any, tokens: int = 2) -> bytes:
    return dumps({"model": "fake-model", "prompt": list(ids), "max_tokens": tokens, "stream": True})


def rss_mb(pid: int) -> float:
    """Resident memory of a process (MB), from /proc."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next((int(x.split()[1]) / 1024 for x in lines if x.startswith("VmRSS:")), 0.0)


class Scale:
    """The phases, on one client session and one fleet; ``procs`` holds every process started."""

    def __init__(self, args: argparse.Namespace, out: Path, env: dict[str, str],
                 before: dict[str, str] | None = None) -> None:  # fmt: skip
        self.args, self.out, self.env, self.before = args, out, env, before
        self.procs: dict[str, ManagedProcess] = {}
        self.flags = subprocess.run([sys.executable, "-m", "pd_proxy", "--help"], text=True,
                                    capture_output=True, env={**os.environ, **env},
                                    timeout=60).stdout  # fmt: skip
        self.total = max([*args.replicas, args.event_replicas, args.memory_replicas])
        self.session: aiohttp.ClientSession
        self.fleet: dict[str, Any] = {}
        self.problems: list[str] = []

    def start(self, name: str, argv: list[str], health: str, env: dict[str, str]) -> int:
        proc = self.procs[name] = ManagedProcess(ProcessSpec(name, argv, env, health), self.out)
        proc.start()
        wait_healthy([proc], READY_TIMEOUT_S)
        assert proc.popen is not None
        return proc.popen.pid

    def stop(self, *names: str) -> None:
        for name in names or list(self.procs)[::-1]:
            if (proc := self.procs.pop(name, None)) is not None:
                proc.stop(grace_s=10)

    async def start_fleet(self) -> None:
        control = f"http://127.0.0.1:{free_port()}"
        self.start("fleet", [sys.executable, "-m", "pd_proxy.testing.fake_fleet", "--replicas",
                             str(self.total), "--port", control.rsplit(":", 1)[1]],
                   f"{control}/fleet", {})  # fmt: skip
        async with self.session.get(f"{control}/fleet") as resp:
            self.fleet = await resp.json()

    def proxy(self, name: str, replicas: int, *flags: str, env: dict[str, str] | None = None
              ) -> tuple[str, int]:  # fmt: skip
        """A pd-proxy over the fleet's first ``replicas`` of each role: its URL and PID, healthy."""
        url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "pd_proxy", "--host", "127.0.0.1", "--port",
                url.rsplit(":", 1)[1], "--log-level", "warning",
                "--prefill", *self.fleet["prefill"][:replicas],
                "--decode", *self.fleet["decode"][:replicas], *HEALTH, *flags]  # fmt: skip
        return url, self.start(name, argv, f"{url}/health", self.env if env is None else env)

    def publishers(self, replicas: int) -> list[int]:
        return [*range(replicas), *range(self.total, self.total + replicas)]

    async def call(self, name: str, **body: Any) -> Any:
        return await load.control(self.session, self.fleet["control"], name, **body)

    async def events_proxy(self, name: str, replicas: int, blocks: int = 0, *flags: str,
                           env: dict[str, str] | None = None) -> tuple[str, int]:  # fmt: skip
        """A proxy with ``--prefix-cache-routing events``, once every publisher's batches reached
        it (heartbeats meanwhile: a first batch asks the replay for what came before) and
        ``blocks`` entries are in its index; then the publishers fall silent."""
        await self.call("heartbeat", interval=HEARTBEAT_S)
        try:
            url, pid = self.proxy(name, replicas, "--prefix-cache-routing", "events", *flags,
                                  env=env)  # fmt: skip
            await self.indexed(url, replicas, blocks)
        finally:
            await self.call("heartbeat", interval=0)
        return url, pid

    async def indexed(self, url: str, replicas: int, blocks: int) -> None:
        """Wait until every publisher fed the proxy and its index holds ``blocks`` entries."""

        def reached(text: str) -> bool:
            fed = report.samples(text, report.EVENTS_TOTAL, kind="batches")
            return sum(v > 0 for _, v in fed) >= 2 * replicas and report.held_pairs(text) >= blocks

        if not await load.until(self.session, url, reached, READY_TIMEOUT_S):
            raise RuntimeError(f"{url}: index not filled ({blocks} blocks) in {READY_TIMEOUT_S} s")

    async def routing(self) -> list[dict[str, Any]]:
        """Per fleet size: both proxies, the prefixes stored once the events one follows every
        publisher (live, not replayed: a cold start's replay is not what this measures)."""
        a, bs, rows = self.args, self.fleet["block_size"], []
        for replicas in a.replicas:
            await self.call("restart")
            try:
                off = ("--prefix-cache-routing", "off")
                runs = {"off": self.proxy("off", replicas, *off),
                        "events": await self.events_proxy("on", replicas)}  # fmt: skip
                if (was := self.before) is not None:
                    runs["off_before"] = self.proxy("off_before", replicas, *off, env=was)
                    runs["events_before"] = await self.events_proxy("on_before", replicas, env=was)
                held = 0
                for length in a.prompt_tokens:
                    for p in range(a.prefixes):
                        tokens = report.held_prefix(length, p, bs)
                        await self.call("store", tokens=tokens, replicas=replicas)
                        held += len(tokens) // bs
                for mode in ("events", "events_before")[: len(runs) // 2]:
                    await self.indexed(runs[mode][0], replicas, 2 * replicas * held)
                for length in a.prompt_tokens:
                    rows.append(await self.routing_row(replicas, length, runs))
                    log.info("routing %s", rows[-1])
            except FAILED as exc:
                self.problems.append(f"routing at {replicas} replicas: {exc}")
            finally:
                self.stop("off", "on", "off_before", "on_before")
        return rows

    async def routing_row(self, replicas: int, length: int,
                          runs: dict[str, tuple[str, int]]) -> dict[str, Any]:  # fmt: skip
        """The proxies (off, on; with --before also that ref's) in turns (``TURN``) of the same
        prompts, one at a time, the order rotated each turn."""
        a, bs, n = self.args, self.fleet["block_size"], self.args.requests
        bodies = [body(report.prompt(length, i % a.prefixes, i, bs)) for i in range(n * a.rounds)]
        for url, _ in runs.values():  # warm-up: connections, the pending index
            await load.timed(self.session, url, bodies[:4])
        got: dict[str, list[Any]] = {m: [[], 0.0, 0] for m in runs}
        on = runs["events"]
        hits = -report.total(await load.page(self.session, on[0]), report.PREDICTED, role="decode")
        for r in range(0, n * a.rounds, TURN):
            turn = r // TURN % len(runs)
            for mode in list(runs)[turn:] + list(runs)[:turn]:
                url, pid = runs[mode]
                cpu = cpu_seconds(pid)
                lat, errors = await load.timed(self.session, url, bodies[r : r + TURN])
                done = got[mode]
                done[:] = done[0] + lat, done[1] + cpu_seconds(pid) - cpu, done[2] + errors
        hits += report.total(await load.page(self.session, on[0]), report.PREDICTED, role="decode")
        timed = {m: report.timing(lat, cpu, n * a.rounds, e) for m, (lat, cpu, e) in got.items()}
        share = hits / (n * a.rounds * length)
        row = report.routing_row(replicas, length, timed["off"], timed["events"], share)
        if "off_before" in timed:
            row["before"] = report.routing_row(replicas, length, timed["off_before"],
                                               timed["events_before"], None)  # fmt: skip
        return row

    async def events(self) -> dict[str, Any]:
        """Streams through the proxy while the publishers churn at each rate in turn."""
        a = self.args
        replicas = min(a.event_replicas, self.total)
        pubs, steps = self.publishers(replicas), []
        await self.call("restart")
        try:
            url, _ = await self.events_proxy("events", replicas)
            await self.call("knobs", token_delay=a.token_delay)
            await self.call("pump", rate=0, seconds=0, replicas=replicas)  # the rings, built now
            stream = body(range(100, 164), a.stream_tokens)
            for rate in [0, *a.event_rates]:
                applied = -report.total(await load.page(self.session, url), report.EVENTS_TOTAL,
                                        kind="events")  # fmt: skip
                sent = -await load.sent(self.session, self.fleet["control"], pubs)
                if rate:
                    await self.call("pump", rate=rate, seconds=a.step_seconds, replicas=replicas)
                (gaps, _), lags = await asyncio.gather(
                    load.stream_gaps(self.session, url, stream, a.streams, a.step_seconds),
                    load.lags(self.session, url, a.step_seconds))  # fmt: skip
                applied += report.total(await load.page(self.session, url), report.EVENTS_TOTAL,
                                        kind="events")  # fmt: skip
                total = await load.sent(self.session, self.fleet["control"], pubs)
                drained = await load.until(self.session, url, lambda t, n=total: report.total(
                    t, report.EVENTS_TOTAL, kind="events") >= n, 10.0)  # fmt: skip
                steps.append(report.event_step(rate, a.step_seconds, sent + total, applied,
                                               lags if rate else [], gaps, drained))  # fmt: skip
                log.info("events %s", steps[-1])
                if rate > report.GOAL_RATE and not steps[-1]["keeps_up"]:
                    break
        finally:
            self.stop("events")
            with contextlib.suppress(*FAILED):
                await self.call("knobs", token_delay=0.0)
        return {"replicas": replicas, "publishers": len(pubs), "seconds": a.step_seconds,
                "streams": a.streams, "stream_tokens": a.stream_tokens, "steps": steps,
                "max_kept_per_s": report.max_kept_rate(steps)}  # fmt: skip

    async def memory(self) -> dict[str, Any]:
        """RSS before and after the index takes ``--memory-pairs`` more block-replica pairs (after
        a warm-up sixteenth), filled in rounds so that no backlog sits in ZMQ's queues; then the
        bound, where this pd-proxy has one."""
        a = self.args
        replicas = min(a.memory_replicas, self.total)
        publishers, rounds = 2 * replicas, 16
        chunk = a.memory_pairs // publishers // rounds
        await self.call("restart")
        try:
            url, pid = await self.events_proxy("memory", replicas)
            rss = []
            for i in range(rounds + 1):
                await self.call("fill", blocks=chunk, replicas=replicas)
                await self.indexed(url, replicas, publishers * chunk * (i + 1))
                rss.append(rss_mb(pid))
        finally:
            self.stop("memory")
        pairs, before, after = publishers * rounds * chunk, rss[0], rss[-1]
        found = {"replicas": replicas, "publishers": publishers, "pairs": pairs,
                 "rss_before_mb": before, "rss_after_mb": after,
                 "bytes_per_pair": (after - before) * 2**20 / pairs}  # fmt: skip
        if BOUND_FLAG in self.flags:
            found["bound"] = await self.bound(replicas)
        return found

    async def bound(self, replicas: int, cap: int = 4096) -> dict[str, Any]:
        """Each role sent twice ``cap`` pairs through a proxy bounded at ``cap``: its gauge must
        stay within the bound and its counter count what went."""
        await self.call("restart")
        per = -(-2 * cap // replicas)
        try:
            url, _ = await self.events_proxy("bound", replicas, 0, BOUND_FLAG, str(cap))
            await self.call("fill", blocks=per, replicas=replicas)
            sent = await load.sent(self.session, self.fleet["control"], self.publishers(replicas))
            await load.until(self.session, url, lambda t: report.total(
                t, report.EVENTS_TOTAL, kind="events") >= sent, 30.0)  # fmt: skip
            await asyncio.sleep(2.5)  # the index's gauges are set once a second
            text = await load.page(self.session, url)
        finally:
            self.stop("bound")
        return report.bound_check(text, cap, per * replicas, BOUND_FLAG)

    async def flows(self) -> list[dict[str, Any]]:
        """Per key count: the same requests through a proxy with admission and one without, in
        alternating halves (so that the host's load drifts alike over both)."""
        a, rows = self.args, []
        for count in a.flows:
            keys = [f"sk-scale-{i:05d}" for i in range(count)]
            path = self.out / f"keys-{count}"
            path.write_text(report.key_file([KEY, *keys]))
            n = max(a.flow_requests_min, a.requests_per_flow * count)
            bodies, errors = [body(range(200, 264))] * n, 0
            cpu: dict[str, float] = {}
            try:
                proxies = {name: self.proxy(name, 1, "--api-key-file", str(path), flag)
                           for name, flag in (("admission", "--decode-max-inflight=8"),
                                              ("no-admission", "--no-admission"))}  # fmt: skip
                for url, _ in proxies.values():
                    await load.timed(self.session, url, bodies[:50], 8, [KEY])  # warm-up
                for half, order in enumerate((list(proxies), list(proxies)[::-1])):
                    part = slice(half * n // 2, (half + 1) * n // 2)
                    for name in order:
                        url, pid = proxies[name]
                        start = cpu_seconds(pid)
                        _, err = await load.timed(self.session, url, bodies[part],
                                                  a.flow_concurrency, keys)  # fmt: skip
                        cpu[name] = cpu.get(name, 0.0) + (cpu_seconds(pid) - start) * 1e6 / n
                        errors += err
                text = await load.page(self.session, proxies["admission"][0], KEY)
            finally:
                self.stop("admission", "no-admission")
            rows.append(report.flow_row(count, n, cpu, text, errors))
            log.info("flows %s", rows[-1])
        return rows

    async def measure(self) -> dict[str, Any]:
        data: dict[str, Any] = {"problems": self.problems, "phase_s": {}}
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as self.session:  # fmt: skip
            await self.start_fleet()
            for phase in PHASES:
                if phase in self.args.skip.split(","):
                    continue
                started = time.monotonic()
                try:
                    data[phase] = await getattr(self, phase)()
                except FAILED as exc:
                    log.error("phase %s failed: %s", phase, exc)
                    data["problems"].append(f"{phase}: {exc}")
                data["phase_s"][phase] = round(time.monotonic() - started, 1)
        return data


def run(args: argparse.Namespace, out: Path) -> Outcome:
    start = time.monotonic()
    env, commit = proxy_source(args.proxy_ref, out) if args.proxy_ref else ({}, None)
    before, was = proxy_source(args.before, out / "before") if args.before else (None, None)
    scale = Scale(args, out, env, before)
    try:
        data = run_loop(scale.measure())
    finally:
        scale.stop()
    data.update(wall_s=round(time.monotonic() - start, 1), proxy_commit=commit, before_commit=was)
    data["goals"] = report.goals(data)
    used = knobs(args, *(str(flag[0])[2:].replace("-", "_") for flag in FLAGS))
    rc = 1 if data["problems"] or report.errors(data) else 0
    return Outcome(data, report.format_table(data), {"bench": used}, rc=rc)
