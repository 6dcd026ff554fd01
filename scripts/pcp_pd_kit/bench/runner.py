"""Run the serving benchmark: start what is needed (or nothing), run each level, write results.

Local mode (no --base-url/--single-url): one plain vLLM instance first, alone, then the P/D pair
with pd-proxy, a second pd-proxy with --local-prefill-max-tokens and a third with
--first-token-from-prefill in front of the same pair (no Prometheus: the histograms are read from
/metrics directly), each phase stopped before the next starts, so at most two servers share the
cores (spec.run_order says which workload runs on which target, and when). Remote mode benchmarks
the URLs given and starts nothing. Either way each `vllm bench serve` runs in its own process
group, killed on a timeout or Ctrl-C, and the stack is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.bench import local_prefill, spec, tables
from pcp_pd_kit.bench import manifest as manifest_mod
from pcp_pd_kit.bench import results as layout
from pcp_pd_kit.bench.histograms import (
    Histogram,
    counter_delta,
    counter_values,
    delta,
    gauge_max,
    histogram,
)
from pcp_pd_kit.localstack.host import ensure_ports_free
from pcp_pd_kit.localstack.model_source import hf_cached, resolve_model
from pcp_pd_kit.localstack.process import StackProcessError, parent_death_preexec, signal_group
from pcp_pd_kit.localstack.report import parse_metrics
from pcp_pd_kit.localstack.stack import (
    FIRST_TOKEN_PROXY,
    LOCAL_PREFILL_PROXY,
    REFERENCE_PARTS,
    Stack,
)
from pcp_pd_kit.settings import StackSettings

log = logging.getLogger("pcp_pd_kit.localstack")
SETTLE_S = 1.0  # after a run, before the "after" scrape: the last request's observations land
HEARTBEAT_S = 30.0
WARMUP_REQUESTS = 2
PD_PARTS = ("prefill", "decode", "proxy")
# Local phases: the targets each one serves (pd, pd-local and pd-ft share one prefill + decode;
# the order of their runs: spec.run_order).
PHASE_TARGETS = {"single": ("single",), "pd": ("pd", "pd-local", "pd-ft")}
# The pd-proxy each P/D target goes through, by local stack part.
PROXY_PARTS = {"pd": "proxy", "pd-local": LOCAL_PREFILL_PROXY, "pd-ft": FIRST_TOKEN_PROXY}
BENCH_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class BenchError(RuntimeError):
    """The bench cannot run (a target unreachable, a bad option); one clear line."""


@dataclass
class RunRecord:
    """One `vllm bench serve` invocation and what it left behind."""

    target: str
    level: int
    prompts: int
    returncode: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    result_path: str = ""
    log_path: str = ""
    result: dict[str, Any] | None = None
    deltas: dict[str, dict[str, Histogram | None]] = field(default_factory=dict)
    # source -> counter series -> growth over the run; source -> gauge -> value after it
    counters: dict[str, dict[str, float] | None] = field(default_factory=dict)
    gauges: dict[str, dict[str, float | None]] = field(default_factory=dict)
    workload: str = spec.MAIN  # "" the main workload; spec.SHORT, spec.LONG: issue 27's runs

    @property
    def complete(self) -> bool:
        done = tables.value(self.result, "completed")
        return self.returncode == 0 and done is not None and int(done) == self.prompts

    def summary(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "workload": self.workload or "main",
            "concurrency": self.level,
            "prompts": self.prompts,
            "returncode": self.returncode,
            "seconds": round(self.seconds, 1),
            "timed_out": self.timed_out,
            "complete": self.complete,
            "delivery": _asdict_or_none(tables.delivery(self.result)),
            "counters": self.counters,
            "gauges": self.gauges,
            "result_file": self.result_path,
            "log": self.log_path,
        }


def _asdict_or_none(obj: Any) -> dict[str, Any] | None:
    return None if obj is None else dataclasses.asdict(obj)


# --- HTTP with the client key ------------------------------------------------------------------
def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _http(
    url: str,
    api_key: str | None,
    payload: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> str:
    headers = _auth_headers(api_key)
    data = None
    if payload is not None:
        data = json.dumps(payload).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        hint = ""
        if exc.code == 401:
            hint = " (the endpoint wants a key: --api-key, --api-key-file or OPENAI_API_KEY)"
        raise BenchError(f"{url}: HTTP {exc.code}{hint}: {body}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchError(f"{url}: no answer: {exc}") from None


def served_model(base_url: str, api_key: str | None) -> tuple[str, str]:
    """(id, root) of the first model /v1/models lists: the served name and where it came from."""
    url = f"{base_url.rstrip('/')}/v1/models"
    text = _http(url, api_key)
    try:
        first = json.loads(text)["data"][0]
        return str(first["id"]), str(first.get("root") or first["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{url}: no model listed: {text[:300]}") from None


def warm_up(target: spec.Target, api_key: str | None) -> None:
    """A few short requests first: the first P/D request also does the NIXL handshake."""
    url = f"{target.base_url.rstrip('/')}/v1/completions"
    payload = {
        "model": target.served_model_name,
        "prompt": "warm up the server before measuring " * 4,
        "max_tokens": 4,
        "temperature": 0,
    }
    for _ in range(WARMUP_REQUESTS):
        _http(url, api_key, payload, timeout_s=300)


@dataclass
class Scrape:
    """What one /metrics page held of what the bench reads: histograms (by name or selector),
    counters (selector -> value, per label set kept) and gauges (largest value)."""

    histograms: dict[str, Histogram | None] = field(default_factory=dict)
    counters: dict[str, dict[str, float] | None] = field(default_factory=dict)
    gauges: dict[str, float | None] = field(default_factory=dict)


def scrape(url: str, source: str, api_key: str | None) -> Scrape | None:
    """The metrics the bench reads from `source` at url/metrics; None when it cannot be read."""
    try:
        samples = parse_metrics(_http(f"{url.rstrip('/')}/metrics", api_key, timeout_s=10))
    except (BenchError, ValueError) as exc:
        log.warning("cannot read %s/metrics (breakdown rows from it will be n/a): %s", url, exc)
        return None
    return Scrape(
        {name: histogram(samples, name) for name in tables.breakdown_metrics().get(source, ())},
        {
            name: counter_values(samples, name, keep)
            for name, keep in tables.counter_metrics().get(source, ())
        },
        {name: gauge_max(samples, name) for name in tables.gauge_metrics().get(source, ())},
    )


def snapshot(sources: Mapping[str, str], api_key: str | None) -> dict[str, Scrape | None]:
    return {source: scrape(url, source, api_key) for source, url in sources.items()}


def deltas_between(
    before: Mapping[str, Scrape | None], after: Mapping[str, Scrape | None]
) -> dict[str, dict[str, Histogram | None]]:
    out: dict[str, dict[str, Histogram | None]] = {}
    for source, later in after.items():
        earlier = before.get(source)
        if later is None or earlier is None:
            continue
        out[source] = {
            name: delta(hist, earlier.histograms.get(name))
            for name, hist in later.histograms.items()
        }
    return out


def counter_deltas_between(
    before: Mapping[str, Scrape | None], after: Mapping[str, Scrape | None]
) -> dict[str, dict[str, float] | None]:
    """source -> counter series -> growth over the run (all counters of a source merged)."""
    out: dict[str, dict[str, float] | None] = {}
    for source, later in after.items():
        earlier = before.get(source)
        if later is None or earlier is None or not later.counters:
            continue
        merged: dict[str, float] = {}
        found = False
        for name, values in later.counters.items():
            grown = counter_delta(values, earlier.counters.get(name))
            if grown is not None:
                merged.update(grown)
                found = True
        out[source] = merged if found else None
    return out


def gauges_after(after: Mapping[str, Scrape | None]) -> dict[str, dict[str, float | None]]:
    return {source: dict(s.gauges) for source, s in after.items() if s is not None and s.gauges}


# --- one vllm bench serve process ----------------------------------------------------------------
def run_bench_process(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str], timeout_s: float, what: str
) -> tuple[int | None, float, bool]:
    """Run argv in its own process group with output to log_path; (returncode, seconds, timed out).

    A heartbeat is logged while it runs; on timeout or Ctrl-C the whole group is killed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "ab") as out:
        out.write(f"=== {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_preexec(),
        )
    try:
        last_beat = start
        while True:
            try:
                code = proc.wait(timeout=1.0)
                return code, time.monotonic() - start, False
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - start > timeout_s:
                log.error("%s still running after %.0fs: killing it", what, timeout_s)
                return None, now - start, True
            if now - last_beat >= HEARTBEAT_S:
                last_beat = now
                log.info("  %s: running, %.0fs", what, now - start)
    finally:
        # On timeout or Ctrl-C the leader; after a normal exit any leftover of its group.
        signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit after SIGKILL", what, proc.pid)


def bench_env(api_key: str | None) -> dict[str, str]:
    """The bench client's environment: offline, and OPENAI_API_KEY only when a key is given."""
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env.update(BENCH_ENV)
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # vllm bench serve sends it as Authorization: Bearer
    return env


def run_target(
    target: spec.Target,
    plan: spec.BenchPlan,
    out_dir: Path,
    sources: Mapping[str, str],
    api_key: str | None,
    workload: str = spec.MAIN,
) -> list[RunRecord]:
    """Warm up, then every concurrency level against one target, reading /metrics around each."""
    title = spec.TARGET_TITLES[target.name] + (f" ({workload})" if workload else "")
    log.info("%s: warming up %s (%d requests)", title, target.base_url, WARMUP_REQUESTS)
    warm_up(target, api_key)
    env = bench_env(api_key)
    records = []
    for index, level in enumerate(plan.levels, 1):
        record = RunRecord(target.name, level, plan.prompts_for(level), workload=workload)
        what = f"{title} c={level}"
        log.info(
            "%s [%d/%d]: %d prompts, %d in / %d out tokens, max concurrency %d",
            what,
            index,
            len(plan.levels),
            record.prompts,
            plan.input_len,
            plan.output_len,
            level,
        )
        argv = spec.bench_serve_argv(target, plan, level, str(out_dir), workload=workload)
        log_path = out_dir / "logs" / f"{spec.run_name(target.name, level, workload)}.log"
        result_path = out_dir / spec.result_filename(target.name, level, workload)
        before = snapshot(sources, api_key)
        code, seconds, timed_out = run_bench_process(argv, log_path, env, plan.run_timeout_s, what)
        time.sleep(SETTLE_S)
        after = snapshot(sources, api_key)
        record.returncode, record.seconds, record.timed_out = code, seconds, timed_out
        record.log_path, record.deltas = str(log_path), deltas_between(before, after)
        record.counters = counter_deltas_between(before, after)
        record.gauges = gauges_after(after)
        if result_path.is_file():
            record.result_path = str(result_path)
            try:
                record.result = json.loads(result_path.read_text())
            except ValueError as exc:
                log.error("%s: unreadable result %s: %s", what, result_path, exc)
        if record.result is None or code != 0:
            log.error(
                "%s: vllm bench serve %s; see %s",
                what,
                "timed out" if timed_out else f"exited {code}",
                log_path,
            )
        else:
            r = record.result
            log.info(
                "%s: %s done in %.0fs: %s req/s, %s output tok/s, TTFT median %s ms",
                what,
                tables.completed_text(r, record.prompts),
                seconds,
                tables.fmt_num(tables.value(r, "request_throughput")),
                tables.fmt_num(tables.value(r, "output_throughput")),
                tables.fmt_num(tables.value(r, "median_ttft_ms")),
            )
        if target.name == "pd-ft":
            check = tables.first_token_check(record.counters, record.result)
            (log.info if check.measured else log.warning)(
                "%s: first-token proxy: %s", what, check.text()
            )
        if target.name == "pd-local":
            expected = "local" if workload == spec.SHORT else "pd"
            path = local_prefill.path_check(record.counters, record.result, expected)
            (log.info if path.measured else log.warning)(
                "%s: local-prefill proxy: %s", what, path.text()
            )
        records.append(record)
    return records


# --- the two modes ------------------------------------------------------------------------------
@dataclass
class Outcome:
    records: list[RunRecord] = field(default_factory=list)
    targets: dict[str, str] = field(default_factory=dict)
    topology: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _phase_parts(phase: str, wanted: Sequence[str]) -> tuple[str, ...]:
    """The local stack's parts for one phase: the single instance, or prefill + decode with a
    pd-proxy per P/D target wanted (pd: the normal one; pd-local: one with
    --local-prefill-max-tokens, pd-ft: one with --first-token-from-prefill, each on its own
    port)."""
    if phase == "single":
        return REFERENCE_PARTS
    proxies = tuple(part for target, part in PROXY_PARTS.items() if target in wanted)
    return ("prefill", "decode", *proxies)


def _first_token_port(settings: StackSettings) -> int:
    """The first-token pd-proxy's port: the bench's proxy port + spec.FIRST_TOKEN_PROXY_OFFSET."""
    return settings.proxy_port + spec.FIRST_TOKEN_PROXY_OFFSET


def _local_prefill_port(settings: StackSettings) -> int:
    """The local-prefill pd-proxy's port: the bench's proxy port + its offset."""
    return settings.proxy_port + spec.LOCAL_PREFILL_PROXY_OFFSET


def prepare_local(settings: StackSettings, port_base: int, wanted: Sequence[str]) -> StackSettings:
    """The bench's settings (own ports), checked before anything starts or any file is written.

    Every port of every phase must be free and the model must resolve; a failure raises the
    stack's own error (PortInUseError, ModelNotAvailableError), which the CLI turns into exit 2.
    The normal and first-token proxies get --local-prefill-max-tokens 0 whatever the settings
    say (LOCAL_PREFILL_MAX_TOKENS): their columns are P/D for every prompt. Cache-aware routing
    is off here (PREFIX_CACHE_ROUTING): the workloads repeat their prompts across targets, so
    with it the local-prefill proxy would send long prompts decode already holds to decode
    alone, and its table is about prompt length; `bench cache` measures the cache.
    """
    try:
        ports = spec.bench_ports(port_base)
    except spec.BenchSpecError as exc:
        raise BenchError(str(exc)) from None
    settings = dataclasses.replace(
        settings,
        **ports,  # type: ignore[arg-type]
        local_prefill_max_tokens=0,
        prefix_cache_routing="off",
    )
    parts = {
        p
        for phase, targets in PHASE_TARGETS.items()
        if set(targets) & set(wanted)
        for p in _phase_parts(phase, wanted)
    }
    every = {
        "reference": settings.reference_port,
        **settings.ports(),
        FIRST_TOKEN_PROXY: _first_token_port(settings),
        LOCAL_PREFILL_PROXY: _local_prefill_port(settings),
    }
    needed = {name: port for name, port in every.items() if name.split()[0] in parts}
    ensure_ports_free(settings.host, needed)
    resolve_model(settings.model, settings.served_model_name, repo_root())  # builds the tiny one
    return settings


def run_local(
    settings: StackSettings,
    plan: spec.BenchPlan,
    out_dir: Path,
    wanted: Sequence[str],
    short: spec.ShortPlan,
) -> Outcome:
    """Each phase starts its servers, runs every workload of each of its targets, stops them; a
    phase that fails to start is recorded and the next one still runs."""
    outcome = Outcome(
        topology=manifest_mod.local_topology(
            settings, _first_token_port(settings), _local_prefill_port(settings), short.max_tokens
        )
    )
    startup: dict[str, dict[str, float]] = {}
    phases = [p for p, targets in PHASE_TARGETS.items() if set(targets) & set(wanted)]
    for number, name in enumerate(phases, 1):
        targets = [t for t in PHASE_TARGETS[name] if t in wanted]
        what = (
            f"single vLLM instance (cpus {settings.prefill_cpus})"
            if name == "single"
            else (
                f"P/D: prefill (cpus {settings.prefill_cpus}) + decode "
                f"(cpus {settings.decode_cpus}) + pd-proxy"
            )
        )
        if "pd-local" in targets:
            what += f" + one with --local-prefill-max-tokens {short.max_tokens}"
        if "pd-ft" in targets:
            what += " + one with --first-token-from-prefill"
        log.info("phase %d/%d: starting %s", number, len(phases), what)
        # The servers' logs go with the results: out_dir/servers/<single|pd>/logs/.
        stack = Stack(
            settings,
            parts=_phase_parts(name, wanted),
            work_dir=out_dir / "servers" / name,
            first_token_proxy_port=_first_token_port(settings),
            local_prefill_proxy_port=_local_prefill_port(settings),
            local_prefill_max_tokens=short.max_tokens,
        )
        try:
            stack.start()
            startup[name] = {k: round(v, 1) for k, v in stack.startup_seconds().items()}
            log.info(
                "phase %d/%d: up (%s)",
                number,
                len(phases),
                ", ".join(f"{k} {v:.0f}s" for k, v in startup[name].items()),
            )
            urls = stack.urls
            assert stack.model is not None
            outcome.extra["model"] = dataclasses.asdict(stack.model)
            found: dict[str, tuple[spec.Target, dict[str, str]]] = {}
            for target_name in targets:
                if target_name == "single":
                    target_url, sources = urls["reference"], {"single": urls["reference"]}
                else:
                    proxy = urls[PROXY_PARTS[target_name]]
                    target_url = proxy
                    sources = {"proxy": proxy, "prefill": urls["prefill"], "decode": urls["decode"]}
                target = spec.Target(
                    target_name, target_url, stack.model.served_name, stack.model.path
                )
                outcome.targets[target_name] = target_url
                found[target_name] = (target, sources)
            for target_name, workload, wplan in spec.run_order(targets, plan, short, wanted):
                target, sources = found[target_name]
                try:
                    outcome.records += run_target(
                        target, wplan, out_dir, sources, api_key=None, workload=workload
                    )
                except BenchError as exc:  # the other runs of the phase still go
                    title = spec.TARGET_TITLES[target_name] + (f" ({workload})" * bool(workload))
                    log.error("%s failed: %s", title, exc)
                    outcome.errors.append(f"{title}: {exc}")
        except (StackProcessError, BenchError) as exc:
            log.error("phase %d/%d (%s) failed: %s", number, len(phases), name, exc)
            outcome.errors.append(f"{spec.TARGET_TITLES[name]}: {exc}")
        finally:
            log.info("phase %d/%d: stopping %s", number, len(phases), name)
            stack.stop()
    outcome.extra["startup_s"] = startup
    return outcome


def remote_tokenizer(root: str, explicit: str | None, settings: StackSettings) -> str:
    """--tokenizer, else the served model's root when it is here, else the kit's model."""
    if explicit:
        return explicit
    if Path(root).expanduser().is_dir() or hf_cached(root):
        return root
    local = resolve_model(settings.model, settings.served_model_name, repo_root())
    log.warning(
        "the served model's root %r is not on this machine: tokenizing with %s "
        "(--tokenizer sets another)",
        root,
        local.path,
    )
    return local.path


@dataclass
class RemotePlan:
    """The targets of a running deployment, checked (models listed, key accepted) up front."""

    targets: list[spec.Target]
    sources: dict[str, dict[str, str]]
    topology: dict[str, Any]
    server_versions: dict[str, str | None]


def prepare_remote(
    settings: StackSettings, args: argparse.Namespace, api_key: str | None, wanted: Sequence[str]
) -> RemotePlan:
    """Ask each URL for its model (this also checks the key) before any file is written."""
    urls = {
        "pd": args.base_url,
        "single": args.single_url,
        "pd-ft": args.first_token_url,
        "pd-local": args.local_prefill_url,
    }
    urls = {k: v.rstrip("/") for k, v in urls.items() if v and k in wanted}
    if not urls:
        raise BenchError(
            "--targets leaves none of the URLs given (--base-url: pd, --single-url: single, "
            "--first-token-url: pd-ft, --local-prefill-url: pd-local)"
        )
    tokenizer: str | None = None
    targets: list[spec.Target] = []
    sources: dict[str, dict[str, str]] = {}
    versions: dict[str, str | None] = {}
    for name in spec.TARGETS:
        if name not in urls:
            continue
        served, root = served_model(urls[name], api_key)
        if tokenizer is None:
            tokenizer = remote_tokenizer(root, args.tokenizer, settings)
        targets.append(spec.Target(name, urls[name], args.served_model_name or served, tokenizer))
        if name == "single":
            sources[name] = {"single": urls[name]}
        else:
            proxy_metrics = {
                "pd": args.proxy_metrics_url,
                "pd-ft": args.first_token_metrics_url,
                "pd-local": args.local_prefill_metrics_url,
            }[name]
            sources[name] = {"proxy": (proxy_metrics or urls[name]).rstrip("/")}
            if args.prefill_metrics_url:
                sources[name]["prefill"] = args.prefill_metrics_url.rstrip("/")
            if args.decode_metrics_url:
                sources[name]["decode"] = args.decode_metrics_url.rstrip("/")
        try:  # vLLM answers /version; pd-proxy does not (null then)
            versions[name] = str(json.loads(_http(f"{urls[name]}/version", api_key))["version"])
        except (BenchError, ValueError, KeyError, TypeError):
            versions[name] = None
    topology = {
        "what": "an already running deployment; nothing started by the bench",
        "pd_url": urls.get("pd"),
        "single_url": urls.get("single"),
        "first_token_url": urls.get("pd-ft"),
        "local_prefill_url": urls.get("pd-local"),
        "metrics_sources": sources,
    }
    return RemotePlan(targets, sources, topology, versions)


def run_remote(
    remote: RemotePlan,
    plan: spec.BenchPlan,
    out_dir: Path,
    api_key: str | None,
    short: spec.ShortPlan,
) -> Outcome:
    models = {
        t.name: {"served_name": t.served_model_name, "tokenizer": t.tokenizer}
        for t in remote.targets
    }
    outcome = Outcome(
        topology=remote.topology,
        extra={"server_versions": remote.server_versions, "model": models},
    )
    by_name = {t.name: t for t in remote.targets}
    for target in remote.targets:
        log.info(
            "%s at %s (model %r)",
            spec.TARGET_TITLES[target.name],
            target.base_url,
            target.served_model_name,
        )
        outcome.targets[target.name] = target.base_url
    for name, workload, wplan in spec.run_order(list(by_name), plan, short, list(by_name)):
        try:
            outcome.records += run_target(
                by_name[name], wplan, out_dir, remote.sources[name], api_key, workload
            )
        except BenchError as exc:
            title = spec.TARGET_TITLES[name] + (f" ({workload})" * bool(workload))
            log.error("%s failed: %s", title, exc)
            outcome.errors.append(f"{title}: {exc}")
    return outcome


# --- report -------------------------------------------------------------------------------------
def render(
    plan: spec.BenchPlan,
    records: Sequence[RunRecord],
    errors: Sequence[str] = (),
    short: spec.ShortPlan | None = None,
) -> tuple[str, dict[str, Any]]:
    """The printed text (tables, breakdowns, goals) and result.json's content."""
    main = [r for r in records if r.workload == spec.MAIN]
    results = {(r.target, r.level): r.result for r in main}
    deltas = {(r.target, r.level): r.deltas for r in main}
    counters = {(r.target, r.level): r.counters for r in main}
    gauges = {(r.target, r.level): r.gauges for r in main}
    title = (
        f"vllm bench serve, random dataset: {plan.input_len} in / {plan.output_len} out tokens, "
        f"seed {plan.seed}, temperature {plan.temperature:g}; single = one vLLM instance, "
        "P/D = prefill + decode through pd-proxy"
    )
    text = [
        format_header("serving benchmark"),
        tables.format_table(results, plan.levels, plan.prompts, title),
    ]
    checks = {
        level: tables.first_token_check(counters[("pd-ft", level)], results[("pd-ft", level)])
        for level in plan.levels
        if ("pd-ft", level) in results
    }
    if checks:
        text += [
            "",
            format_header("TTFT and E2E: single vs P/D vs P/D with the first token from prefill"),
            tables.format_modes(results, plan.levels, checks),
        ]
    not_normal = [
        level
        for level in plan.levels
        if ("pd", level) in results
        and tables.first_token_check(counters[("pd", level)], None).measured
    ]
    if not_normal:
        text.append(
            "WARNING: the P/D proxy continued requests from prefill's token 1 "
            f"(c={','.join(map(str, not_normal))}): it runs --first-token-from-prefill, so its "
            "P/D column is not the normal mode"
        )
    breakdowns, handovers = [], []
    for level in plan.levels:
        merged = {**deltas.get(("pd", level), {}), **deltas.get(("single", level), {})}
        rows = tables.breakdown_rows(
            merged, results.get(("pd", level)), results.get(("single", level))
        )
        breakdowns.append(tables.breakdown_json(level, rows))
        per_mode = {
            mode: tables.handover_rows(
                deltas[(mode, level)], results[(mode, level)], gauges[(mode, level)]
            )
            for mode in tables.PD_MODES
            if (mode, level) in results
        }
        if per_mode:
            handovers.append(tables.handover_json(level, per_mode))
        if level != plan.focus_level():
            continue
        if ("pd", level) in results:
            text += [
                "",
                format_header(f"where the P/D time to first token goes, concurrency {level}"),
                tables.format_breakdown(level, rows),
            ]
        if per_mode:
            text += [
                "",
                format_header(f"P/D handover per request, by phase, concurrency {level}"),
                tables.format_handover(level, per_mode),
            ]
    found = tables.goals(results, deltas, checks)
    if found:
        text += ["", format_header("goals (reported, never a failure)"), tables.format_goals(found)]
    local_text, local_summary = render_local_prefill(plan, records, short or spec.ShortPlan())
    if local_text:
        text += ["", local_text]
    summary = {
        "plan": plan.as_dict(),
        "table": tables.comparison_rows(results, plan.levels),
        "modes": tables.mode_rows(results, plan.levels, checks),
        "first_token": {str(level): check.as_dict() for level, check in checks.items()},
        "breakdown": breakdowns,
        "handover": handovers,
        "goals": tables.goals_json(found),
        "local_prefill": local_summary,
        "runs": [r.summary() for r in records],
        "errors": list(errors),
    }
    if errors:
        text += ["", "errors (their rows show n/a):", *(f"  {e}" for e in errors)]
    return "\n".join(text), summary


def render_local_prefill(
    plan: spec.BenchPlan, records: Sequence[RunRecord], short: spec.ShortPlan
) -> tuple[str, dict[str, Any] | None]:
    """Issue 27's part: the short-prompt table, the long check and their goals ('' and None
    when the short workload did not run)."""
    short_runs = {r.target: r for r in records if r.workload == spec.SHORT}
    long_runs = {r.target: r for r in records if r.workload == spec.LONG}
    long_local, long_pd = long_runs.get("pd-local"), long_runs.get("pd")
    if not short_runs and long_local is None:
        return "", None
    short_results = {target: r.result for target, r in short_runs.items()}
    local_run = short_runs.get("pd-local")
    short_check = (
        local_prefill.path_check(local_run.counters, local_run.result, "local")
        if local_run is not None
        else None
    )
    long_check = (
        local_prefill.path_check(long_local.counters, long_local.result, "pd")
        if long_local is not None
        else None
    )
    long_local_result = long_local.result if long_local is not None else None
    long_pd_result = long_pd.result if long_pd is not None else None
    table = local_prefill.format_short(
        short_results,
        short_check,
        long_pd_result,
        long_local_result,
        long_check,
        input_len=short.input_len,
        long_input_len=plan.input_len,
        max_tokens=short.max_tokens,
        ran_long_pd=long_pd is not None,
    )
    found = local_prefill.goals(
        short_results,
        short_check,
        long_pd_result,
        long_local_result,
        long_check,
        short.max_tokens,
    )
    times = local_prefill.time_rows(
        {target: r.deltas for target, r in short_runs.items()}, short_results
    )
    text = [
        format_header(
            f"short prompts: single vs P/D vs P/D with --local-prefill-max-tokens "
            f"{short.max_tokens}, concurrency 1"
        ),
        table,
        "",
        local_prefill.format_time_rows(times),
        "",
        format_header("local-prefill goals (reported, never a failure)"),
        local_prefill.format_goals(found),
    ]
    summary = {
        "short_plan": short.as_dict(),
        "short": local_prefill.short_rows(short_results, short_check),
        "long": local_prefill.long_rows(long_pd_result, long_local_result, long_check),
        "where": [dataclasses.asdict(row) for row in times],
        "paths": {
            "short": None if short_check is None else short_check.as_dict(),
            "long": None if long_check is None else long_check.as_dict(),
        },
        "goals": tables.goals_json(found),
    }
    return "\n".join(text), summary


def format_header(text: str) -> str:
    return f"== {text} =="


def add_arguments(parser: argparse.ArgumentParser, default_targets: str | None = None) -> None:
    g = parser.add_argument_group("what to run")
    g.add_argument(
        "--concurrency",
        default=",".join(map(str, spec.DEFAULT_CONCURRENCY)),
        help="--max-concurrency levels, comma-separated (default: %(default)s)",
    )
    g.add_argument(
        "--prompts",
        default=None,
        help="prompts per level: N for every level or one count per level "
        f"(default: max({spec.MIN_PROMPTS}, {spec.PROMPTS_PER_SLOT} x concurrency))",
    )
    g.add_argument("--input-len", type=int, default=spec.DEFAULT_INPUT_LEN, help="(%(default)s)")
    g.add_argument("--output-len", type=int, default=spec.DEFAULT_OUTPUT_LEN, help="(%(default)s)")
    g.add_argument("--seed", type=int, default=spec.DEFAULT_SEED, help="dataset seed (%(default)s)")
    g.add_argument(
        "--targets",
        default=default_targets or ",".join(spec.TARGETS),
        help="which of single,pd,pd-local,pd-ft to run (pd-local: P/D through a pd-proxy with "
        "--local-prefill-max-tokens, and the short-prompt workload on single, pd and pd-local; "
        "pd-ft: P/D through a pd-proxy with --first-token-from-prefill; default: all; remote "
        "mode: those whose URL is given)",
    )
    g.add_argument(
        "--short-input-len",
        type=int,
        default=spec.DEFAULT_SHORT_INPUT_LEN,
        help="short-prompt workload (with pd-local): tokens in (%(default)s)",
    )
    g.add_argument(
        "--short-output-len",
        type=int,
        default=spec.DEFAULT_SHORT_OUTPUT_LEN,
        help="short-prompt workload: tokens out (%(default)s)",
    )
    g.add_argument(
        "--short-prompts",
        type=int,
        default=spec.DEFAULT_SHORT_PROMPTS,
        help="short-prompt workload: prompts, at concurrency 1 (%(default)s)",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=spec.DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        help="N of the pd-local proxy (local mode starts it so; remote mode: the running "
        "proxy's N, for the labels) (%(default)s)",
    )
    g.add_argument(
        "--breakdown-concurrency",
        type=int,
        default=spec.DEFAULT_BREAKDOWN_LEVEL,
        help="level whose P/D breakdown is printed (nearest run level; default %(default)s)",
    )
    g.add_argument(
        "--run-timeout",
        type=float,
        default=900.0,
        help="seconds one vllm bench serve may run before it is killed (%(default)s)",
    )
    g.add_argument(
        "--port-base",
        type=int,
        default=spec.DEFAULT_PORT_BASE,
        help="local mode: the stack's ports are base+0..base+30 (default %(default)s)",
    )
    r = parser.add_argument_group(
        "an already running deployment (nothing is started when one of these is given)"
    )
    r.add_argument("--base-url", default=None, help="P/D: the proxy, e.g. http://gpu-host:8000")
    r.add_argument("--single-url", default=None, help="a plain vLLM instance of the same model")
    r.add_argument(
        "--first-token-url",
        default=None,
        help="P/D first token: a pd-proxy with --first-token-from-prefill in front of the same "
        "prefill + decode",
    )
    r.add_argument(
        "--api-key",
        default=None,
        help="client key (sent as Authorization: Bearer); default: --api-key-file or "
        "OPENAI_API_KEY",
    )
    r.add_argument("--api-key-file", default=None, help="file whose first line is the key")
    r.add_argument("--served-model-name", default=None, help="default: first of /v1/models")
    r.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer path or cached HF id (default: the served model's root when "
        "present here, else the kit's MODEL)",
    )
    r.add_argument(
        "--local-prefill-url",
        default=None,
        help="P/D local prefill: a pd-proxy with --local-prefill-max-tokens N in front of the "
        "same prefill + decode (give N as --local-prefill-max-tokens)",
    )
    r.add_argument("--proxy-metrics-url", default=None, help="default: --base-url")
    r.add_argument("--first-token-metrics-url", default=None, help="default: --first-token-url")
    r.add_argument("--local-prefill-metrics-url", default=None, help="default: --local-prefill-url")
    r.add_argument("--prefill-metrics-url", default=None, help="a prefill vLLM, for the breakdown")
    r.add_argument("--decode-metrics-url", default=None, help="a decode vLLM, for the breakdown")


def resolve_api_key(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise BenchError(f"--api-key-file {args.api_key_file}: {exc}") from None
        keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise BenchError(f"--api-key-file {args.api_key_file}: no key in it")
        return keys[0]
    return env.get("OPENAI_API_KEY") or None


def plan_from_args(args: argparse.Namespace) -> spec.BenchPlan:
    try:
        levels = spec.parse_levels(args.concurrency)
        return spec.BenchPlan(
            levels=levels,
            prompts=spec.parse_prompts(args.prompts, levels),
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            breakdown_level=args.breakdown_concurrency,
            run_timeout_s=args.run_timeout,
        )
    except spec.BenchSpecError as exc:
        raise BenchError(str(exc)) from None


def short_plan_from_args(args: argparse.Namespace) -> spec.ShortPlan:
    try:
        return spec.ShortPlan(
            input_len=args.short_input_len,
            output_len=args.short_output_len,
            prompts=args.short_prompts,
            max_tokens=args.local_prefill_max_tokens,
        )
    except spec.BenchSpecError as exc:
        raise BenchError(str(exc)) from None


def parse_targets(text: str) -> tuple[str, ...]:
    wanted = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = set(wanted) - set(spec.TARGETS)
    if not wanted or unknown:
        raise BenchError(f"--targets {text!r}: choose from {','.join(spec.TARGETS)}")
    return wanted


def cmd_bench(settings: StackSettings, args: argparse.Namespace) -> int:
    """`pcp-pd-kit bench`: 0 when every run completed all its prompts, else 1.

    Bad options, busy ports, an unknown model or an unreachable URL fail (exit 2 via the CLI)
    before anything starts or any file is written.
    """
    plan = plan_from_args(args)
    short = short_plan_from_args(args)
    remote = bool(args.base_url or args.single_url or args.first_token_url)
    remote = remote or bool(args.local_prefill_url)
    wanted = parse_targets(args.targets)
    if "pd-local" in wanted:
        for problem in short.problems(plan):
            log.warning("%s", problem)
    api_key = resolve_api_key(args, os.environ) if remote else None
    if remote:
        remote_plan = prepare_remote(settings, args, api_key, wanted)
    else:
        settings = prepare_local(settings, args.port_base, wanted)
    started = manifest_mod.utc_stamp()
    out_dir = layout.run_dir(getattr(args, "kind", "serve"), args.results_dir, started)
    (out_dir / "logs").mkdir()
    log.info("results go to %s", out_dir)
    load_start = manifest_mod.load_average()
    wall_start = time.monotonic()
    if remote:
        outcome = run_remote(remote_plan, plan, out_dir, api_key, short)
    else:
        outcome = run_local(settings, plan, out_dir, wanted, short)
    text, summary = render(plan, outcome.records, outcome.errors, short)
    extra = dict(outcome.extra)
    extra["load_average"] = {"start": load_start, "end": manifest_mod.load_average()}
    extra["wall_s"] = round(time.monotonic() - wall_start, 1)
    # What the run found, also in the manifest: the goals, whether the first-token proxy really
    # continued requests, and the handover breakdown at the breakdown level.
    focus = plan.focus_level()
    extra["findings"] = {
        "goals": summary["goals"],
        "first_token": summary["first_token"],
        "handover": next((h for h in summary["handover"] if h["concurrency"] == focus), None),
        "local_prefill": summary["local_prefill"],
    }
    manifest = manifest_mod.build_manifest(
        plan=plan,
        mode="remote" if remote else "local",
        targets=outcome.targets,
        topology=outcome.topology,
        settings=None if remote else settings,
        argv=[sys.executable, "-m", "pcp_pd_kit", *sys.argv[1:]],
        started_utc=started,
        git=manifest_mod.git_info(repo_root()),
        host=manifest_mod.host_info(),
        versions=manifest_mod.package_versions(),
        extra=extra,
    )
    layout.write_run(out_dir, summary, text, manifest)
    print(text)
    print(f"\nresults: {out_dir} (wall time {extra['wall_s']:.0f}s)")
    incomplete = [r for r in outcome.records if not r.complete]
    if incomplete or outcome.errors:
        names = [
            f"{spec.TARGET_TITLES[r.target]}{f' ({r.workload})' * bool(r.workload)} c={r.level}"
            for r in incomplete
        ]
        names += outcome.errors
        print(f"incomplete: {'; '.join(names)} (logs in {out_dir / 'logs'})", file=sys.stderr)
        return 1
    return 0
