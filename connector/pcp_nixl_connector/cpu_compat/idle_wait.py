"""Workers that block while they wait for the scheduler's next step, instead of spinning a core.

vLLM's multiprocess executor hands each step to its workers through a shared-memory ring
(``vllm/distributed/device_communicators/shm_broadcast.py``). A reader that finds no new step
calls ``SpinCondition.wait``, which, for ``busy_loop_s`` (1 s, and no setting for it in 0.32.0)
after its last read, only calls ``sched_yield()`` and checks again; past that it blocks on the
writer's ZMQ notification. That is right for a GPU box with a spare core per worker. On the CPU
build each rank *is* a core: the kit's PCP2 + EP2 prefill has two ranks on two cores, and the
decode, the scheduler and the API server share them. A rank spinning for the next step (or for
its peer to finish the step) takes the core that the process it waits for needs: py-spy on the
prefill's rank 0 found 17% of its busy samples in that ``sched_yield`` at ~1,000-token prompts.

With the fix a reader's busy loop is ``BUSY_LOOP_S`` (0): it blocks on the notification at once.
The writer notifies after every write (``MessageQueue.enqueue``), and the notification socket keeps
the last one (``zmq.CONFLATE``), so a reader never misses a step; a stale notification only costs
one more look at the ring. Waking from the socket costs tens of microseconds per step. The
writer's own wait for slow readers (``acquire_write``) is left as it is: it lasts as long as a
reader takes to pick a step up, which is now the wake-up.

It installs only on the vLLM releases ``upstream_gate`` lists for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import upstream_gate

MARKER = "_pcp_nixl_cpu_idle_wait"
#: Seconds a reader spins after its last read before it blocks (vLLM's default: 1.0).
BUSY_LOOP_S = 0.0


def blocking_init(original: Callable[..., None], cap_s: float) -> Callable[..., None]:
    """A ``SpinCondition.__init__`` (same parameters) that caps the readers' busy loop at
    ``cap_s``."""

    def __init__(
        self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1.0
    ) -> None:
        original(self, is_reader, context, notify_address, min(busy_loop_s, cap_s))

    setattr(__init__, MARKER, True)
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def install(
    spin_cls: Any, busy_loop_s: float = BUSY_LOOP_S, vllm_version: str | None = None
) -> bool:
    """Patch ``spin_cls.__init__`` once; False when it already is. Refuses a vLLM the fix was not
    checked against (``upstream_gate``; default: the installed vLLM)."""
    upstream_gate.check(upstream_gate.IDLE_WAIT, vllm_version)
    current = spin_cls.__init__
    if getattr(current, MARKER, False):
        return False
    spin_cls.__init__ = blocking_init(current, busy_loop_s)
    return True


def installed(spin_cls: Any) -> bool:
    return bool(getattr(spin_cls.__init__, MARKER, False))
