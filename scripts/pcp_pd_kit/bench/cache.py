"""Prefix caching through the kit against a single vLLM, side by side in one run (docs/bench.md):
follow-up turns, short prompts, and shared prefixes across two decodes routed by cache (events)
against least outstanding (off). Medians and goals, reported (never a failure); exit 1 when a run
failed.

    pcp-pd-kit bench cache                    # about 4-5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pcp_pd_kit.bench import cache_plan as cp
from pcp_pd_kit.bench import cache_report as report
from pcp_pd_kit.bench import serve_plan as spec
from pcp_pd_kit.bench.client import Wanted, bench_env, http, read_result, run_process, scrape
from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.metrics import REQUESTS_COUNTER, counter_delta, selector
from pcp_pd_kit.bench.prefix_ttft import request_body, ttft_s
from pcp_pd_kit.bench.results import Outcome, knobs, startup_s
from pcp_pd_kit.localstack import commands
from pcp_pd_kit.localstack.host import ensure_ports_free
from pcp_pd_kit.localstack.model_source import ResolvedModel
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import StackSettings

HELP = "prefix caching: follow-up turns, short prompts, shared and held prefixes on two decodes"
log = logging.getLogger("pcp_pd_kit.bench")
STACK_PARTS = ("prefill", "decode", "proxy", "reference")
WARM_CONVERSATIONS = 2
WARM_SHORT = 3
RESULT_FIELDS = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
                 "median_e2el_ms")  # fmt: skip
EVENTS_SETTLE_S = 2.0  # after the proxies are healthy: their event subscriptions connect
CACHE_BLOCKS = "pd_proxy_cache_blocks"
EVENTS_BLOCKS = selector(CACHE_BLOCKS, {"source": "events"})
SUMMARY_KEYS = ("plan", "ideal_hit_tokens", "goals")


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
    c, d = cp.CachePlan(), "(%(default)s)"
    add_flags(parser, [
        ("--concurrency", str, ",".join(map(str, c.levels)), f"multi-turn levels {d}"),
        ("--conversations", int, c.conversations, f"per target and level {d}"),
        ("--context", int, c.context, f"first turn, token ids {d}"),
        ("--new", int, c.new, f"token ids a follow-up adds {d}"),
        ("--think-ms", float, c.think_ms, f"pause between turns {d}"),
        ("--local-max-tokens", int, c.local_max, f"the proxies' N {d}"),
        ("--short-requests", int, c.short_requests, f"per target {d}"),
        ("--prefix-len", int, c.prefix_len, f"shared prefix tokens {d}"),
        ("--suffix-len", int, c.suffix_len, d),
        ("--prefixes", int, c.prefixes, f"distinct prefixes {d}"),
        ("--per-prefix", int, c.per_prefix, f"requests per prefix {d}"),
        ("--shared-rounds", int, c.shared_rounds, f"runs per routing {d}"),
        ("--shared-concurrency", int, c.shared_concurrency, f"shared and held parts {d}"),
        ("--kv-blocks", int, c.kv_blocks, f"each decode's KV cache {d}"),
        ("--max-model-len", int, c.shared_max_model_len,
         f"the two decodes' (at most (--kv-blocks - 1) x the block size) {d}"),
        ("--skip", str, "", "comma-separated parts not to run: multi-turn,short,shared,held,full"),
        ("--port-base", int, spec.DEFAULT_PORT_BASE, d),
    ])  # fmt: skip


SKIPPABLE = ("multi-turn", "short", "shared", "held", "full")
TWO_DECODE_PARTS = {"shared", "held", "full"}


def plan_from_args(args: argparse.Namespace) -> cp.CachePlan:
    levels = spec.parse_ints(args.concurrency, "--concurrency", "comma-separated integers")
    same = ("conversations", "context", "new", "think_ms", "short_requests", "prefix_len",
            "suffix_len", "prefixes", "per_prefix", "shared_rounds", "shared_concurrency",
            "kv_blocks")  # fmt: skip
    return cp.CachePlan(levels=levels, local_max=args.local_max_tokens,
                        shared_max_model_len=args.max_model_len, **knobs(args, *same))  # fmt: skip


def skipped(args: argparse.Namespace) -> set[str]:
    return {x.strip() for x in str(args.skip).split(",") if x.strip()}


def stack_parts(skip: set[str]) -> tuple[str, ...]:
    """None for the shared-prefix part alone: it starts its own decodes and proxies."""
    return () if {"multi-turn", "short"} <= skip else STACK_PARTS


def _settings(port_base: int) -> StackSettings:
    """The stack's settings on the bench's ports, prefix caching on, no proxy counting."""
    return spec.bench_settings(port_base, prefix_caching=True, local_prefill_max_tokens=0)


def check(args: argparse.Namespace) -> str | None:
    try:
        plan = plan_from_args(args)
        settings = _settings(args.port_base)
    except (spec.BenchSpecError, ValueError) as exc:
        return str(exc)
    unknown = skipped(args) - set(SKIPPABLE)
    problems = [f"--skip {sorted(unknown)}: one of {', '.join(SKIPPABLE)}"] if unknown else []
    problems += plan.problems(settings.block_size)
    return "; ".join(problems) or None


# --- processes --------------------------------------------------------------------------------
def proxy_process(
    settings: StackSettings, name: str, port: int, local_max: int, flags: list[str],
    log_dir: Path, decode_only: bool = False,
) -> ManagedProcess:  # fmt: skip
    """A pd-proxy; ``decode_only``: no prefill runs (/health is 503), /metrics is its readiness."""
    s = dataclasses.replace(settings, proxy_port=port, local_prefill_max_tokens=local_max)
    built = commands.proxy_spec(s)
    if decode_only:
        built = dataclasses.replace(built, health_url=f"{s.url(port)}/metrics")
    return ManagedProcess(cp.with_flags(built, flags, name), log_dir)


def decode_process(
    settings: StackSettings, model: ResolvedModel, name: str, ports: tuple[int, int, int],
    cpus: str, plan: cp.CachePlan, repo: Path, log_dir: Path,
) -> ManagedProcess:  # fmt: skip
    """A decode of the kit with a small KV cache, KV events and POST /reset_prefix_cache."""
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


# --- clients: blocking HTTP, one thread per concurrent conversation ---------------------------
COUNTERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (REQUESTS_COUNTER, ("path",)),
    ("vllm:prefix_cache_hits_total", ()),
    ("vllm:prefix_cache_queries_total", ()),
    ("vllm:prompt_tokens_by_source_total", ("source",)),
    ("vllm:request_success_total", ()),
)
Counters = dict[str, float]


def follow_up_ttfts(
    url: str, model: str, seeds: Sequence[int], plan: cp.CachePlan, concurrency: int,
    send: Callable[[str, dict[str, object]], float] = ttft_s,
) -> list[float]:  # fmt: skip
    """One conversation per seed, ``concurrency`` at a time: the follow-ups' TTFTs (s)."""

    def one(seed: int) -> float:
        first, follow_up = cp.conversation(seed, plan.context, plan.new)
        send(url, request_body(model, first, None))
        time.sleep(plan.think_ms / 1000)
        return send(url, request_body(model, follow_up, None))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, seeds))


def counters(url: str) -> Counters:
    """The COUNTERS of one /metrics page, keyed by selector; {} when it cannot be read."""
    page = scrape(url, "", Wanted(counters={"": COUNTERS}))
    return {k: v for c in (page.counters.values() if page else ()) for k, v in (c or {}).items()}


def snapshot(sources: Mapping[str, str]) -> dict[str, Counters]:
    return {name: counters(url) for name, url in sources.items()}


def counter_growth(
    before: Mapping[str, Counters], after: Mapping[str, Counters]
) -> dict[str, Counters]:
    """source -> selector -> growth (metrics.counter_delta per source)."""
    return {s: counter_delta(later, before.get(s)) or {} for s, later in after.items()}


def reset_prefix_cache(url: str, tries: int = 20) -> None:
    """Empty a server's prefix cache; retried while blocks are still held."""
    for _ in range(tries):
        text = http(f"{url}/reset_prefix_cache", None, {})
        try:
            ok = json.loads(text).get("success", True) if text.strip() else True
        except ValueError:
            ok = True
        if ok:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: the prefix cache could not be reset")


def added_special_tokens(url: str, model: str) -> int:
    """How many tokens the tokenizer adds to a completion prompt (a BOS): /tokenize of ''."""
    return int(json.loads(http(f"{url}/tokenize", None, {"model": model, "prompt": ""}))["count"])


# --- the three workloads ----------------------------------------------------------------------
def run_multi_turn(
    urls: dict[str, str], model: str, plan: cp.CachePlan
) -> dict[int, dict[str, Any]]:
    """Per level: both targets' follow-up TTFTs (two halves, the order swapped), counters."""
    targets = {"kit": urls["kit"], "single": urls["single"]}
    for name, url in targets.items():
        seeds = [plan.seed - 100 - 2 * i for i in range(WARM_CONVERSATIONS)]
        follow_up_ttfts(url, model, seeds, plan, 1)
        log.info("multi-turn: %s warm", name)
    sources = {"proxy": urls["kit"], "decode": urls["decode"], "reference": urls["single"]}
    out: dict[int, dict[str, Any]] = {}
    for level in plan.levels:
        ttft: dict[str, list[float]] = {name: [] for name in targets}
        before = snapshot(sources)
        half = plan.conversations // 2
        for part, count in enumerate((half, plan.conversations - half)):
            base = plan.seed + 100_000 * level + 10_000 * part
            seeds = [base + 2 * i for i in range(count)]
            for name in cp.rotation(list(targets), part):
                ttft[name] += follow_up_ttfts(targets[name], model, seeds, plan, level)
        growth = counter_growth(before, snapshot(sources))
        out[level] = {"ttft_s": ttft, "conversations": plan.conversations, **growth}
        kit, single = (report.median_ms(ttft[t]) or 0 for t in ("kit", "single"))
        log.info("multi-turn c=%d: kit %.1f ms, single %.1f ms (follow-up TTFT medians)",
                 level, kit, single)  # fmt: skip
    return out


def run_short(urls: dict[str, str], model: str, plan: cp.CachePlan) -> dict[str, Any]:
    targets = {t: urls[t] for t in cp.SHORT_TARGETS}
    index = {t: i for i, t in enumerate(cp.SHORT_TARGETS)}
    for name, url in targets.items():
        for i in range(WARM_SHORT):
            text = cp.short_prompt(plan.seed - 1000 - 10 * i - index[name], plan.short_words)
            ttft_s(url, request_body(model, text, None))
    proxies = {t: targets[t] for t in ("tokenize", "tokenizer")}
    before = snapshot(proxies)
    ttft: dict[str, list[float]] = {t: [] for t in targets}
    for i in range(plan.short_requests):
        for name in cp.rotation(list(targets), i):
            # A prompt of its own per request: decode serves two of the targets.
            text = cp.short_prompt(plan.seed + 10 * i + index[name], plan.short_words)
            ttft[name].append(ttft_s(targets[name], request_body(model, text, None)))
    growth = counter_growth(before, snapshot(proxies))
    return {"ttft_s": ttft, "requests": plan.short_requests, "proxies": growth}


def run_shared(
    urls: dict[str, str], model: ResolvedModel, plan: cp.CachePlan, out: Path
) -> list[dict[str, Any]]:
    decodes = {"decode-a": urls["decode-a"], "decode-b": urls["decode-b"]}
    runs = []
    for rnd in range(plan.shared_rounds):
        for mode in cp.rotation(list(cp.SHARED_MODES), rnd):
            name = f"shared-{rnd + 1}-{mode}"
            for url in decodes.values():
                reset_prefix_cache(url)
            proxy = urls[f"proxy-{mode}"]
            sources = {**decodes, "proxy": proxy}
            before = snapshot(sources)
            argv = cp.prefix_bench_argv(
                proxy, model.served_name, model.path, plan, plan.seed, str(out), f"{name}.json"
            )
            code, seconds, timed_out = run_process(
                argv, out / "logs" / f"{name}.log", bench_env(None), plan.run_timeout_s, name
            )
            time.sleep(1.0)
            growth = counter_growth(before, snapshot(sources))
            result = read_result(out / f"{name}.json")
            fields = None if result is None else {k: result.get(k) for k in RESULT_FIELDS}
            runs.append({"mode": mode, "round": rnd + 1, "returncode": code,
                         "seconds": round(seconds, 1), "timed_out": timed_out, "result": fields,
                         "decodes": {k: growth[k] for k in decodes},
                         "proxy": growth["proxy"]})  # fmt: skip
            ttft = None if result is None else result.get("median_ttft_ms")
            log.info("%s: exit %s in %.0fs, TTFT median %s ms", name, code, seconds, ttft)
    return runs


def wait_for_events(proxy: str, blocks: int, timeout_s: float = 20.0) -> None:
    """Until the proxy's index holds ``blocks`` blocks learnt from KV events (the warm-up's)."""
    wanted, key = Wanted(counters={"": ((CACHE_BLOCKS, ("source",)),)}), EVENTS_BLOCKS
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = scrape(proxy, "", wanted)
        if page and (page.counters.get(CACHE_BLOCKS) or {}).get(key, 0.0) >= blocks:
            return
        time.sleep(0.2)
    log.warning("%s: the index holds fewer than %d blocks from KV events", proxy, blocks)


def run_held(
    urls: dict[str, str], model: str, plan: cp.CachePlan, block_size: int,
    fresh: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Caches holding every prefix (prefix i warmed on decode i % 2), then the same requests
    through the cache-aware proxy and from a client sending each prefix to its holder itself.
    With ``fresh`` (full caches): no warm-up, empty caches, and ``fresh`` restarts the proxy
    before its runs: where new prefixes go, and stay while the caches thrash, decides the hits."""
    decodes = {"decode-a": urls["decode-a"], "decode-b": urls["decode-b"]}
    holders = list(decodes.values())
    blocks = plan.prefixes * cp.prefix_blocks(plan.prefix_len, block_size, 0)  # the warm-up's
    part = "held" if fresh is None else "full"
    runs = []
    for rnd in range(plan.shared_rounds):
        requests = cp.held_requests(plan, rnd)
        for arm in cp.rotation(list(cp.HELD_ARMS), rnd):
            for url in holders:
                reset_prefix_cache(url)
            if fresh is None:
                for i in range(plan.prefixes):
                    ttft_s(holders[i % 2], request_body(model, cp.held_prefix(plan, i), None))
                wait_for_events(urls["proxy-events"], blocks)  # the proxy has heard the warm-up
            elif arm == "kit":
                fresh()

            def one(req: tuple[int, list[int]], arm: str = arm) -> float:
                url = urls["proxy-events"] if arm == "kit" else holders[req[0] % 2]
                return ttft_s(url, request_body(model, req[1], None))

            before = snapshot(decodes)
            with ThreadPoolExecutor(max_workers=plan.shared_concurrency) as pool:
                ttfts = list(pool.map(one, requests))
            time.sleep(1.0)
            runs.append({"arm": arm, "round": rnd + 1, "ttft_s": ttfts,
                         "concurrency": plan.shared_concurrency,
                         "decodes": counter_growth(before, snapshot(decodes))})  # fmt: skip
            log.info("%s-%d-%s: TTFT median %.1f ms", part, rnd + 1, arm,
                     report.median_ms(ttfts))  # fmt: skip
    return runs


def restart(proc: ManagedProcess, timeout_s: float) -> None:
    """A fresh process in place of ``proc`` (its own index, pending entries and rotation)."""
    proc.stop(grace_s=10)
    start_all([proc], timeout_s)


# --- the kind ---------------------------------------------------------------------------------
def run(args: argparse.Namespace, out: Path) -> Outcome:
    plan, skip, settings = plan_from_args(args), skipped(args), _settings(args.port_base)
    ports, url = spec.bench_ports(args.port_base, cp.PORT_OFFSETS), settings.url
    checked = {n: p for n, p in ports.items() if not n.startswith("events-")}
    ensure_ports_free(settings.host, checked)
    log_dir = out / "servers" / "logs"
    events = {"prefill": ports["events-prefill"], "decode": ports["events-decode"]}
    stack = EventsStack(settings, parts=stack_parts(skip), work_dir=out / "servers",
                        events_ports=events)  # fmt: skip
    extras: list[ManagedProcess] = []
    data: dict[str, Any] = {"plan": plan.as_dict(), "errors": []}
    try:
        stack.start()
        model = stack.model
        assert model is not None
        data["startup_s"] = startup_s(stack)
        urls: dict[str, str] = {}
        if stack_parts(skip):
            urls = {"single": stack.urls["reference"], "decode": stack.urls["decode"],
                    "kit": url(ports["proxy-cache"]), "tokenize": url(ports["proxy-count"]),
                    "tokenizer": url(ports["proxy-tokenizer"])}  # fmt: skip
            flags = {"proxy-count": [], "proxy-tokenizer": cp.proxy_flags("off", model.path),
                     "proxy-cache": cp.proxy_flags(cp.CACHE_ROUTING, model.path)}  # fmt: skip
            extras = [proxy_process(settings, name, ports[name], plan.local_max, f, log_dir)
                      for name, f in flags.items()]  # fmt: skip
            start_all(extras, settings.startup_timeout_s)
            if "multi-turn" not in skip:
                data["multi_turn"] = run_multi_turn(urls, model.served_name, plan)
            if "short" not in skip:
                data["short"] = run_short(urls, model.served_name, plan)
            stop_all(extras)
        if not TWO_DECODE_PARTS <= skip:
            for part in set(stack.parts) - {"prefill"}:
                stack.stop_part(part)
            urls.update(
                {n: url(ports[n]) for n in ("decode-a", "decode-b", "proxy-events", "proxy-off")}
            )
            cpus = {"decode-a": settings.decode_cpus,
                    "decode-b": commands.prefill_rank0_cpus(settings)}  # fmt: skip
            extras = [decode_process(settings, model, n, (ports[n], ports[f"{n}-side"],
                                     ports[f"events-{n}"]), c, plan, stack.repo, log_dir)
                      for n, c in cpus.items()]  # fmt: skip
            # every prompt to a decode alone: N is the decodes' max model length
            a_only = dataclasses.replace(settings, decode_port=ports["decode-a"])
            extras += [proxy_process(a_only, f"proxy-{mode}", ports[f"proxy-{mode}"],
                                     plan.shared_max_model_len,
                                     cp.proxy_flags(mode, model.path, [urls["decode-b"]]),
                                     log_dir, decode_only=True)
                       for mode in cp.SHARED_MODES]  # fmt: skip
            start_all(extras, settings.startup_timeout_s)
            data["added_special_tokens"] = added_special_tokens(urls["decode-a"], model.served_name)
            if "shared" not in skip:
                data["shared"] = run_shared(urls, model, plan, out)
            if "held" not in skip:
                data["held"] = run_held(urls, model.served_name, plan, settings.block_size)
            if "full" not in skip:
                proxy = next(p for p in extras if p.name == "proxy-events")
                fresh = functools.partial(restart, proxy, settings.startup_timeout_s)
                data["full"] = run_held(urls, model.served_name, plan, settings.block_size, fresh)
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
    held_ideal = cp.held_ideal(plan, block_size)
    full = report.full_rows(data.get("full", []), held_ideal)
    held = report.held_rows(data.get("held", []), held_ideal)
    found = report.goals(multi, short, shared, held, full)
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
        prompts = plan.prefixes * plan.per_prefix
        text += [report.format_shared(shared, ideal, description, prompts), ""]
    if held:
        text += [report.format_held(held, plan), ""]
    if full:
        text += [report.format_full(full, plan), ""]
    text += [report.format_goals(found)]
    errors = list(data.get("errors", []))
    failed = [r for r in data.get("shared", []) if r.get("returncode") != 0]
    errors += [f"shared run {r['round']} ({r['mode']}): exit {r['returncode']}" for r in failed]
    if errors:
        text += ["", "errors:", *(f"- {e}" for e in errors)]
    goals = [{**dataclasses.asdict(g), "verdict": g.verdict} for g in found]
    result = {**data, "multi_turn_rows": multi, "short_rows": short, "shared_rows": shared,
              "held_rows": held, "full_rows": full, "ideal_hit_tokens": ideal,
              "goals": goals}  # fmt: skip
    # The summary keeps the figures, not every request's TTFT.
    figures = {k: v for k, v in result.items() if k.endswith("_rows") or k in SUMMARY_KEYS}
    figures["errors"] = errors
    return Outcome(result, "\n".join(text), {"bench": plan.as_dict()}, int(bool(errors)), figures)
