"""The first request after the local stack reports up: answered, every start.

A fresh stack pays for the decode's first NIXL handshake and first KV read on its first P/D
request; a start that lost that request answered it with the proxy's 504 while every later
request took a fraction of a second. The short check (e2e) asks the package's shared stack,
whose first request it is: this module sorts first in tests/e2e (tests/test_e2e_order.py checks
it), so a start of its own would only repeat the shared stack's (about a minute on 2 cores). The
repeat check (marker ``repeat``, never part of the default run) starts a stack of its own
``FIRST_REQUEST_STARTS`` times (default 10), each with a request at once and one after a pause,
and needs every first request answered. It is defined first, so with ``-m "e2e or repeat"`` its
stacks run before the shared one starts, never beside it.
"""

from __future__ import annotations

import os
import time

import pytest

from pcp_pd_kit.localstack.host import run_dir
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import StackSettings

from .first_request import StartResult, ask, client_timeout_s, settings_for, start_and_ask

STARTS_ENV = "FIRST_REQUEST_STARTS"
# 0: start the stack without its warm-up, to see what a first request met before it existed.
WARM_ENV = "FIRST_REQUEST_WARMUP"
PAUSE_S = 5.0


def _report(results: list[StartResult]) -> str:
    return "\n".join(result.line() for result in results)


def _run(settings: StackSettings, starts: int, warm: bool = True) -> list[StartResult]:
    base = run_dir() / "first-request"
    return [
        start_and_ask(settings_for(settings), base / "stack", base / "failed", i, PAUSE_S, warm)
        for i in range(starts)
    ]


def _check(results: list[StartResult]) -> None:
    bad = [r for r in results if not (r.first.ok and r.after_pause.ok)]
    assert not bad, f"{len(bad)} of {len(results)} starts lost a request:\n{_report(results)}"


@pytest.mark.repeat
def test_first_request_is_answered_every_start(e2e_settings: StackSettings) -> None:
    starts = int(os.environ.get(STARTS_ENV, "10"))
    if starts < 1:
        raise ValueError(f"{STARTS_ENV} must be >= 1, got {starts}")
    warm = os.environ.get(WARM_ENV, "1")
    if warm not in ("0", "1"):
        raise ValueError(f"{WARM_ENV} must be 0 or 1, got {warm!r}")
    _check(_run(e2e_settings, starts, warm == "1"))


@pytest.mark.e2e
@pytest.mark.opens_stack
def test_first_request_after_start_is_answered(pd_stack: Stack) -> None:
    """The shared stack's first request, at once, and one after a pause; its logs stay in the
    stack's run folder."""
    timeout_s = client_timeout_s(pd_stack.settings)
    first = ask(pd_stack, timeout_s)
    time.sleep(PAUSE_S)
    after = ask(pd_stack, timeout_s)
    assert first.ok and after.ok, (
        f"first request {first}, after the pause {after}; logs in {pd_stack.log_dir}"
    )
