"""vLLM's own serving benchmark, `vllm bench serve`, against a single vLLM and the P/D variants
(single, pd, pd-ft, pd-local; docs/bench.md). With no URL it starts the local CPU stack in two
phases; with URLs it benchmarks a running deployment and starts nothing.

    pcp-pd-kit bench serve --targets single,pd --concurrency 1,4 --prompts 16
    pcp-pd-kit bench serve --base-url http://gpu-host:8000 --single-url http://gpu-host:8300
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.bench import client
from pcp_pd_kit.bench import serve_plan as sp
from pcp_pd_kit.bench import serve_report as report
from pcp_pd_kit.bench.client import BenchError
from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.results import Outcome, startup_s
from pcp_pd_kit.localstack.host import ensure_ports_free
from pcp_pd_kit.localstack.model_source import hf_cached, resolve_model
from pcp_pd_kit.localstack.process import StackProcessError
from pcp_pd_kit.localstack.stack import (
    FIRST_TOKEN_PROXY,
    LOCAL_PREFILL_PROXY,
    REFERENCE_PARTS,
    Stack,
)
from pcp_pd_kit.settings import StackSettings, kit_env, settings_from_env
from pd_proxy.config.key_files import KeyFileError, read_key_file

HELP = "vllm bench serve: single vLLM vs P/D and its proxy variants"
log = logging.getLogger("pcp_pd_kit.bench")
SETTLE_S = 1.0  # after a run, before the "after" scrape: the last observations land
WARMUP_REQUESTS = 2  # outside every measurement: the first P/D one does the NIXL handshake
# the local stack's pd-proxy of each P/D target
PROXY_PARTS = {"pd": "proxy", "pd-local": LOCAL_PREFILL_PROXY, "pd-ft": FIRST_TOKEN_PROXY}
REMOTE_URLS = {"pd": "base_url", "single": "single_url", "pd-ft": "first_token_url",
               "pd-local": "local_prefill_url"}  # fmt: skip
WANTED = client.Wanted(report.HISTOGRAMS, report.COUNTERS, report.GAUGES)


def add_arguments(parser: argparse.ArgumentParser, default_targets: str | None = None) -> None:
    d, b, s = "(%(default)s)", sp.BenchPlan(), sp.ShortPlan()
    add_flags(parser.add_argument_group("what to run"), [
        ("--concurrency", str, ",".join(map(str, b.levels)), f"--max-concurrency levels {d}"),
        ("--prompts", str, None,
         f"N, or one per level (default max({sp.MIN_PROMPTS}, {sp.PROMPTS_PER_SLOT} x c))"),
        ("--input-len", int, b.input_len, d), ("--output-len", int, b.output_len, d),
        ("--seed", int, b.seed, f"dataset seed {d}"),
        ("--targets", str, default_targets or ",".join(sp.TARGETS),
         f"of single,pd,pd-local,pd-ft {d}"),
        ("--short-input-len", int, s.input_len, f"pd-local's short prompts {d}"),
        ("--short-output-len", int, s.output_len, d),
        ("--short-prompts", int, s.prompts, f"per target, c=1 {d}"),
        ("--local-prefill-max-tokens", int, s.max_tokens, f"N of the pd-local proxy {d}"),
        ("--breakdown-concurrency", int, b.breakdown_level, f"level of the printed breakdown {d}"),
        ("--run-timeout", float, b.run_timeout_s, f"seconds one vllm bench serve may run {d}"),
        ("--port-base", int, sp.DEFAULT_PORT_BASE, f"local stack ports base..base+90 {d}"),
    ])  # fmt: skip
    r = parser.add_argument_group("a running deployment (nothing is started when a URL is given)")
    add_flags(r, [
        ("--base-url", str, None, "pd: the proxy"),
        ("--single-url", str, None, "single: a plain vLLM of the same model"),
        ("--first-token-url", str, None, "pd-ft: a pd-proxy with --first-token-from-prefill"),
        ("--local-prefill-url", str, None,
         "pd-local: a pd-proxy with --local-prefill-max-tokens N"),
        ("--api-key", str, None, "client key (default: --api-key-file, else OPENAI_API_KEY)"),
        ("--api-key-file", str, None, "file whose first non-comment line is the key"),
        ("--served-model-name", str, None, "default: the first of /v1/models"),
        ("--tokenizer", str, None, "default: the served model's root when here, else MODEL"),
        ("--prefill-metrics-url", str, None, "a prefill vLLM, for its breakdown rows"),
        ("--decode-metrics-url", str, None, "a decode vLLM, for its breakdown rows"),
    ])  # fmt: skip


def plans(args: argparse.Namespace) -> tuple[sp.BenchPlan, sp.ShortPlan, tuple[str, ...]]:
    """The plan, the short workload and the targets; BenchError names a bad option."""
    levels = sp.parse_levels(args.concurrency)
    plan = sp.BenchPlan(
        levels=levels, prompts=sp.parse_prompts(args.prompts, levels), input_len=args.input_len,
        output_len=args.output_len, seed=args.seed, breakdown_level=args.breakdown_concurrency,
        run_timeout_s=args.run_timeout,
    )  # fmt: skip
    short = sp.ShortPlan(args.short_input_len, args.short_output_len, args.short_prompts,
                         args.local_prefill_max_tokens)  # fmt: skip
    wanted = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not wanted or set(wanted) - set(sp.TARGETS):
        raise BenchError(f"--targets {args.targets!r}: choose from {','.join(sp.TARGETS)}")
    return plan, short, wanted


def resolve_api_key(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:  # pd-proxy's own key file format: its first key
        try:
            return read_key_file(args.api_key_file)[0].key
        except KeyFileError as exc:
            raise BenchError(f"--api-key-file: {exc}") from None
    return env.get("OPENAI_API_KEY") or None


def remote_urls(args: argparse.Namespace, wanted: Sequence[str]) -> dict[str, str]:
    urls = {t: getattr(args, opt) for t, opt in REMOTE_URLS.items()}
    return {t: u.rstrip("/") for t, u in urls.items() if u and t in wanted}


def local_settings(port_base: int) -> StackSettings:
    """The bench's ports; every prompt P/D, cache-aware routing off (`bench cache` measures it)."""
    return sp.bench_settings(port_base, local_prefill_max_tokens=0, prefix_cache_routing="off")


def phases(wanted: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Local phase -> parts: the single instance alone, then P/D with a proxy per P/D target."""
    out: dict[str, tuple[str, ...]] = {}
    if "single" in wanted:
        out["single"] = REFERENCE_PARTS
    if proxies := tuple(part for t, part in PROXY_PARTS.items() if t in wanted):
        out["pd"] = ("prefill", "decode", *proxies)
    return out


def check(args: argparse.Namespace) -> str | None:
    """Options, then ports and model (local) or URLs and key (remote): before any file."""
    plan, short, wanted = plans(args)
    for problem in short.problems(plan) if "pd-local" in wanted else ():
        log.warning("%s", problem)
    urls = remote_urls(args, wanted)
    if any(getattr(args, o) for o in REMOTE_URLS.values()):
        if not urls:
            return "--targets leaves none of the URLs given"
        key = resolve_api_key(args, os.environ)
        for url in urls.values():
            client.served_model(url, key)  # reachable, and the key accepted
        return None
    settings = local_settings(args.port_base)
    ports = {"reference": settings.reference_port, **settings.ports(),
             FIRST_TOKEN_PROXY: settings.proxy_port + sp.FIRST_TOKEN_PROXY_OFFSET,
             LOCAL_PREFILL_PROXY: settings.proxy_port + sp.LOCAL_PREFILL_PROXY_OFFSET}  # fmt: skip
    parts = {p for ps in phases(wanted).values() for p in ps}
    ensure_ports_free(settings.host, {n: p for n, p in ports.items() if n.split()[0] in parts})
    resolve_model(settings.model, settings.served_model_name, repo_root())  # builds the tiny one
    return None


def run_target(
    target: sp.Target, workload: str, plan: sp.BenchPlan, out: Path, sources: Mapping[str, str],
    api_key: str | None,
) -> list[report.Run]:  # fmt: skip
    """Warm up, then each level of one workload against one target, /metrics read around each."""
    body = {"model": target.served_model_name, "prompt": "warm up the server " * 8,
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    for _ in range(WARMUP_REQUESTS):
        client.http(f"{target.base_url}/v1/completions", api_key, body, timeout_s=300)
    runs = []
    for level in plan.levels:
        run = report.Run(target.name, level, plan.prompts_for(level), workload)
        sizes = (run.prompts, plan.input_len, plan.output_len)
        log.info("%s: %d prompts, %d in / %d out tokens", run.name, *sizes)
        argv = sp.bench_serve_argv(target, plan, level, str(out), workload=workload)
        log_path = out / "logs" / f"{sp.run_name(target.name, level, workload)}.log"
        before = client.snapshot(sources, WANTED, api_key)
        run.returncode, run.seconds, run.timed_out = client.run_process(
            argv, log_path, client.bench_env(api_key), plan.run_timeout_s, run.name
        )
        time.sleep(SETTLE_S)
        after = client.snapshot(sources, WANTED, api_key)
        run.deltas, run.counters, run.gauges = client.grown(before, after)
        run.result = client.read_result(out / f"{sp.run_name(target.name, level, workload)}.json")
        run.log = str(log_path)
        if not run.complete:
            how = "timed out" if run.timed_out else f"exited {run.returncode}"
            log.error("%s: vllm bench serve %s; see %s", run.name, how, log_path)
        if (found := report.check(run)) is not None:
            (log.info if found.measured else log.warning)("%s: %s", run.name, found.text)
        runs.append(run)
    return runs


def run_all(
    targets: Mapping[str, tuple[sp.Target, dict[str, str]]], plan: sp.BenchPlan,
    short: sp.ShortPlan, wanted: Sequence[str], out: Path, api_key: str | None, errors: list[str],
) -> list[report.Run]:  # fmt: skip
    """Every (target, workload) these servers serve in run order; a failure does not stop it."""
    runs: list[report.Run] = []
    for name, workload, wplan in sp.run_order(list(targets), plan, short, wanted):
        target, sources = targets[name]
        try:
            runs += run_target(target, workload, wplan, out, sources, api_key)
        except BenchError as exc:
            errors.append(f"{sp.TARGET_TITLES[name]} {workload or ''}: {exc}".replace("  ", " "))
            log.error("%s", errors[-1])
    return runs


def run_local(
    args: argparse.Namespace, plan: sp.BenchPlan, short: sp.ShortPlan, wanted: Sequence[str],
    out: Path, errors: list[str],
) -> tuple[list[report.Run], dict[str, Any]]:  # fmt: skip
    """Each phase starts its servers, runs its targets and stops them; a failure is recorded."""
    settings = local_settings(args.port_base)
    runs: list[report.Run] = []
    extra: dict[str, Any] = {"startup_s": {}, "targets": {}}
    extra["settings"] = dataclasses.asdict(settings)
    for phase, parts in phases(wanted).items():
        log.info("phase %s: starting %s", phase, ", ".join(parts))
        stack = Stack(settings, parts=parts, work_dir=out / "servers" / phase,
                      local_prefill_max_tokens=short.max_tokens)  # fmt: skip
        try:
            stack.start()
            extra["startup_s"][phase] = startup_s(stack)
            model = stack.model
            assert model is not None
            extra["model"] = dataclasses.asdict(model)
            urls, targets = stack.urls, {}
            here = [t for t in sp.TARGETS if t in wanted and (t == "single") == (phase == "single")]
            for name in here:
                if name == "single":
                    url, sources = urls["reference"], {"server": urls["reference"]}
                else:
                    url = urls[PROXY_PARTS[name]]
                    sources = {"proxy": url, "prefill": urls["prefill"], "server": urls["decode"]}
                targets[name] = (sp.Target(name, url, model.served_name, model.path), sources)
                extra["targets"][name] = url
            runs += run_all(targets, plan, short, wanted, out, None, errors)
        except (StackProcessError, BenchError) as exc:
            errors.append(f"phase {phase}: {exc}")
            log.error("%s", errors[-1])
        finally:
            stack.stop()
    return runs, extra


def tokenizer_for(root: str, explicit: str | None) -> str:
    """--tokenizer, else the served model's root when it is here, else the kit's model."""
    if explicit or Path(root).expanduser().is_dir() or hf_cached(root):
        return explicit or root
    settings = settings_from_env(kit_env(os.environ))
    local = resolve_model(settings.model, settings.served_model_name, repo_root()).path
    log.warning(
        "the served model's root %r is not here: tokenizing with %s (--tokenizer)", root, local
    )
    return local


def run_remote(
    args: argparse.Namespace, plan: sp.BenchPlan, short: sp.ShortPlan, wanted: Sequence[str],
    out: Path, errors: list[str],
) -> tuple[list[report.Run], dict[str, Any]]:  # fmt: skip
    key = resolve_api_key(args, os.environ)
    urls = remote_urls(args, wanted)
    targets: dict[str, tuple[sp.Target, dict[str, str]]] = {}
    versions: dict[str, str | None] = {}
    tokenizer = None
    for name, url in urls.items():
        served, root = client.served_model(url, key)
        tokenizer = tokenizer or tokenizer_for(root, args.tokenizer)
        sources = {"server": url} if name == "single" else {"proxy": url}
        given = {"prefill": args.prefill_metrics_url, "server": args.decode_metrics_url}
        sources |= {k: u.rstrip("/") for k, u in given.items() if u and name != "single"}
        targets[name] = (sp.Target(name, url, args.served_model_name or served, tokenizer), sources)
        try:  # vLLM answers /version; pd-proxy does not
            versions[name] = str(json.loads(client.http(f"{url}/version", key))["version"])
        except (BenchError, ValueError, KeyError, TypeError):
            versions[name] = None
    runs = run_all(targets, plan, short, list(urls), out, key, errors)  # only those given
    extra = {"targets": urls, "settings": None, "server_versions": versions,
             "metrics_sources": {n: s for n, (_t, s) in targets.items()},
             "model": {"tokenizer": tokenizer}}  # fmt: skip
    return runs, extra


def run(args: argparse.Namespace, out: Path) -> Outcome:
    """Exit status 0 when every run completed all its prompts, else 1."""
    plan, short, wanted = plans(args)
    (out / "logs").mkdir()
    errors: list[str] = []
    remote = any(getattr(args, o) for o in REMOTE_URLS.values())
    runs, extra = (run_remote if remote else run_local)(args, plan, short, wanted, out, errors)
    text, result, figures = report.render(plan, short, runs, errors)
    if incomplete := [r.name for r in runs if not r.complete]:
        print(f"incomplete: {'; '.join(incomplete)} (logs in {out / 'logs'})", file=sys.stderr)
    mode = "remote" if remote else "local"
    manifest = {"mode": mode, "bench": plan.as_dict(), "short": short.as_dict(), **extra}
    return Outcome(result, text, manifest, rc=1 if incomplete or errors else 0, summary=figures)


LOCAL_PREFILL = SimpleNamespace(
    HELP="vllm bench serve, short prompts: single, P/D and P/D with --local-prefill-max-tokens",
    __doc__="""`bench serve` with the short-prompt workload: single, P/D and P/D through a pd-proxy
with --local-prefill-max-tokens N (short prompts on decode alone, long ones P/D, back to back).

    pcp-pd-kit bench local-prefill --concurrency 1
""",
    add_arguments=lambda parser: add_arguments(parser, default_targets="single,pd,pd-local"),
    check=check,
    run=run,
)
