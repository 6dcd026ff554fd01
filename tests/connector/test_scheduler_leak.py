"""Real vLLM Scheduler + KVOutputAggregator: stock leaks the PCP2 blocks, ours frees them."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

REQ = "req-pcp2"


def _facades(cls_name: str, cfg: Any, pcp: int) -> tuple[list[Any], list[Any]]:
    """Worker-side facades of ``cls_name`` for each PCP rank, over stand-in workers."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from pcp_nixl_connector import PcpCanonicalNixlConnector
    from pcp_nixl_connector.connector import layout_from_config
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats
    from tests.connector.pcp_sim import StubPcpWorker

    facades, workers = [], []
    for rank in range(pcp):
        if cls_name == "stock":
            worker = StubPcpWorker(pcp_rank=rank, xfer_stats=NixlKVConnectorStats())
            facade = object.__new__(NixlPullConnector)
        else:
            worker = StubPcpWorker(pcp_rank=rank, xfer_stats=PcpNixlKVConnectorStats())
            facade = object.__new__(PcpCanonicalNixlConnector)
            facade.pcp_layout = layout_from_config(cfg)
        facade.kv_transfer_config = cfg.kv_transfer_config
        facade.connector_worker = worker
        if cls_name != "stock":
            facade._bind_rank(rank)
        facades.append(facade)
        workers.append(worker)
    return facades, workers


def _run_until_sent(sim: Any) -> None:
    """Prefill the request (1 token) and ship reqs_to_send to the ranks."""
    from tests.connector.pcp_sim import make_remote_decode_request

    sim.scheduler.add_request(make_remote_decode_request(REQ))
    sim.step()  # prefill + sample -> request finishes, blocks held for decode
    assert REQ in sim.scheduler.requests
    sim.step()  # reqs_to_send reaches the workers


def _held_until_decode_reads_then_all_freed(sim: Any) -> None:
    """Rank 1 has reported (suppressed or counted) and rank 0 waits for decode's read: nothing is
    freed until that read, then the request and every block are."""
    for _ in range(3):
        assert sim.step() == set()
    assert REQ in sim.scheduler.requests
    assert sim.free_blocks < sim.usable_blocks

    sim.workers[0].decode_read(REQ)
    assert sim.step() == {REQ}
    assert REQ not in sim.scheduler.requests
    assert sim.free_blocks == sim.usable_blocks
    assert all(b.ref_cnt == 0 for b in sim.scheduler.kv_cache_manager.block_pool.blocks[1:])


def _sim(tiny_model_dir, connector: str, module: str | None, extra=None):
    from tests.connector.pcp_sim import PdProducerSim, make_config

    cfg = make_config(tiny_model_dir, connector, module, pcp=2, extra=extra)
    facades, workers = _facades("stock" if module is None else "ours", cfg, pcp=2)
    return PdProducerSim(cfg, facades, workers)


def test_stock_nixl_leaks_replicated_pcp2_blocks(tiny_model_dir):
    """Upstream bug (run on the installed 0.32; its parts are read from every supported release's
    code by the static canaries). If this fails, upstream fixed it: revisit the kit."""
    sim = _sim(tiny_model_dir, "NixlPullConnector", None)
    assert sim.aggregator._expected_finished_count == 2
    _run_until_sent(sim)
    sim.workers[0].decode_read(REQ)
    for _ in range(4):
        sim.step()
    assert REQ in sim.scheduler.requests, "stock vLLM freed the PCP2 request: upstream fixed?"
    leaked = sim.usable_blocks - sim.free_blocks
    assert leaked == 3  # 80 prompt tokens in 32-token blocks


@pytest.mark.parametrize("mode", ["canonical", "world_size"])
def test_ours_frees_every_block_only_after_the_canonical_report(
    tiny_model_dir, env_connector_names, mode
):
    name, module = env_connector_names
    sim = _sim(tiny_model_dir, name, module, extra={"pcp_completion_mode": mode})
    assert sim.aggregator._expected_finished_count == (1 if mode == "canonical" else 2)
    _run_until_sent(sim)
    _held_until_decode_reads_then_all_freed(sim)

    totals: dict[str, int] = {}
    for stats in sim.stats:
        for key, value in stats.dedup_totals().items():
            totals[key] = totals.get(key, 0) + value
    assert totals["num_pcp_canonical_completions"] == 1
    assert totals["num_pcp_finished_sending_suppressed"] == (1 if mode == "canonical" else 0)


# -- inside vLLM's MultiConnector ---------------------------------------------------------------
COUNTLESS = {
    "kv_connector": "CountlessConnector",
    "kv_connector_module_path": "tests.connector.countless_connector",
    "kv_role": "kv_producer",
}


def _multiconnector_sim(tiny_model_dir, env_connector_names, monkeypatch, mode=None):
    """vLLM's real MultiConnector around the kit's connector and a child whose
    get_finished_count() is None, on the scheduler and on each PCP rank's worker.

    The workers' MultiConnectors are built for real too (so the kit's worker-side constructor
    decides its mode itself), over stand-in NIXL workers: the NIXL worker and the PCP group are
    the two things this harness has no process for."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    import pcp_nixl_connector.connector as kit
    from tests.connector.pcp_sim import (
        PdProducerSim,
        StubPcpWorker,
        make_config,
        make_kv_cache_config,
    )

    name, module = env_connector_names
    child: dict[str, Any] = {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_producer",
    }
    if mode is not None:
        child["kv_connector_extra_config"] = {"pcp_completion_mode": mode}
    cfg = make_config(
        tiny_model_dir, "MultiConnector", None, pcp=2, extra={"connectors": [child, COUNTLESS]}
    )
    workers = [StubPcpWorker(pcp_rank=rank, xfer_stats=None) for rank in range(2)]
    facades = []
    for rank, worker in enumerate(workers):
        monkeypatch.setattr(kit, "NixlPullConnectorWorker", lambda *_a, w=worker: w)
        monkeypatch.setattr(kit, "resolve_pcp_rank", lambda _layout, r=rank: r)
        facades.append(MultiConnector(cfg, KVConnectorRole.WORKER, make_kv_cache_config()))
    return PdProducerSim(cfg, facades, workers, multi=True)


def _kit_children(multi: Any) -> list[Any]:
    from pcp_nixl_connector import PcpCanonicalNixlConnector

    return [c for c in multi.sub_connectors if isinstance(c, PcpCanonicalNixlConnector)]


@pytest.mark.parametrize("mode", [None, "world_size"])
def test_multiconnector_replicated_pcp2_producer_frees_every_block(
    tiny_model_dir, env_connector_names, monkeypatch, mode
):
    """Inside MultiConnector (beside a child whose count is None) the kit's connector runs in
    world_size mode - chosen by itself when unset - and every block is freed once rank 0's
    report arrives, not before."""
    sim = _multiconnector_sim(tiny_model_dir, env_connector_names, monkeypatch, mode)
    assert sim.scheduler.connector.get_finished_count() is None
    assert sim.aggregator._expected_finished_count == 2
    for multi in (sim.scheduler.connector, *sim.facades):
        (kit,) = _kit_children(multi)
        assert kit.in_multiconnector and kit.pcp_layout.mode.value == "world_size"
    assert [_kit_children(f)[0].pcp_rank for f in sim.facades] == [0, 1]

    _run_until_sent(sim)
    _held_until_decode_reads_then_all_freed(sim)
    totals: dict[str, int] = {}
    for grouped in sim.stats:  # MultiKVConnectorStats: one entry per child class
        for key, value in grouped["PcpCanonicalNixlConnector"].dedup_totals().items():
            totals[key] = totals.get(key, 0) + value
    assert totals["num_pcp_canonical_completions"] == 1
    assert totals["num_pcp_finished_sending_suppressed"] == 0


def test_multiconnector_canonical_would_leak_without_the_detection(
    tiny_model_dir, env_connector_names, monkeypatch
):
    """The counterfactual: the same stack with the MultiConnector detection switched off runs
    the default canonical mode and leaks the request's blocks - what the detection prevents."""
    import pcp_nixl_connector.connector as kit

    monkeypatch.setattr(kit, "inside_multiconnector", lambda: False)
    sim = _multiconnector_sim(tiny_model_dir, env_connector_names, monkeypatch)
    assert _kit_children(sim.scheduler.connector)[0].pcp_layout.mode.value == "canonical"
    assert sim.aggregator._expected_finished_count == 2  # MultiConnector drops the TP x PP count
    _run_until_sent(sim)
    sim.workers[0].decode_read(REQ)
    for _ in range(4):
        sim.step()
    assert REQ in sim.scheduler.requests
    assert sim.usable_blocks - sim.free_blocks == 3


def test_multiconnector_refuses_an_explicit_canonical_mode_by_name(
    tiny_model_dir, env_connector_names, monkeypatch
):
    with pytest.raises(ValueError, match=r"'pcp_completion_mode'\] = 'canonical' inside vLLM's"):
        _multiconnector_sim(tiny_model_dir, env_connector_names, monkeypatch, mode="canonical")
