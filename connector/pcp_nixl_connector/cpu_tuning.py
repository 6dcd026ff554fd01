"""Opt-in CPU-platform knobs for vLLM's NIXL worker.

Why this exists: on the CPU platform stock vLLM + NIXL is unusably slow
(22-112 s per request on a 2-core box) for two reasons, neither of which
vLLM exposes a setting for:

* ``nixl._api.nixl_agent`` hard-codes the progress thread delay
  (``pthrDelay = 0``), so the UCX progress thread busy-polls a core;
* vLLM's NIXL worker on CPU calls ``os.sched_setaffinity(0, <last core of
  each NUMA node>)``, re-pinning the model thread that
  ``VLLM_CPU_OMP_THREADS_BIND`` had placed, which piles both servers of a
  local P/D pair onto one core.

Keys in ``kv_connector_extra_config`` (absent = stock behaviour), effective
only when ``current_platform.is_cpu()``:

* ``cpu_nixl_progress_delay_us`` (int >= 0): progress-thread delay in
  microseconds given to the NIXL agent (1000 measured fine on CPU);
* ``cpu_skip_kv_core_pinning`` (bool): keep the worker thread's CPU affinity
  as it was before the NIXL worker started;
* ``cpu_early_kv_load`` (bool): post a step's NIXL reads when the worker gets
  the step's metadata, before its forward. vLLM starts asynchronous loads
  after the forward *launch* (kv_connector_model_runner_mixin.py:80-90), which
  costs nothing on a GPU but on the CPU is the whole forward: a request handed
  over to a busy decode waited one full decode step before its read began.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# A child of the "vllm" logger so vLLM's handler and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

PROGRESS_DELAY_KEY = "cpu_nixl_progress_delay_us"
SKIP_PINNING_KEY = "cpu_skip_kv_core_pinning"
EARLY_LOAD_KEY = "cpu_early_kv_load"


@dataclass(frozen=True)
class CpuKnobs:
    """Validated CPU knobs; the defaults are stock vLLM behaviour."""

    progress_delay_us: int | None = None
    skip_kv_core_pinning: bool = False
    early_kv_load: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> CpuKnobs:
        extra = extra or {}
        delay = extra.get(PROGRESS_DELAY_KEY)
        if delay is not None and (
            isinstance(delay, bool) or not isinstance(delay, int) or delay < 0
        ):
            raise ValueError(
                f"kv_connector_extra_config[{PROGRESS_DELAY_KEY!r}] must be an int >= 0 "
                f"(microseconds), got {delay!r}"
            )
        flags = {key: extra.get(key, False) for key in (SKIP_PINNING_KEY, EARLY_LOAD_KEY)}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}] must be a bool, got {value!r}"
                )
        return cls(
            progress_delay_us=delay,
            skip_kv_core_pinning=flags[SKIP_PINNING_KEY],
            early_kv_load=flags[EARLY_LOAD_KEY],
        )

    @property
    def is_stock(self) -> bool:
        """Whether the NIXL worker's construction is left alone (the early load is not about
        construction: the connector applies it per step)."""
        return self.progress_delay_us is None and not self.skip_kv_core_pinning


def delayed_agent_config_cls(base: Any, delay_us: int) -> type:
    """Subclass of nixl's bound ``nixlAgentConfig`` whose ``pthrDelay`` is pinned.

    ``nixl_agent.__init__`` writes ``pthrDelay = 0`` after constructing the
    config; this subclass turns that write into ``delay_us``.
    """
    prop = base.pthrDelay

    class DelayedProgressAgentConfig(base):
        @property
        def pthrDelay(self) -> int:
            return prop.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:
            prop.__set__(self, delay_us)

    return DelayedProgressAgentConfig


def _nixl_bindings_for(wrapper_cls: Any) -> Any | None:
    """The pybind module the agent class builds its config from (``nixlBind``)."""
    module = sys.modules.get(getattr(wrapper_cls, "__module__", ""), None)
    bind = getattr(module, "nixlBind", None)
    if bind is None or not hasattr(getattr(bind, "nixlAgentConfig", None), "pthrDelay"):
        return None
    return bind


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _default_wrapper_cls() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    return base_worker.NixlWrapper


@contextmanager
def tuned_worker_init(
    knobs: CpuKnobs,
    *,
    is_cpu: Callable[[], bool] = is_cpu_platform,
    wrapper_cls: Callable[[], Any] = _default_wrapper_cls,
) -> Iterator[None]:
    """Wrap the construction of vLLM's NIXL worker to apply ``knobs``.

    The progress delay is applied by swapping nixl's config class only while
    the worker builds its agent; the pinning is undone by restoring this
    thread's affinity afterwards (the agent's threads start before vLLM pins).
    """
    if knobs.is_stock:
        yield
        return
    if not is_cpu():
        logger.warning("%s/%s ignored: not the CPU platform", PROGRESS_DELAY_KEY, SKIP_PINNING_KEY)
        yield
        return

    bind = None
    original_cfg = None
    if knobs.progress_delay_us is not None:
        bind = _nixl_bindings_for(wrapper_cls())
        if bind is None:
            logger.warning(
                "%s ignored: the NIXL wrapper in use builds no nixlAgentConfig", PROGRESS_DELAY_KEY
            )
        else:
            original_cfg = bind.nixlAgentConfig
            bind.nixlAgentConfig = delayed_agent_config_cls(original_cfg, knobs.progress_delay_us)
    real_setaffinity = os.sched_setaffinity
    if knobs.skip_kv_core_pinning:
        os.sched_setaffinity = _keep_own_affinity(real_setaffinity)
    try:
        yield
    finally:
        os.sched_setaffinity = real_setaffinity
        if bind is not None:
            bind.nixlAgentConfig = original_cfg
            logger.info("NIXL progress thread delay set to %d us", knobs.progress_delay_us)


def _keep_own_affinity(real: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    """``os.sched_setaffinity`` that ignores re-pinning of this thread (pid 0).

    The call must not happen at all, not be undone afterwards: inside a container with a cpuset,
    NIXL's "last core of each NUMA node" (read from /sys, host-wide) is often outside the
    container's cores, and the call itself fails with EINVAL and kills the worker.
    """

    def keep(pid: int, cores: Any) -> None:
        if pid != 0:
            real(pid, cores)
            return
        logger.info(
            "Kept CPU affinity %s instead of NIXL's KV core pinning to %s",
            sorted(os.sched_getaffinity(0)),
            sorted(cores),
        )

    return keep
