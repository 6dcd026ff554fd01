"""cpu_early_kv_load: a step's NIXL reads are posted when the worker binds the step's metadata
(before vLLM's forward), exactly once per step, and only where asked (CPU, knob on)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _connector(early: bool) -> tuple[Any, list[list[str]]]:
    """A worker-side connector over a recording stand-in for vLLM's pull worker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from pcp_nixl_connector import PcpCanonicalNixlConnector
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats

    posted: list[list[str]] = []
    worker = object.__new__(NixlPullConnectorWorker)
    worker.start_load_kv = lambda metadata: posted.append(sorted(metadata.reqs_to_recv))  # type: ignore[method-assign]
    worker.xfer_stats = PcpNixlKVConnectorStats()
    conn = object.__new__(PcpCanonicalNixlConnector)
    conn.connector_worker = worker
    conn._connector_metadata = None
    conn._loads_posted = False
    conn._early_kv_load = early
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
