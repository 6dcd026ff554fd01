"""`python -m pd_localstack up|demo|bench`: the local CPU P/D stack from the command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from pd_localstack.bench.runner import BenchError, add_arguments, cmd_bench
from pd_localstack.demo import demo_checks
from pd_localstack.envfile import EnvFileError, layered_env
from pd_localstack.model_source import ModelNotAvailableError
from pd_localstack.paths import repo_root
from pd_localstack.ports import PortInUseError
from pd_localstack.process import StackProcessError
from pd_localstack.report import failed, format_report
from pd_localstack.settings import SettingsError, StackSettings, settings_from_env
from pd_localstack.stack import Stack

log = logging.getLogger("pd_localstack")
USER_ERRORS = (
    EnvFileError,
    SettingsError,
    ModelNotAvailableError,
    PortInUseError,
    StackProcessError,
    BenchError,
)


def load_settings() -> StackSettings:
    return settings_from_env(layered_env(repo_root(), os.environ))


def _term_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_up(settings: StackSettings) -> int:
    with Stack(settings) as stack:
        print_urls(stack)
        log.info("stack up; Ctrl-C stops everything")
        while True:
            stack.check_alive()
            time.sleep(2)


def cmd_demo(settings: StackSettings, limit: int) -> int:
    wall_start = time.monotonic()
    stack = Stack(settings)
    try:
        stack.start()
        print_urls(stack)
        checks, _ = demo_checks(stack, limit)
    finally:
        stack.stop()
    wall = time.monotonic() - wall_start
    print("\n== pcp-pd-kit demo report ==")
    print(format_report(checks))
    startup = ", ".join(f"{k} {v:.0f}s" for k, v in stack.startup_seconds().items())
    print(f"  start-up: {startup}; demo wall time {wall:.0f}s")
    bad = failed(checks)
    if bad:
        print(f"\nFAILED checks: {'; '.join(c.name for c in bad)}", file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0


def print_urls(stack: Stack) -> None:
    for name, url in stack.urls.items():
        print(f"  {name:<11} {url}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_localstack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start prefill, decode, proxy and Prometheus until Ctrl-C")
    demo = sub.add_parser("demo", help="start the stack, run a GSM8K slice, report, stop")
    demo.add_argument("--limit", type=int, default=None, help="GSM8K questions (DEMO_LIMIT)")
    bench = sub.add_parser(
        "bench",
        help="vllm bench serve: single vLLM vs P/D via pd-proxy (local stack, or --base-url)",
        description="vLLM's serving benchmark against a single instance and the P/D stack "
        "(see docs/bench.md)",
    )
    add_arguments(bench)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s pd_localstack %(message)s", datefmt="%H:%M:%S"
    )
    # Both as KeyboardInterrupt so one `finally` stops the stack; SIGINT explicitly because a
    # shell that backgrounds the launcher leaves SIGINT ignored.
    previous = {
        sig: signal.signal(sig, _term_as_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        settings = load_settings()
        if args.command == "up":
            return cmd_up(settings)
        if args.command == "bench":
            return cmd_bench(settings, args)
        return cmd_demo(settings, args.limit or settings.demo_limit)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; everything stopped", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
