"""Workers that sleep between looks for the scheduler's next step, instead of spinning a core.

vLLM's multiprocess executor hands each step to its workers through a shared-memory ring
(``vllm/distributed/device_communicators/shm_broadcast.py``). A reader that finds no new step
calls ``SpinCondition.wait``, which, for ``busy_loop_s`` (1 s, and no setting for it in 0.32.0)
after its last read, only calls ``sched_yield()`` before it looks again; past that it blocks on
the writer's ZMQ notification. That is right for a GPU box with a spare core per worker. On the
CPU build each rank *is* a core: the kit's PCP2 + EP2 prefill has two ranks on two cores, and the
decode, the scheduler and the API server share them. A rank spinning for the next step takes the
core that the process it waits for needs: py-spy on the prefill's rank 0 found 17% of its busy
samples in that ``sched_yield`` (with the collectives) at ~1,000-token prompts.

With the fix the busy loop sleeps between looks instead of yielding, a tenth of the time it has
waited so far, from ``MIN_SLEEP_S`` (50 us) to ``MAX_SLEEP_S`` (1 ms): a step that comes at once
is picked up within tens of microseconds, a long wait costs a waiting reader a few percent of a
core instead of all of it, and no step is picked up later than a tenth of its wait (plus the
kernel's timer slack). It still looks at the ring itself, so it misses nothing. Blocking on the
notification socket at once (a busy loop of 0 s) is *not* a fix: measured, a reader then lost
wake-ups and sat out its poll timeout on most steps (a single vLLM generated 0.2 tokens/s).
After ``busy_loop_s`` idle, vLLM's own blocking wait takes over as before.

It installs only on the vLLM releases ``upstream_gate`` lists for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import upstream_gate

MARKER = "_pcp_nixl_cpu_idle_wait"
#: Bounds of a waiting reader's sleep between looks at the ring during vLLM's busy loop.
MIN_SLEEP_S, MAX_SLEEP_S = 50e-6, 1e-3


def sleep_s(waited_s: float) -> float:
    """A tenth of the wait so far, within [MIN_SLEEP_S, MAX_SLEEP_S]."""
    return min(MAX_SLEEP_S, max(MIN_SLEEP_S, waited_s / 10))


def sleeping_wait(original: Callable[..., None]) -> Callable[..., None]:
    """A ``SpinCondition.wait`` that sleeps (``sleep_s``) where vLLM's would ``sched_yield()``."""

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        waited = time.monotonic() - self.last_read
        if waited <= self.busy_loop_s:
            time.sleep(sleep_s(waited))
            return
        original(self, timeout_ms)

    setattr(wait, MARKER, True)
    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def install(spin_cls: Any, vllm_version: str | None = None) -> bool:
    """Patch ``spin_cls.wait`` once; False when it already is. Refuses a vLLM the fix was not
    checked against (``upstream_gate``; default: the installed vLLM)."""
    upstream_gate.check(upstream_gate.IDLE_WAIT, vllm_version)
    current = spin_cls.wait
    if getattr(current, MARKER, False):
        return False
    spin_cls.wait = sleeping_wait(current)
    return True


def installed(spin_cls: Any) -> bool:
    return bool(getattr(spin_cls.wait, MARKER, False))
