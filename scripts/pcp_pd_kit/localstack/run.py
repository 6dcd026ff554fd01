"""`pcp-pd-kit up|demo`: the local CPU P/D stack, kept until Ctrl-C or run once as the demo."""

from __future__ import annotations

import logging
import sys
import time

from pcp_pd_kit.localstack.demo import demo_checks
from pcp_pd_kit.localstack.report import failed, format_report
from pcp_pd_kit.localstack.stack import Stack
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
