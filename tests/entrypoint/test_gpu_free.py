"""The wait for free GPU memory before vLLM starts (compose/entrypoint/vllm_serve/gpu_memory.py),
against a stand-in NVML module with pynvml's call names; the real vllm.third_party.pynvml is loaded
too, to show those names are its own, and vLLM's own default share is read from vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_serve import gpu_memory as free

GIB = 1 << 30


class FakeNvml:
    """pynvml's calls the wait makes, with each GPU's free memory going through ``frees``."""

    def __init__(self, total_gib: float, frees: dict[str, list[float]]) -> None:
        self.total = int(total_gib * GIB)
        self.frees = {gpu: [int(f * GIB) for f in seq] for gpu, seq in frees.items()}
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return str(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        seq = self.frees[handle]
        value = seq.pop(0) if len(seq) > 1 else seq[0]
        return SimpleNamespace(free=value, total=self.total, used=self.total - value)


def test_the_real_pynvml_has_the_calls_the_wait_makes() -> None:
    nvml = free.load_nvml()
    for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByIndex"):
        assert callable(getattr(nvml, name)), name
    assert callable(nvml.nvmlDeviceGetHandleByUUID) and callable(nvml.nvmlDeviceGetMemoryInfo)


def test_free_gpus_start_at_once() -> None:
    nvml = FakeNvml(80, {"0": [79.0], "1": [79.0]})
    logged: list[str] = []
    assert free.wait_with_nvml(["0", "1"], 0.85, GIB, lambda s: False, logged.append, nvml)
    assert logged == [] and nvml.calls == ["init", "shutdown"]


def test_it_waits_until_the_old_server_has_freed_its_memory() -> None:
    """GPU 1 is still held (a previous server shutting down): 20, then 50, then 75 GiB free of
    80; vLLM at 0.85 asks for 68 GiB, plus 1 GiB headroom."""
    nvml = FakeNvml(80, {"0": [79.0], "1": [20.0, 50.0, 75.0]})
    logged: list[str] = []
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return False

    assert free.wait_with_nvml(["0", "1"], 0.85, GIB, wait, logged.append, nvml)
    assert len(waits) == 2
    assert "GPU 1 20.0 of 80.0 GiB free, 49.0 GiB short" in logged[0]
    assert "total x 0.85 (--gpu-memory-utilization) + 1 GiB headroom" in logged[0]
    assert "GPU 0" not in logged[0]
    assert logged[-1].startswith("GPU memory free after ")
    assert nvml.calls == ["init", "shutdown"]


def test_a_stop_while_waiting_returns_false_and_shuts_nvml_down() -> None:
    nvml = FakeNvml(80, {"GPU-aaaa": [10.0]})
    assert not free.wait_with_nvml(["GPU-aaaa"], 0.9, 0, lambda s: True, lambda m: None, nvml)
    assert nvml.calls == ["init", "shutdown"]


@pytest.mark.parametrize(("raw", "want"), [("0.85", 0.85), ("1", 1.0), (" 0.5", 0.5)])
def test_utilization_from_the_flag(raw, want) -> None:
    assert free.utilization(raw) == want


@pytest.mark.vllm
def test_without_the_flag_the_wait_uses_vllms_own_default() -> None:
    """What vLLM asks for when the server passes no --gpu-memory-utilization: the default of the
    installed vLLM's CacheConfig, read from vLLM itself (about 20 s to import), so a vLLM release
    that changes it fails here instead of making the wait ask for the wrong amount."""
    from vllm.config import CacheConfig

    vllm_default = CacheConfig().gpu_memory_utilization
    assert isinstance(vllm_default, float) and 0 < vllm_default <= 1
    assert free.utilization(None) == vllm_default


@pytest.mark.parametrize("raw", ["0", "1.5", "most"])
def test_bad_utilization_is_refused(raw) -> None:
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        free.utilization(raw)


def test_headroom_knob() -> None:
    assert free.headroom_bytes("1") == GIB and free.headroom_bytes("0.5") == GIB // 2
    with pytest.raises(ValueError, match="GPU_FREE_HEADROOM_GIB"):
        free.headroom_bytes("-1")


def test_the_entrypoint_waits_on_the_replicas_in_container_ids(monkeypatch) -> None:
    """main()'s step: the ids it asks NVML about are its CUDA_VISIBLE_DEVICES, the share is the
    server's own --gpu-memory-utilization."""
    nvml = FakeNvml(80, {"2": [10.0, 79.0], "3": [79.0]})
    monkeypatch.setattr(free, "load_nvml", lambda: nvml)
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "KIT_SLOT_DIR": "/run/kit-slots"}
    env |= {"KIT_GPU_FREE_HEADROOM_GIB": "1"}
    stop = SimpleNamespace(wait=lambda s: False, asked=False)
    free.wait_for_gpus(env, ["--gpu-memory-utilization", "0.85"], stop)
    assert nvml.frees["2"] == [int(79.0 * GIB)]  # polled until it was free
    with pytest.raises(SystemExit) as done:
        nvml.frees["2"] = [int(10 * GIB)]
        free.wait_for_gpus(env, [], SimpleNamespace(wait=lambda s: True, asked=True))
    assert done.value.code == 0
