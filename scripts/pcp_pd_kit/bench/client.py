"""The bench's I/O with servers: HTTP with the client key, /metrics snapshots and their deltas,
and one `vllm bench serve` as a process group with a time limit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcp_pd_kit.bench import metrics as m
from pcp_pd_kit.localstack.process import parent_death_preexec, signal_group
from pcp_pd_kit.localstack.report import parse_metrics

log = logging.getLogger("pcp_pd_kit.bench")
HEARTBEAT_S = 30.0
BENCH_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip


Histograms = dict[str, dict[str, m.Histogram | None]]  # per source, by name (or selector)
Counters = dict[str, dict[str, float] | None]  # per source, by selector


class BenchError(RuntimeError):
    """The bench cannot run (a target unreachable, a key refused, a bad option); one line."""


def http(url: str, api_key: str | None = None, payload: Any = None, timeout_s: float = 30.0) -> str:
    """GET, or POST `payload` as JSON; the body as text. Errors are BenchError."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if payload is not None:
        headers["Content-Type"] = "application/json"
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return str(resp.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        hint = " (the endpoint wants a key: --api-key, --api-key-file or OPENAI_API_KEY)"
        raise BenchError(f"{url}: HTTP {exc.code}{hint * (exc.code == 401)}: {body}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchError(f"{url}: no answer: {exc}") from None


def served_model(base_url: str, api_key: str | None = None) -> tuple[str, str]:
    """(id, root) of the first model /v1/models lists: the served name and where it came from."""
    text = http(f"{base_url}/v1/models", api_key)
    try:
        first = json.loads(text)["data"][0]
        return str(first["id"]), str(first.get("root") or first["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{base_url}/v1/models: no model listed: {text[:300]}") from None


@dataclass
class Scrape:
    """What one /metrics page held of what the bench reads."""

    histograms: dict[str, m.Histogram | None] = field(default_factory=dict)
    counters: dict[str, dict[str, float] | None] = field(default_factory=dict)
    gauges: dict[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Wanted:
    """Per source: histograms, (counter, labels kept) and gauges to read."""

    histograms: Mapping[str, Sequence[str]] = field(default_factory=dict)
    counters: Mapping[str, Sequence[tuple[str, Sequence[str]]]] = field(default_factory=dict)
    gauges: Mapping[str, Sequence[str]] = field(default_factory=dict)


def scrape(url: str, source: str, wanted: Wanted, api_key: str | None = None) -> Scrape | None:
    """What `wanted` lists for `source` from url/metrics; None (rows n/a) when unreadable."""
    try:
        samples = parse_metrics(http(f"{url}/metrics", api_key, timeout_s=10))
    except (BenchError, ValueError) as exc:
        log.warning("cannot read %s/metrics (its rows will be n/a): %s", url, exc)
        return None
    return Scrape(
        {name: m.histogram(samples, name) for name in wanted.histograms.get(source, ())},
        {name: m.counter_values(samples, name, k) for name, k in wanted.counters.get(source, ())},
        {name: m.gauge_max(samples, name) for name in wanted.gauges.get(source, ())},
    )


def snapshot(
    sources: Mapping[str, str], wanted: Wanted, api_key: str | None = None
) -> dict[str, Scrape | None]:
    return {source: scrape(url, source, wanted, api_key) for source, url in sources.items()}


def grown(
    before: Mapping[str, Scrape | None], after: Mapping[str, Scrape | None]
) -> tuple[Histograms, Counters, dict[str, dict[str, float | None]]]:
    """(histogram deltas, counter growth, gauges after) per source between two snapshots."""
    hists: Histograms = {}
    counters: Counters = {}
    for source, later in after.items():
        earlier = before.get(source)
        if later is None or earlier is None:
            continue
        hists[source] = {
            n: m.delta(h, earlier.histograms.get(n)) for n, h in later.histograms.items()
        }
        merged: dict[str, float] = {}
        for name, values in later.counters.items():
            merged.update(m.counter_delta(values, earlier.counters.get(name)) or {})
        counters[source] = merged or None
    gauges = {s: dict(page.gauges) for s, page in after.items() if page is not None and page.gauges}
    return hists, counters, gauges


def bench_env(api_key: str | None = None) -> dict[str, str]:
    """The bench client's environment: offline, and OPENAI_API_KEY only when a key is given."""
    env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, **BENCH_ENV}
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # vllm bench serve sends it as Authorization: Bearer
    return env


def run_process(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str], timeout_s: float, what: str
) -> tuple[int | None, float, bool]:
    """(returncode, seconds, timed out) of argv in its own process group, killed on timeout."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "ab") as out:
        out.write(f"=== {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=parent_death_preexec(),
        )  # fmt: skip
    try:
        beat = start
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return proc.wait(timeout=1.0), time.monotonic() - start, False
            now = time.monotonic()
            if now - start > timeout_s:
                log.error("%s still running after %.0fs: killing it", what, timeout_s)
                return None, now - start, True
            if now - beat >= HEARTBEAT_S:
                beat = now
                log.info("  %s: running, %.0fs", what, now - start)
    finally:
        signal_group(proc.pid, signal.SIGKILL)  # the leader on timeout/Ctrl-C, else leftovers
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit after SIGKILL", what, proc.pid)


def read_result(path: Path) -> dict[str, Any] | None:
    """vllm bench serve's saved result, or None when it wrote none (or garbage)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
