"""Two spawned PCP ranks (real gloo group, factory-built connector, real nixl on CPU memory)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import CONNECTOR_DIR
from pcp_nixl_connector import DEDUP_METRIC_NAMES

pytestmark = pytest.mark.vllm

RANK_TIMEOUT_S = 150


def _free_port() -> int:
    """A free loopback port in the kit's test range 15000-15999."""
    for port in range(15600, 15999):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15600-15999")


def _spawn_ranks(model_dir: Path, names: tuple[str, str]) -> dict[int, dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).parent))
    import pcp_rank_proc

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dist_port = _free_port()
    with socket.socket() as hold:  # keep dist_port taken while picking the side port
        hold.bind(("127.0.0.1", dist_port))
        side_port = _free_port()
    procs = [
        ctx.Process(
            target=pcp_rank_proc.run_rank,
            args=(rank, dist_port, side_port, str(model_dir), names, q),
            daemon=True,
        )
        for rank in (0, 1)
    ]
    results: dict[int, dict[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        while len(results) < 2:
            try:
                rank, kind, payload = q.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"PCP rank(s) {sorted({0, 1} - set(results))} timed out")
            if kind == "error":
                pytest.fail(f"PCP rank {rank} failed:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, env_connector_names, monkeypatch_module):
    monkeypatch_module.setenv("PYTHONPATH", f"{CONNECTOR_DIR}:{Path(__file__).parent}")
    return _spawn_ranks(tiny_model_dir, env_connector_names)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp_:
        yield mp_


def test_factory_builds_our_connector_on_both_ranks(ranks, env_connector_names):
    assert [ranks[r]["class"] for r in (0, 1)] == [env_connector_names[0]] * 2
    assert [ranks[r]["pcp_group_rank"] for r in (0, 1)] == [0, 1]


def test_only_rank0_metadata_is_published_and_served(ranks):
    assert [ranks[r]["published"] for r in (0, 1)] == [True, False]
    assert ranks[0]["published_keys"] == [(0, 0)]
    assert ranks[0]["own_metadata"] != ranks[1]["own_metadata"]
    assert ranks[0]["served"] == ranks[0]["own_metadata"]


def test_rank1_completions_suppressed_rank0_reports(ranks):
    assert ranks[0]["finished_count"] == 1  # TP x PP
    assert all(r == [] for r in ranks[1]["reports"])
    assert ranks[0]["reports"][-1] == ["req-pcp-proc"]
    assert sum(len(r) for r in ranks[0]["reports"]) == 1
    assert {ranks[r]["stats_type"] for r in (0, 1)} == {"PcpNixlKVConnectorStats"}


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*engine=\"0\"[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from the Prometheus text"
    return float(m.group(1))


def test_counters_in_vllm_prometheus_text(ranks):
    before, after = ranks[0]["prom_text"].split("\n#--after--\n")
    skipped, suppressed, canonical = DEDUP_METRIC_NAMES
    for name in DEDUP_METRIC_NAMES:
        assert _sample(before, name) == 0.0
    assert _sample(after, skipped) == 1.0
    assert _sample(after, suppressed) == 1.0
    assert _sample(after, canonical) == 1.0
    # vLLM's own NIXL metrics keep working (rank 0's lease expired once).
    assert _sample(after, "vllm:nixl_num_kv_expired_reqs_total") == 1.0
