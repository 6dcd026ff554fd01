"""Two spawned PCP ranks (real gloo group, factory-built connector, real nixl on CPU memory).

One spawn runs both completion modes (``canonical``, then ``world_size``) against vLLM's real
pull worker, scheduler-side connector, ``KVOutputAggregator`` and Prometheus logger.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
from pathlib import Path
from typing import Any

import pytest

from pcp_nixl_connector import DEDUP_METRIC_NAMES
from pcp_nixl_connector.metric_names import (
    CANONICAL_COMPLETIONS,
    EXPECTED_SUPPRESSED_PER_COMPLETION,
    FINISHED_SENDING_SUPPRESSED,
    HANDSHAKE_PUBLICATIONS_SKIPPED,
)
from tests.connector import pcp_rank_proc
from tests.support.net import free_ports

pytestmark = pytest.mark.vllm

RANK_TIMEOUT_S = 200
MODES = ("canonical", "world_size")
SKIPPED, SUPPRESSED, CANONICAL = (
    f"{n}_total"
    for n in (HANDSHAKE_PUBLICATIONS_SKIPPED, FINISHED_SENDING_SUPPRESSED, CANONICAL_COMPLETIONS)
)


def _spawn_ranks(model_dir: Path, names: tuple[str, str]) -> dict[int, dict[str, Any]]:
    """{rank: {mode: what the rank saw}}."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    assert pcp_rank_proc.MODES == MODES
    dist_port, *side = free_ports(1 + len(MODES))
    side_ports = dict(zip(MODES, side, strict=True))
    procs = [
        ctx.Process(
            target=pcp_rank_proc.run_rank,
            args=(rank, dist_port, side_ports, str(model_dir), names, q),
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
def ranks(tiny_model_dir, env_connector_names):
    # spawn hands the children this interpreter's sys.path: they import tests.connector too.
    return _spawn_ranks(tiny_model_dir, env_connector_names)


def _by_mode(ranks: dict, mode: str) -> dict[int, dict[str, Any]]:
    return {r: ranks[r][mode] for r in (0, 1)}


@pytest.mark.parametrize("mode", MODES)
def test_factory_builds_our_connector_on_both_ranks(ranks, env_connector_names, mode):
    got = _by_mode(ranks, mode)
    assert [got[r]["class"] for r in (0, 1)] == [env_connector_names[0]] * 2
    assert [got[r]["pcp_group_rank"] for r in (0, 1)] == [0, 1]
    assert {got[r]["stats_type"] for r in (0, 1)} == {"PcpNixlKVConnectorStats"}


@pytest.mark.parametrize("mode", MODES)
def test_only_rank0_metadata_is_published_and_served(ranks, mode):
    got = _by_mode(ranks, mode)
    assert [got[r]["published"] for r in (0, 1)] == [True, False]
    assert got[0]["published_keys"] == [(0, 0)]
    assert got[0]["own_metadata"] != got[1]["own_metadata"]
    assert got[0]["served"] == got[0]["own_metadata"]


def test_canonical_rank1_completions_suppressed_rank0_reports(ranks):
    got = _by_mode(ranks, "canonical")
    req = "req-pcp-proc-canonical"
    assert got[0]["finished_count"] == 1 == got[0]["aggregator_expected"]  # TP x PP
    assert all(r == [] for r in got[1]["reports"])
    assert got[1]["dedup_totals"]["num_pcp_finished_sending_suppressed"] == 1
    assert got[0]["reports"][-1] == [req]
    assert sum(len(r) for r in got[0]["reports"]) == 1
    assert got[0]["aggregated_finished_sending"] == [req]  # freed after rank 0's report


def test_world_size_rank1_reports_nothing_suppressed(ranks):
    got = _by_mode(ranks, "world_size")
    req = "req-pcp-proc-world_size"
    # Scheduler side: stock count, world_size reports per request.
    assert got[0]["finished_count"] is None
    assert got[0]["aggregator_expected"] == 2
    # Rank 1 (stock pull worker) reports at once and it is passed through, not suppressed.
    assert [req] in got[1]["reports"]
    assert got[1]["dedup_totals"]["num_pcp_finished_sending_suppressed"] == 0
    assert got[1]["dedup_totals"]["num_pcp_canonical_completions"] == 0  # not canonical
    assert got[0]["reports"][-1] == [req]
    assert sum(len(r) for r in got[0]["reports"]) == 1
    # Both ranks' reports complete the request in the aggregator (freed after rank 0's).
    assert got[0]["aggregated_finished_sending"] == [req]


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*engine=\"0\"[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from the Prometheus text"
    return float(m.group(1))


# mode -> (skipped, suppressed, canonical, expected suppressed per completion) after the request
PROM_AFTER = {"canonical": (1.0, 1.0, 1.0, 1.0), "world_size": (1.0, 0.0, 1.0, 0.0)}


@pytest.mark.parametrize("mode", MODES)
def test_counters_in_vllm_prometheus_text(ranks, mode):
    before, after = ranks[0][mode]["prom_text"].split("\n#--after--\n")
    skipped, suppressed, canonical, expected = PROM_AFTER[mode]
    assert set(DEDUP_METRIC_NAMES) == {
        SKIPPED,
        SUPPRESSED,
        CANONICAL,
        EXPECTED_SUPPRESSED_PER_COMPLETION,
    }
    for name in (SKIPPED, SUPPRESSED, CANONICAL):
        assert _sample(before, name) == 0.0
    # The gauge holds its config-derived value from startup (p - 1 = 1 only in canonical mode).
    assert _sample(before, EXPECTED_SUPPRESSED_PER_COMPLETION) == expected
    assert _sample(after, EXPECTED_SUPPRESSED_PER_COMPLETION) == expected
    assert _sample(after, SKIPPED) == skipped
    assert _sample(after, SUPPRESSED) == suppressed
    assert _sample(after, CANONICAL) == canonical
    # vLLM's own NIXL metrics keep working (rank 0's lease expired once).
    assert _sample(after, "vllm:nixl_num_kv_expired_reqs_total") == 1.0
