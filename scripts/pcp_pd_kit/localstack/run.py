"""`pcp-pd-kit up|demo`: the local CPU P/D stack, kept until Ctrl-C or run once as the demo."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from pcp_pd_kit import repo_root
from pcp_pd_kit.gsm8k.results import ResultsError
from pcp_pd_kit.localstack.demo import EVAL_TIMEOUT_S, EvalResult, demo_checks, eval_check, run_eval
from pcp_pd_kit.localstack.demo_task import choose
from pcp_pd_kit.localstack.report import failed, format_report
from pcp_pd_kit.localstack.scores import Score, read_score, score_checks, score_line
from pcp_pd_kit.localstack.stack import REFERENCE_PARTS, Stack
from pcp_pd_kit.settings import StackSettings

log = logging.getLogger("pcp_pd_kit.localstack")


def cmd_up(settings: StackSettings) -> int:
    with Stack(settings) as stack:
        print_urls(stack)
        log.info("stack up; Ctrl-C stops everything")
        while True:
            stack.check_alive()
            time.sleep(2)


def cmd_demo(settings: StackSettings, limit: int) -> int:
    wall_start = time.monotonic()
    Stack(settings).ensure_ports_free()
    settings, task = choose(settings, repo_root())
    if settings.local_prefill_max_tokens:
        # The demo proves the P/D path (its report reads the KV that crossed NIXL): its short
        # questions would otherwise go to decode alone (LOCAL_PREFILL_MAX_TOKENS).
        log.info(
            "the demo sends every question P/D (LOCAL_PREFILL_MAX_TOKENS=%d ignored)",
            settings.local_prefill_max_tokens,
        )
        settings = dataclasses.replace(settings, local_prefill_max_tokens=0)
    limit = task.limit or limit
    stack = Stack(settings)
    try:
        stack.start()
        print_urls(stack)
        checks, pd_run = demo_checks(stack, limit, task=task)
    finally:
        stack.stop()
    # The same model on one vLLM server that does prefill and decode itself, started after the
    # P/D stack stopped (2 cores: three servers at once slow every one of them).
    single = Stack(settings, parts=REFERENCE_PARTS, work_dir=stack.work_dir)
    try:
        single.start()
        single_run = run_eval(single, limit, task=task, target="reference")
    finally:
        single.stop()
    checks.append(eval_check(single_run, EVAL_TIMEOUT_S, f"{task.label} on a single instance"))
    pd_score, single_score = _score(pd_run), _score(single_run)
    checks += score_checks(pd_score, single_score, task.min_score, task.min_samples)
    wall = time.monotonic() - wall_start
    print("\n== pcp-pd-kit demo report ==")
    print(format_report(checks))
    started = {**stack.startup_seconds(), **single.startup_seconds()}
    startup = ", ".join(f"{k} {v:.0f}s" for k, v in started.items())
    print(f"  start-up: {startup}; demo wall time {wall:.0f}s")
    print(f"\n{task.label}:")
    print(f"  {score_line('P/D (PCP2 + EP2 prefill -> NIXL -> decode)', pd_score)}")
    print(f"  {score_line('single instance', single_score)}")
    bad = failed(checks)
    if bad:
        print(f"\nFAILED checks: {'; '.join(c.name for c in bad)}", file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0


def _score(run: EvalResult) -> Score | None:
    """The run's score, or None when it left none (its own check says why)."""
    if run.out_dir is None:
        return None
    try:
        return read_score(run.out_dir)
    except (OSError, ValueError, KeyError, StopIteration, ResultsError) as exc:
        log.error("no score under %s: %s", run.out_dir, exc)
        return None


def print_urls(stack: Stack) -> None:
    for name, url in stack.urls.items():
        print(f"  {name:<11} {url}", file=sys.stderr)
