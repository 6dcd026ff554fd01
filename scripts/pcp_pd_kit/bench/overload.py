"""A flood several times the stack's capacity plus a light client, through the local stack's
pd-proxy (admission on, two key flows: `flood` and `light`) and a second pd-proxy with
--no-admission in front of the same servers, side by side (docs/bench.md). Exit 1 when a request
got neither an answer nor a refusal, or the prefill kept KV.

    pcp-pd-kit bench overload                  # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import logging
import secrets
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pcp_pd_kit.bench import cache_plan as cp
from pcp_pd_kit.bench import overload_report as report
from pcp_pd_kit.bench import serve_plan as spec
from pcp_pd_kit.bench.prefix_ttft import token_ids
from pcp_pd_kit.bench.results import Outcome, startup_s
from pcp_pd_kit.localstack import commands, live
from pcp_pd_kit.localstack.keys import write_credentials
from pcp_pd_kit.localstack.model_source import tokenizer_folder
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.report import CANONICAL_COMPLETIONS, HELD_REQUESTS_TOTAL, total
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import StackSettings

HELP = "a flood plus a light client through pd-proxy, admission on against off"
log = logging.getLogger("pcp_pd_kit.bench")
NO_ADMISSION_OFFSET = 5  # the second proxy's port: --port-base + 5 (serve uses +1 and +2)
LIGHT_START_S = 1.0  # the light client starts once the flood has reached the proxy
SETTLE_S = 90.0  # the prefill frees a KV lease's blocks at the latest when the lease runs out
SIZES = ("flood_prompts", "flood_input_len", "light_requests", "light_input_len", "output_len")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--flood-prompts", type=int, default=48, help="sent at once (%(default)s)")
    a("--flood-input-len", type=int, default=1000, help="token ids per flood prompt (%(default)s)")
    a("--light-requests", type=int, default=5, help="one after another (%(default)s)")
    a("--light-input-len", type=int, default=64, help="token ids per light prompt (%(default)s)")
    a("--output-len", type=int, default=16, help="tokens out per request (%(default)s)")
    a("--request-timeout-s", type=float, default=600.0, help="per request (%(default)s)")
    a("--seed", type=int, default=7, help="(%(default)s)")
    a("--port-base", type=int, default=spec.DEFAULT_PORT_BASE, help="(%(default)s)")


def _settings(port_base: int, key_file: str = "") -> StackSettings:
    """The stack's settings (admission on, as shipped) on the bench's ports, with the key file."""
    return spec.bench_settings(port_base, admission=True, api_key_file=key_file)


def check(args: argparse.Namespace) -> str | None:
    small = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in SIZES if getattr(args, n) < 1]
    if small:
        return f"{', '.join(small)}: at least 1"
    try:
        _settings(args.port_base)
    except (spec.BenchSpecError, ValueError) as exc:
        return str(exc)
    return None


def send(url: str, key: str, client: str, body: dict[str, Any], timeout_s: float) -> report.Reply:
    """One streamed completion: its refusal, or its time to first token and [DONE]."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    start = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            seconds = time.perf_counter() - start
            try:
                code = str(json.loads(text)["error"]["code"])
            except (ValueError, KeyError, TypeError):
                code = None
            return report.Reply(client, resp.status, seconds, code, resp.getheader("Retry-After"))
        first: float | None = None
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if first is None and line.startswith("data:") and '"choices"' in line:
                first = time.perf_counter() - start
            if line == "data: [DONE]":
                return report.Reply(client, 200, first or 0.0, complete=first is not None)
        return report.Reply(client, 200, first or time.perf_counter() - start)
    except (OSError, http.client.HTTPException) as exc:
        log.warning("%s request: no answer: %s", client, exc)
        return report.Reply(client, 0, time.perf_counter() - start, code="no answer")
    finally:
        conn.close()


def body(model: str, seed: int, length: int, output_len: int) -> dict[str, Any]:
    return {"model": model, "prompt": token_ids(seed, length), "max_tokens": output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip


def light_run(
    url: str, key: str, model: str, seed: int, args: argparse.Namespace,
    flood_over: threading.Event | None = None,
) -> list[report.Reply]:  # fmt: skip
    """--light-requests one after another; beside a flood, until it is over (one request stuck
    behind it waits, rather than five following once it ended)."""
    replies: list[report.Reply] = []
    while len(replies) < args.light_requests or (flood_over and not flood_over.is_set()):
        during = flood_over is None or not flood_over.is_set()
        prompt = body(model, seed + len(replies), args.light_input_len, args.output_len)
        reply = send(url, key, report.LIGHT, prompt, args.request_timeout_s)
        replies.append(dataclasses.replace(reply, during=during))
    return replies


def prefill_kv(url: str) -> dict[str, float | None]:
    samples = live.scrape(url)
    names = {"held": HELD_REQUESTS_TOTAL, "freed": CANONICAL_COMPLETIONS, "usage": live.KV_USAGE}
    return {key: total(samples, name) for key, name in names.items()}


def one_mode(
    url: str, prefill: str, keys: dict[str, str], model: str, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The light client alone, then the flood with the light client beside it; KV's growth."""
    alone = light_run(url, keys[report.LIGHT], model, seed, args)
    before = prefill_kv(prefill)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.flood_prompts + 1) as pool:
        flood = [
            pool.submit(send, url, keys[report.FLOOD], report.FLOOD,
                        body(model, seed + 1000 + i, args.flood_input_len, args.output_len),
                        args.request_timeout_s)
            for i in range(args.flood_prompts)
        ]  # fmt: skip
        time.sleep(LIGHT_START_S)
        flood_over = threading.Event()
        light = pool.submit(light_run, url, keys[report.LIGHT], model, seed + 100, args,
                            flood_over)  # fmt: skip
        replies = [f.result() for f in flood]
        flood_over.set()
        replies += light.result()
    wall = time.monotonic() - t0
    live.settle_prefill(prefill, SETTLE_S)
    after = prefill_kv(prefill)
    alone_s = [r.seconds for r in alone if r.served]
    summary = report.summarize(replies, alone_s, report.kv_growth(before, after))
    log.info("%s: %d/%d served in %.0fs, refused %s", url, summary["served"], len(replies),
             wall, summary["refused"])  # fmt: skip
    return {"summary": summary, "wall_s": round(wall, 1), "replies": [
        {**dataclasses.asdict(r), "outcome": r.outcome} for r in [*alone, *replies]]}  # fmt: skip


def run(args: argparse.Namespace, out: Path) -> Outcome:
    keys = {flow: f"sk-{flow}-{secrets.token_hex(8)}" for flow in (report.FLOOD, report.LIGHT)}
    plan = {n: getattr(args, n) for n in SIZES}
    data: dict[str, Any] = {"plan": plan, "modes": {}, "errors": []}
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as secret_dir:
        # outside the results: keys never go there
        key_file = write_credentials(report.key_file_text(keys), Path(secret_dir) / "api_keys")
        settings = _settings(args.port_base, str(key_file))
        off_port = args.port_base + NO_ADMISSION_OFFSET
        stack = Stack(settings, parts=("prefill", "decode", "proxy"), work_dir=out / "servers")
        off: ManagedProcess | None = None
        try:
            stack.start()
            assert stack.model is not None
            off_spec = commands.proxy_spec(
                dataclasses.replace(settings, proxy_port=off_port, admission=False),
                tokenizer=tokenizer_folder(stack.model.path),  # as the stack's own proxy
            )
            off = ManagedProcess(cp.with_flags(off_spec, [], "proxy-no-admission"), stack.log_dir)
            off.start()
            wait_healthy([off], settings.startup_timeout_s)
            data["startup_s"] = startup_s(stack)
            urls = {"admission": stack.urls["proxy"], "no-admission": settings.url(off_port)}
            for i, mode in enumerate(report.MODES):
                log.info("overload: %s", mode)
                data["modes"][mode] = one_mode(urls[mode], stack.urls["prefill"], keys,
                                               stack.served_model_name, args.seed + 10_000 * i,
                                               args)  # fmt: skip
        except Exception as exc:
            log.error("bench overload failed: %s", exc)
            data["errors"].append(f"{type(exc).__name__}: {exc}")
        finally:
            if off is not None:
                off.stop()
            stack.stop()
    summaries = {m: d["summary"] for m, d in data["modes"].items()}
    table = report.format_table(summaries, plan)
    errors = data["errors"] + [f"{m}: {s['errors']} requests neither served nor refused"
                               for m, s in summaries.items() if s["errors"]]  # fmt: skip
    errors += [f"{m}: the prefill kept KV" for m, s in summaries.items() if not s["kv_all_freed"]]
    if errors:
        table += "\n\nerrors:\n" + "\n".join(f"- {e}" for e in errors)
    result = {**data, "settings": {"admission_limits": commands.admission_args(settings)}}
    summary = {"plan": plan, "modes": summaries, "errors": errors}
    return Outcome(result, table, {"bench": plan}, rc=1 if errors else 0, summary=summary)
