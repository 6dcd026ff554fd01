"""Prefix caching through the kit against a single vLLM, side by side in one run.

Starts the local CPU stack with prefix caching on (PCP2 + EP2 prefill and decode publishing KV
events, the single-instance reference) and pd-proxies on their own ports, then:

1. multi-turn: conversations of two turns (a first turn of --context token ids, then the same
   plus --new ids after --think-ms); the follow-up's time to first token through a proxy with
   --prefix-cache-routing events and --local-prefill-max-tokens N (the follow-up's uncached
   tokens are below N: decode alone) against the single vLLM, both warm, at each --concurrency;
2. short prompts: text prompts of about 32 tokens at c=1 on the single vLLM, through a proxy
   counting them with decode's /tokenize and through one with the local --tokenizer;
3. shared prefixes: decode and the reference stop; two decodes with a small KV cache
   (--kv-blocks, fewer than every prefix needs) start behind two proxies, one routing by cache
   (events) and one by least outstanding requests (off), both sending every prompt to a decode
   alone (N = the decodes' max model length: the prefill takes no part, so the figures are the
   routing's alone); `vllm bench serve --dataset-name prefix_repetition` runs against them in
   alternating order, each decode's prefix cache emptied before each run. Cache-hit tokens come
   from both decodes' vllm:prefix_cache_hits_total.

Medians, and the goals, reported (never a failure). Exit 1 when a run failed.

    pcp-pd-kit bench cache                    # about 4-5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from pcp_pd_kit.bench import cache_clients as clients
from pcp_pd_kit.bench import cache_plan as cp
from pcp_pd_kit.bench import cache_report as report
from pcp_pd_kit.bench import serve_plan as spec
from pcp_pd_kit.bench.client import bench_env, run_process
from pcp_pd_kit.bench.results import Outcome
from pcp_pd_kit.localstack import commands
from pcp_pd_kit.localstack.host import ensure_ports_free
from pcp_pd_kit.localstack.model_source import ResolvedModel
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import StackSettings, kit_env, settings_from_env

HELP = "prefix caching: follow-up turns, short prompts, shared prefixes across two decodes"
log = logging.getLogger("pcp_pd_kit.bench")
STACK_PARTS = ("prefill", "decode", "proxy", "reference")
WARM_CONVERSATIONS = 2
WARM_SHORT = 3
EVENTS_SETTLE_S = 2.0  # after the proxies are healthy: their event subscriptions connect


class EventsStack(Stack):
    """The local stack with prefill and decode publishing KV events on the bench's ports."""

    def __init__(self, *args: Any, events_ports: dict[str, int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events_ports = events_ports

    def _spec(self, part: str, settings: StackSettings | None = None) -> commands.ProcessSpec:
        built = super()._spec(part, settings)
        port = self.events_ports.get(part)
        return built if port is None else cp.with_kv_events(built, port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = cp.CachePlan()
    a = parser.add_argument
    a("--concurrency", default=",".join(map(str, d.levels)), help="multi-turn levels (%(default)s)")
    a(
        "--conversations",
        type=int,
        default=d.conversations,
        help="per target and level (%(default)s)",
    )
    a("--context", type=int, default=d.context, help="first turn, token ids (%(default)s)")
    a("--new", type=int, default=d.new, help="token ids a follow-up adds (%(default)s)")
    a("--think-ms", type=float, default=d.think_ms, help="pause between turns (%(default)s)")
    a("--local-max-tokens", type=int, default=d.local_max, help="the proxies' N (%(default)s)")
    a("--short-requests", type=int, default=d.short_requests, help="per target (%(default)s)")
    a("--prefix-len", type=int, default=d.prefix_len, help="shared prefix tokens (%(default)s)")
    a("--suffix-len", type=int, default=d.suffix_len, help="(%(default)s)")
    a("--prefixes", type=int, default=d.prefixes, help="distinct prefixes (%(default)s)")
    a("--per-prefix", type=int, default=d.per_prefix, help="requests per prefix (%(default)s)")
    a("--shared-rounds", type=int, default=d.shared_rounds, help="runs per routing (%(default)s)")
    a("--kv-blocks", type=int, default=d.kv_blocks, help="each decode's KV cache (%(default)s)")
    a("--skip", default="", help="comma-separated parts not to run: multi-turn,short,shared")
    a("--port-base", type=int, default=spec.DEFAULT_PORT_BASE, help="(%(default)s)")


SKIPPABLE = ("multi-turn", "short", "shared")


def plan_from_args(args: argparse.Namespace) -> cp.CachePlan:
    try:
        levels = tuple(int(x) for x in str(args.concurrency).split(",") if x.strip())
    except ValueError:
        raise cp.CachePlanError(
            f"--concurrency {args.concurrency!r}: comma-separated integers"
        ) from None
    return dataclasses.replace(
        cp.CachePlan(),
        levels=levels,
        conversations=args.conversations,
        context=args.context,
        new=args.new,
        think_ms=args.think_ms,
        local_max=args.local_max_tokens,
        short_requests=args.short_requests,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        prefixes=args.prefixes,
        per_prefix=args.per_prefix,
        shared_rounds=args.shared_rounds,
        kv_blocks=args.kv_blocks,
    )


def skipped(args: argparse.Namespace) -> set[str]:
    return {x.strip() for x in str(args.skip).split(",") if x.strip()}


def stack_parts(skip: set[str]) -> tuple[str, ...]:
    """The stack's servers this run needs: none for the shared-prefix part alone (``--skip
    multi-turn,short``), which starts its own two decodes and proxies; they would only idle."""
    return () if {"multi-turn", "short"} <= skip else STACK_PARTS


def _settings(port_base: int) -> StackSettings:
    """The stack's settings on the bench's ports, prefix caching on, no proxy counting."""
    base = settings_from_env(kit_env(os.environ))
    return dataclasses.replace(
        base,
        **spec.bench_ports(port_base),  # type: ignore[arg-type]
        prefix_caching=True,
        local_prefill_max_tokens=0,
    )


def check(args: argparse.Namespace) -> str | None:
    try:
        plan = plan_from_args(args)
        settings = _settings(args.port_base)
    except (cp.CachePlanError, spec.BenchSpecError, ValueError) as exc:
        return str(exc)
    unknown = skipped(args) - set(SKIPPABLE)
    problems = [f"--skip {sorted(unknown)}: one of {', '.join(SKIPPABLE)}"] if unknown else []
    problems += plan.problems(settings.block_size)
    return "; ".join(problems) or None


# --- processes --------------------------------------------------------------------------------
def proxy_process(
    settings: StackSettings,
    name: str,
    port: int,
    local_max: int,
    flags: list[str],
    log_dir: Path,
    decode_only: bool = False,
) -> ManagedProcess:
    """A pd-proxy for one part. ``decode_only``: every request of the part goes to decode alone
    and no prefill runs, so the proxy's /health (503 without a healthy prefill) is not its
    readiness: /metrics answering is (its decodes are awaited beside it)."""
    s = dataclasses.replace(settings, proxy_port=port, local_prefill_max_tokens=local_max)
    built = commands.proxy_spec(s)
    if decode_only:
        built = dataclasses.replace(built, health_url=f"{s.url(port)}/metrics")
    return ManagedProcess(cp.with_flags(built, flags, name), log_dir)


def decode_process(
    settings: StackSettings,
    model: ResolvedModel,
    name: str,
    ports: tuple[int, int, int],
    cpus: str,
    plan: cp.CachePlan,
    repo: Path,
    log_dir: Path,
) -> ManagedProcess:
    """A decode of the kit (its KV connector, as a second decode replica would run) with a small
    KV cache, KV events on, and vLLM's dev endpoints (POST /reset_prefix_cache)."""
    port, side, events = ports
    s = dataclasses.replace(
        settings, decode_port=port, decode_side_channel_port=side, decode_cpus=cpus
    )
    built = commands.vllm_server_spec(s, "decode", model.path, model.served_name, repo)
    flags = ["--num-gpu-blocks-override", str(plan.kv_blocks)]
    flags += ["--max-model-len", str(plan.shared_max_model_len)]  # the last value wins
    built = cp.with_flags(built, flags, name, env={"VLLM_SERVER_DEV_MODE": "1"})
    return ManagedProcess(cp.with_kv_events(built, events), log_dir)


def start_all(procs: list[ManagedProcess], timeout_s: float) -> None:
    for proc in procs:
        proc.start()
    wait_healthy(procs, timeout_s)
    time.sleep(EVENTS_SETTLE_S)


def stop_all(procs: list[ManagedProcess]) -> None:
    for proc in procs:
        try:
            proc.stop()
        except Exception as exc:  # keep stopping the others
            log.error("stopping %s failed: %s", proc.name, exc)


# --- the three workloads ----------------------------------------------------------------------
def run_multi_turn(
    urls: dict[str, str], model: str, plan: cp.CachePlan
) -> dict[int, dict[str, Any]]:
    """Per level: both targets' follow-up TTFTs (two halves, the order swapped), counters."""
    targets = {"kit": urls["kit"], "single": urls["single"]}
    for name, url in targets.items():
        seeds = [plan.seed - 100 - 2 * i for i in range(WARM_CONVERSATIONS)]
        clients.follow_up_ttfts(url, model, seeds, plan, 1)
        log.info("multi-turn: %s warm", name)
    sources = {"proxy": urls["kit"], "decode": urls["decode"], "reference": urls["single"]}
    out: dict[int, dict[str, Any]] = {}
    for level in plan.levels:
        ttft: dict[str, list[float]] = {name: [] for name in targets}
        before = clients.snapshot(sources)
        half = plan.conversations // 2
        for part, count in enumerate((half, plan.conversations - half)):
            base = plan.seed + 100_000 * level + 10_000 * part
            seeds = [base + 2 * i for i in range(count)]
            for name in cp.rotation(list(targets), part):
                ttft[name] += clients.follow_up_ttfts(targets[name], model, seeds, plan, level)
        out[level] = {
            "ttft_s": ttft,
            "conversations": plan.conversations,
            **clients.grown(before, clients.snapshot(sources)),
        }
        log.info(
            "multi-turn c=%d: kit %.1f ms, single %.1f ms (follow-up TTFT medians)",
            level,
            report.median_ms(ttft["kit"]) or 0,
            report.median_ms(ttft["single"]) or 0,
        )
    return out


def run_short(urls: dict[str, str], model: str, plan: cp.CachePlan) -> dict[str, Any]:
    targets = {t: urls[t] for t in cp.SHORT_TARGETS}
    index = {t: i for i, t in enumerate(cp.SHORT_TARGETS)}
    for name, url in targets.items():
        for i in range(WARM_SHORT):
            text = cp.short_prompt(plan.seed - 1000 - 10 * i - index[name], plan.short_words)
            clients.http_ttft(url, clients.short_body(model, text))
    proxies = {t: targets[t] for t in ("tokenize", "tokenizer")}
    before = clients.snapshot(proxies)
    ttft: dict[str, list[float]] = {t: [] for t in targets}
    for i in range(plan.short_requests):
        for name in cp.rotation(list(targets), i):
            # A prompt of its own per request: decode serves two of the targets.
            text = cp.short_prompt(plan.seed + 10 * i + index[name], plan.short_words)
            ttft[name].append(clients.http_ttft(targets[name], clients.short_body(model, text)))
    return {
        "ttft_s": ttft,
        "requests": plan.short_requests,
        "proxies": clients.grown(before, clients.snapshot(proxies)),
    }


def run_shared(
    urls: dict[str, str], model: ResolvedModel, plan: cp.CachePlan, out: Path
) -> list[dict[str, Any]]:
    decodes = {"decode-a": urls["decode-a"], "decode-b": urls["decode-b"]}
    env = bench_env(None)
    runs = []
    for rnd in range(plan.shared_rounds):
        for mode in cp.rotation(list(cp.SHARED_MODES), rnd):
            name = f"shared-{rnd + 1}-{mode}"
            for url in decodes.values():
                clients.reset_prefix_cache(url)
            proxy = urls[f"proxy-{mode}"]
            sources = {**decodes, "proxy": proxy}
            before = clients.snapshot(sources)
            argv = cp.prefix_bench_argv(
                proxy, model.served_name, model.path, plan, plan.seed, str(out), f"{name}.json"
            )
            code, seconds, timed_out = run_process(
                argv, out / "logs" / f"{name}.log", env, plan.run_timeout_s, name
            )
            time.sleep(1.0)
            grown = clients.grown(before, clients.snapshot(sources))
            result_path = out / f"{name}.json"
            result = json.loads(result_path.read_text()) if result_path.is_file() else None
            runs.append(
                {
                    "mode": mode,
                    "round": rnd + 1,
                    "returncode": code,
                    "seconds": round(seconds, 1),
                    "timed_out": timed_out,
                    "result": None if result is None else _result_fields(result),
                    "decodes": {k: grown[k] for k in decodes},
                    "proxy": grown["proxy"],
                }
            )
            log.info(
                "%s: exit %s in %.0fs, TTFT median %s ms",
                name,
                code,
                seconds,
                None if result is None else result.get("median_ttft_ms"),
            )
    return runs


def _result_fields(result: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "completed",
        "failed",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_ttft_ms",
        "median_e2el_ms",
    )
    return {k: result.get(k) for k in keys}


# --- the kind ---------------------------------------------------------------------------------
def run(args: argparse.Namespace, out: Path) -> Outcome:
    plan = plan_from_args(args)
    skip = skipped(args)
    settings = _settings(args.port_base)
    ports = cp.ports(args.port_base)
    url = settings.url
    ensure_ports_free(
        settings.host,
        {name: port for name, port in ports.items() if not name.startswith("events-")},
    )
    log_dir = out / "servers" / "logs"
    shared_only = not stack_parts(skip)
    stack = EventsStack(
        settings,
        parts=stack_parts(skip),
        work_dir=out / "servers",
        events_ports={"prefill": ports["events-prefill"], "decode": ports["events-decode"]},
    )
    extras: list[ManagedProcess] = []
    data: dict[str, Any] = {"plan": plan.as_dict(), "errors": []}
    try:
        stack.start()
        model = stack.model
        assert model is not None
        data["startup_s"] = {k: round(v, 1) for k, v in stack.startup_seconds().items()}
        urls: dict[str, str] = {}
        if not shared_only:
            urls = {
                "single": stack.urls["reference"],
                "decode": stack.urls["decode"],
                "kit": url(ports["proxy-cache"]),
                "tokenize": url(ports["proxy-count"]),
                "tokenizer": url(ports["proxy-tokenizer"]),
            }
            n = plan.local_max
            extras = [
                proxy_process(settings, "proxy-count", ports["proxy-count"], n, [], log_dir),
                proxy_process(
                    settings,
                    "proxy-tokenizer",
                    ports["proxy-tokenizer"],
                    n,
                    cp.proxy_flags("off", model.path),
                    log_dir,
                ),
                proxy_process(
                    settings,
                    "proxy-cache",
                    ports["proxy-cache"],
                    n,
                    cp.proxy_flags(cp.CACHE_ROUTING, model.path),
                    log_dir,
                ),
            ]
            start_all(extras, settings.startup_timeout_s)
            if "multi-turn" not in skip:
                data["multi_turn"] = run_multi_turn(urls, model.served_name, plan)
            if "short" not in skip:
                data["short"] = run_short(urls, model.served_name, plan)
            stop_all(extras)
        if "shared" not in skip:
            for part in set(stack.parts) - {"prefill"}:
                stack.stop_part(part)
            urls["decode-a"], urls["decode-b"] = url(ports["decode-a"]), url(ports["decode-b"])
            urls["proxy-events"], urls["proxy-off"] = (
                url(ports["proxy-events"]),
                url(ports["proxy-off"]),
            )
            a_ports = (ports["decode-a"], ports["decode-a-side"], ports["events-decode-a"])
            b_ports = (ports["decode-b"], ports["decode-b-side"], ports["events-decode-b"])
            everything = plan.shared_max_model_len  # every prompt to a decode alone
            a_only = dataclasses.replace(settings, decode_port=ports["decode-a"])
            extras = [
                decode_process(
                    settings,
                    model,
                    "decode-a",
                    a_ports,
                    settings.decode_cpus,
                    plan,
                    stack.repo,
                    log_dir,
                ),
                decode_process(
                    settings,
                    model,
                    "decode-b",
                    b_ports,
                    settings.prefill_cpus,
                    plan,
                    stack.repo,
                    log_dir,
                ),
            ]
            extras += [
                proxy_process(
                    a_only,
                    f"proxy-{mode}",
                    ports[f"proxy-{mode}"],
                    everything,
                    cp.proxy_flags(mode, model.path, [urls["decode-b"]]),
                    log_dir,
                    decode_only=True,
                )
                for mode in cp.SHARED_MODES
            ]
            start_all(extras, settings.startup_timeout_s)
            data["added_special_tokens"] = clients.added_special_tokens(
                urls["decode-a"], model.served_name
            )
            data["shared"] = run_shared(urls, model, plan, out)
    except Exception as exc:
        log.error("bench cache failed: %s", exc)
        data["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        stop_all(extras)
        stack.stop()
    return render(data, plan, settings.block_size)


def render(data: dict[str, Any], plan: cp.CachePlan, block_size: int) -> Outcome:
    multi = report.multi_turn_rows(data.get("multi_turn", {}))
    short = report.short_rows(data["short"]) if "short" in data else []
    added = int(data.get("added_special_tokens", 1))
    ideal = cp.ideal_hit_tokens(plan, block_size, added)
    shared = report.shared_rows(data.get("shared", []), ideal)
    found = report.goals(multi, short, shared)
    text = ["## prefix caching: the kit against a single vLLM", ""]
    if multi:
        text += [report.format_multi_turn(multi, plan.context, plan.new), ""]
    if short:
        text += [report.format_short(short, plan.short_words, plan.short_requests), ""]
    if shared:
        blocks = cp.prefix_blocks(plan.prefix_len, block_size, added)
        description = (
            f"Shared prefixes, two decodes behind the proxy, every prompt on a decode alone: "
            f"{plan.prefixes} prefixes of {plan.prefix_len} tokens ({blocks} blocks) x "
            f"{plan.per_prefix} requests, {plan.suffix_len}-token suffixes, c="
            f"{plan.shared_concurrency}, {plan.kv_blocks} KV blocks per decode (every prefix "
            f"needs {plan.prefixes * blocks})"
        )
        text += [
            report.format_shared(shared, ideal, description, plan.prefixes * plan.per_prefix),
            "",
        ]
    text += [report.format_goals(found)]
    errors = list(data.get("errors", []))
    failed = [r for r in data.get("shared", []) if r.get("returncode") != 0]
    errors += [f"shared run {r['round']} ({r['mode']}): exit {r['returncode']}" for r in failed]
    if errors:
        text += ["", "errors:", *(f"- {e}" for e in errors)]
    result = {
        **data,
        "multi_turn_rows": multi,
        "short_rows": short,
        "shared_rows": shared,
        "ideal_hit_tokens": ideal,
        "goals": [{**dataclasses.asdict(g), "verdict": g.verdict} for g in found],
    }
    return Outcome(result, "\n".join(text), {"bench": plan.as_dict()}, rc=1 if errors else 0)
