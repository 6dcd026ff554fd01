"""A backend's health as a circuit breaker: pure rules, no I/O.

The states are vllm-router's: closed (``up``: takes requests), open (``down``: takes none) and
half-open (``probing``: it passed a check after being down and takes one request at a time until
``successes`` checks in a row pass or a request on it succeeds). ``failures`` failing checks in a
row open the breaker; in ``probing`` one failure is enough. A refused connection on a request is
certain and opens it at once (pd_proxy.legs).

A check that times out is judged by what the proxy itself sees (``judge``), because vLLM answers
/health from the same event loop that streams tokens and can miss a check while busy:

- the backend answered one of our requests while its check was pending: busy, not sick;
- it answered none, with requests of ours in flight, while another backend of its role answered
  some: hung (its requests stopped, the others' go on), so sick now;
- nothing of the role answered (the whole role is slow, e.g. a saturated host): busy, through
  ``BUSY_TIMEOUTS_TOLERATED`` such checks in a row;
- an idle backend that does not answer its check is sick.

A connect timeout is never "busy": a backend that cannot even accept a connection is failing.
"""

from __future__ import annotations

import enum
from typing import Protocol

# Timed-out checks in a row a backend stays through while its whole role makes no progress.
BUSY_TIMEOUTS_TOLERATED = 2


class CheckResult(enum.Enum):
    """What one ``GET /health`` gave."""

    OK = "ok"  # 200
    FAILED = "failed"  # refused, reset, connect timeout, an error status
    TIMED_OUT = "timed_out"  # connected, but no answer within the check timeout


class Verdict(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    BUSY = "busy"  # no answer, but no sign of a hang either: no change


class Tracked(Protocol):
    """The per-backend fields these rules read and write (pd_proxy.backends.pool.Backend)."""

    healthy: bool
    probing: bool
    outstanding: int
    slow_checks: int
    passes: int
    fails: int


def judge(
    result: CheckResult, backend: Tracked, progressed: bool, peers_progressed: bool
) -> Verdict:
    """A check's verdict; ``progressed``: the backend answered a request of ours while its check
    was pending, ``peers_progressed``: another backend of its role did."""
    if result is CheckResult.OK:
        return Verdict.PASS
    if result is CheckResult.FAILED or not backend.healthy or backend.outstanding == 0:
        return Verdict.FAIL
    if progressed:
        return Verdict.BUSY
    if peers_progressed:
        return Verdict.FAIL  # hung: its requests stopped while the others' go on
    if backend.slow_checks < BUSY_TIMEOUTS_TOLERATED:
        return Verdict.BUSY
    return Verdict.FAIL


class Breaker:
    """The transitions: ``failures`` fails in a row open it, ``successes`` passes close it."""

    def __init__(self, failures: int = 1, successes: int = 2) -> None:
        if failures < 1 or successes < 1:
            raise ValueError("failures and successes must be >= 1")
        self.failures = failures
        self.successes = successes

    def apply(self, backend: Tracked, verdict: Verdict) -> bool:
        """Apply ``verdict`` to ``backend``; true when ``healthy`` changed."""
        if verdict is Verdict.BUSY:
            backend.slow_checks += 1
            return False
        backend.slow_checks = 0
        if verdict is Verdict.PASS:
            backend.fails = 0
            backend.passes += 1
            if not backend.healthy:
                backend.healthy = True
                backend.probing = backend.passes < self.successes
                return True
            if backend.probing and backend.passes >= self.successes:
                backend.probing = False
            return False
        backend.passes = 0
        backend.fails += 1
        if backend.healthy and (backend.probing or backend.fails >= self.failures):
            self.open(backend)
            return True
        return False

    @staticmethod
    def open(backend: Tracked) -> None:
        """Down now (a failed check past the threshold, or a refused connection)."""
        backend.healthy = False
        backend.probing = False
        backend.passes = 0

    @staticmethod
    def proved(backend: Tracked) -> None:
        """A request on a probing backend succeeded: it takes its full share again."""
        backend.probing = False
        backend.fails = 0
