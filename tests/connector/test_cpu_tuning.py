"""CPU knobs: validation, the progress-delay config swap, and the affinity restore."""

from __future__ import annotations

import os
import types

import pytest

from pcp_nixl_connector.cpu_tuning import (
    CpuKnobs,
    delayed_agent_config_cls,
    tuned_worker_init,
)

KNOBS = {"cpu_nixl_progress_delay_us": 1000, "cpu_skip_kv_core_pinning": True}


def test_absent_keys_are_stock():
    assert CpuKnobs.from_extra_config({}).is_stock
    assert CpuKnobs.from_extra_config(None).is_stock
    knobs = CpuKnobs.from_extra_config(KNOBS)
    assert (knobs.progress_delay_us, knobs.skip_kv_core_pinning) == (1000, True)
    assert not knobs.is_stock


@pytest.mark.parametrize(
    "extra",
    [
        {"cpu_nixl_progress_delay_us": -1},
        {"cpu_nixl_progress_delay_us": "1000"},
        {"cpu_nixl_progress_delay_us": 1.5},
        {"cpu_nixl_progress_delay_us": True},
        {"cpu_skip_kv_core_pinning": "true"},
        {"cpu_skip_kv_core_pinning": 1},
        {"cpu_early_kv_load": "yes"},
        {"cpu_early_kv_load": 0},
    ],
)
def test_bad_values_are_clear_errors(extra):
    with pytest.raises(ValueError, match=next(iter(extra))):
        CpuKnobs.from_extra_config(extra)


class _FakeBindConfig:
    """Shaped like nixl's pybind ``nixlAgentConfig`` (a ``pthrDelay`` property)."""

    def __init__(self) -> None:
        self._delay = 0

    pthrDelay = property(lambda self: self._delay, lambda self, v: setattr(self, "_delay", v))


def _fake_wrapper_module(name: str) -> type:
    """An agent class built like ``nixl_agent``: config from ``nixlBind``, delay forced to 0."""
    module = types.ModuleType(name)
    module.nixlBind = types.SimpleNamespace(nixlAgentConfig=_FakeBindConfig)

    class Agent:
        def __init__(self) -> None:
            cfg = module.nixlBind.nixlAgentConfig()
            cfg.pthrDelay = 0
            self.delay = cfg.pthrDelay

    Agent.__module__ = name
    module.Agent = Agent
    import sys

    sys.modules[name] = module
    return Agent


def test_delayed_config_ignores_the_hard_coded_zero():
    cfg = delayed_agent_config_cls(_FakeBindConfig, 750)()
    cfg.pthrDelay = 0
    assert cfg.pthrDelay == 750


def test_progress_delay_applies_only_inside_worker_init():
    agent_cls = _fake_wrapper_module("fake_nixl_api_for_test")
    knobs = CpuKnobs(progress_delay_us=1000)
    with tuned_worker_init(knobs, is_cpu=lambda: True, wrapper_cls=lambda: agent_cls):
        assert agent_cls().delay == 1000
    assert agent_cls().delay == 0


def test_knobs_ignored_off_cpu():
    agent_cls = _fake_wrapper_module("fake_nixl_api_for_test2")
    with tuned_worker_init(
        CpuKnobs(progress_delay_us=1000), is_cpu=lambda: False, wrapper_cls=lambda: agent_cls
    ):
        assert agent_cls().delay == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
@pytest.mark.parametrize("skip", [True, False])
def test_pinning_is_undone_only_when_asked(skip):
    before = os.sched_getaffinity(0)
    last = {max(before)}
    try:
        with tuned_worker_init(CpuKnobs(skip_kv_core_pinning=skip), is_cpu=lambda: True):
            os.sched_setaffinity(0, last)  # what vLLM's NIXL worker does on CPU
        assert os.sched_getaffinity(0) == (before if skip else last)
    finally:
        os.sched_setaffinity(0, before)


def test_real_nixl_binding_takes_the_delay():
    nixl_api = pytest.importorskip("nixl._api")
    base = nixl_api.nixlBind.nixlAgentConfig
    cfg = delayed_agent_config_cls(base, 1000)()
    cfg.pthrDelay = 0  # nixl_agent.__init__ does exactly this
    assert cfg.pthrDelay == 1000
    assert isinstance(cfg, base)


def test_pinning_outside_a_cpuset_never_reaches_the_kernel():
    """In a container with a cpuset, NIXL's host-wide "last core" is outside the allowed set:
    the call itself fails with EINVAL, so skipping must stop the call, not undo it."""
    outside = {os.cpu_count() + 64}
    with pytest.raises(OSError):
        os.sched_setaffinity(0, outside)
    before = os.sched_getaffinity(0)
    with tuned_worker_init(CpuKnobs(skip_kv_core_pinning=True), is_cpu=lambda: True):
        os.sched_setaffinity(0, outside)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(OSError):
        os.sched_setaffinity(0, outside)  # the real call is back after the worker is built
