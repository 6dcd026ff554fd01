"""Workers block on the next step instead of spinning: vLLM's real shared-memory ring, one writer
and one reader, the reader's CPU time while it waits half a second for a step."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pcp_nixl_connector.cpu_compat import idle_wait, upstream_gate

pytestmark = pytest.mark.vllm

WAIT_S = 0.5


@pytest.fixture
def spin_cls(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's SpinCondition with its own ``__init__``, restored after the test."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    stock = SpinCondition.__init__
    monkeypatch.setattr(SpinCondition, "__init__", getattr(stock, "__wrapped__", stock))
    return SpinCondition


def reader_waits() -> dict[str, Any]:
    """A step, then the next one ``WAIT_S`` later: what the reader got, its CPU seconds while it
    waited for the second, and its busy loop."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    handle = writer.export_handle()
    seen: dict[str, Any] = {}

    def read() -> None:
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        seen["first"] = reader.dequeue(timeout=30)
        started = time.thread_time()
        seen["second"] = reader.dequeue(timeout=30)
        seen["cpu_s"] = time.thread_time() - started
        seen["busy_loop_s"] = reader._spin_condition.busy_loop_s

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    writer.wait_until_ready()
    writer.enqueue("step 1")
    time.sleep(WAIT_S)
    writer.enqueue("step 2")
    thread.join(30)
    assert not thread.is_alive(), "the reader never got the second step"
    return seen


def test_stock_readers_spin_while_they_wait(spin_cls: type) -> None:
    """The upstream behaviour the fix exists for (fails once vLLM stops spinning by default)."""
    seen = reader_waits()
    assert (seen["first"], seen["second"]) == ("step 1", "step 2")
    assert seen["busy_loop_s"] == 1
    assert seen["cpu_s"] > WAIT_S / 5, seen


def test_with_the_fix_a_waiting_reader_blocks_and_still_gets_every_step(spin_cls: type) -> None:
    assert idle_wait.install(spin_cls, vllm_version="0.32.0") is True
    assert idle_wait.install(spin_cls, vllm_version="0.32.0") is False
    seen = reader_waits()
    assert (seen["first"], seen["second"]) == ("step 1", "step 2")
    assert seen["busy_loop_s"] == idle_wait.BUSY_LOOP_S == 0
    assert seen["cpu_s"] < WAIT_S / 20, seen


def test_an_unchecked_vllm_is_refused(spin_cls: type) -> None:
    with pytest.raises(upstream_gate.UpstreamGateError, match="busy loop"):
        idle_wait.install(spin_cls, vllm_version="0.34.0")
    assert not idle_wait.installed(spin_cls)
