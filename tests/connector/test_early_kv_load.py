"""When a step's NIXL reads are posted and stamped. ``cpu_early_kv_load``: when the worker binds
the step's metadata (before vLLM's forward), exactly once per step, only where asked (CPU, knob
on); ``read_posted``: as each read is handed to NIXL, before UCX copies it."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _connector(early: bool, waiting: set[str] | None = None) -> tuple[Any, list[list[str]]]:
    """A worker-side connector over a recording stand-in for vLLM's pull worker, whose
    ``start_load_kv`` posts each request's read through ``_read_blocks`` as vLLM's does; a
    request in ``waiting`` (its peer's handshake not done) is posted a step later."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from pcp_nixl_connector import PcpCanonicalNixlConnector
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats

    posted: list[list[str]] = []
    held = set(waiting or ())
    worker = object.__new__(NixlPullConnectorWorker)
    worker._read_blocks = lambda read_spec, dst_engine_id, request_id, **_: True  # type: ignore[method-assign]

    def start_load_kv(metadata: Any) -> None:
        posted.append(sorted(metadata.reqs_to_recv))
        ready = sorted(held - set(metadata.reqs_to_recv))  # handshake done since
        held.difference_update(ready)
        for rid in sorted(metadata.reqs_to_recv) + ready:
            if rid not in held:
                worker._read_blocks(read_spec=None, dst_engine_id="p", request_id=rid)

    worker.start_load_kv = start_load_kv  # type: ignore[method-assign]
    worker.xfer_stats = PcpNixlKVConnectorStats()
    conn = object.__new__(PcpCanonicalNixlConnector)
    conn.connector_worker = worker
    conn._connector_metadata = None
    conn._loads_posted = False
    conn._early_kv_load = early
    conn._stamp_reads(worker)
    return conn, posted


def _metadata(*req_ids: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = NixlConnectorMetadata()
    for rid in req_ids:
        meta.reqs_to_recv[rid] = object()  # type: ignore[assignment]
    return meta


def _step(conn: Any, meta: Any, posted: list[list[str]]) -> tuple[int, int]:
    """One step as vLLM's model runner drives it: bind, forward, start_load_kv after it."""
    conn.bind_connector_metadata(meta)
    before_forward = len(posted)
    conn.start_load_kv(None)
    return before_forward, len(posted)


def test_early_reads_are_posted_before_the_forward_and_once() -> None:
    conn, posted = _connector(early=True)
    assert _step(conn, _metadata("a", "b"), posted) == (1, 1)
    assert posted == [["a", "b"]]
    # a step with nothing to receive keeps vLLM's order (the worker still runs its bookkeeping)
    assert _step(conn, _metadata(), posted) == (1, 2)
    assert _step(conn, _metadata("c"), posted) == (3, 3)
    from pcp_nixl_connector.metric_names import HANDOVER_EVENTS_KEY

    stamped = conn.connector_worker.xfer_stats.data[HANDOVER_EVENTS_KEY]
    assert sorted(e[0] for e in stamped) == ["a", "b", "c"]  # read posted, once each


def test_without_the_knob_reads_follow_the_forward_as_in_vllm() -> None:
    conn, posted = _connector(early=False)
    assert _step(conn, _metadata("a"), posted) == (0, 1)
    assert posted == [["a"]]


def _stamps(conn: Any) -> dict[str, float]:
    from pcp_nixl_connector.metric_names import HANDOVER_EVENTS_KEY

    events = conn.connector_worker.xfer_stats.data[HANDOVER_EVENTS_KEY]
    assert all(name == "read_posted" for _, name, _ in events)
    assert len({rid for rid, _, _ in events}) == len(events), "a read stamped twice"
    return {rid: when for rid, _, when in events}


def test_read_posted_is_stamped_as_the_read_is_handed_to_nixl_not_after_the_copy() -> None:
    """UCX copies host memory inside the post call (cma): the stamp goes before it, so the
    copy counts in read posted -> transfer done, not in the wait before the read."""
    conn, posted = _connector(early=False)
    worker = conn.connector_worker
    copied: dict[str, tuple[float, float]] = {}

    def slow_copy(read_spec: Any, dst_engine_id: str, request_id: str, **_: Any) -> bool:
        start = time.monotonic()
        time.sleep(0.02)
        copied[request_id] = (start, time.monotonic())
        return True

    worker._read_blocks = slow_copy  # type: ignore[method-assign]
    conn._stamp_reads(worker)
    _step(conn, _metadata("a", "b"), posted)
    stamps = _stamps(conn)
    for rid in ("a", "b"):
        assert stamps[rid] <= copied[rid][0], f"{rid} stamped after its copy began"
    assert stamps["b"] >= copied["a"][1], "b's read was stamped before it was handed over"


def test_a_read_waiting_for_its_handshake_is_stamped_when_posted() -> None:
    """The first call may only start the peer's handshake: the read, and its stamp, come a
    step later, from vLLM's queue of requests whose handshake finished."""
    conn, posted = _connector(early=False, waiting={"late"})
    _step(conn, _metadata("now", "late"), posted)
    assert set(_stamps(conn)) == {"now"}
    time.sleep(0.005)
    between = time.monotonic()
    _step(conn, _metadata(), posted)
    stamps = _stamps(conn)
    assert set(stamps) == {"now", "late"} and stamps["late"] >= between


def test_a_positional_request_id_is_stamped_too() -> None:
    conn, _ = _connector(early=False)
    conn.connector_worker._read_blocks(None, "p", "pos")
    assert set(_stamps(conn)) == {"pos"}
