"""Body of one spawned PCP rank: real gloo PCP group, connector from vLLM's factory, real nixl.

Run by ``test_pcp_processes.py`` in a fresh process per rank; reports plain
data back through a queue so the test process never needs a PCP group. One
spawn runs every completion mode in turn (``MODES``) on the same PCP group, each
with its own config, connectors, request and side-channel port, so the ~35 s
process and group setup is paid once.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

MODES = ("canonical", "world_size")


def request_id(mode: str) -> str:
    return f"req-pcp-proc-{mode}"


def _config(model_dir: str, name: str, module: str, mode: str) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    cfg = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
        cache_config=CacheConfig(block_size=32),
        kv_transfer_config=KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_producer",
            kv_buffer_device="cpu",
            kv_connector_extra_config={"backends": ["UCX"], "pcp_completion_mode": mode},
        ),
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"
    cfg.parallel_config.prefill_context_parallel_size = 2
    cfg.parallel_config.world_size = 2
    return cfg


def _kv_cache(cfg: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    hf = cfg.model_config.hf_config
    heads, head = hf.num_key_value_heads, hf.head_dim
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    num_blocks, block = 8, 32
    kv_cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layers,
                FullAttentionSpec(
                    block_size=block, num_kv_heads=heads, head_size=head, dtype=torch.float32
                ),
            )
        ],
    )
    # LBHNC, blocks first: (blocks, K/V, heads, tokens, channels) per layer.
    shape = (num_blocks, 2, heads, block, head)
    return kv_cfg, {name: torch.zeros(shape, dtype=torch.float32) for name in layers}


def run_rank(rank: int, dist_port: int, side_ports: dict, model_dir: str, names: tuple, q) -> None:
    try:
        q.put((rank, "result", _run(rank, dist_port, side_ports, model_dir, names)))
    except BaseException:  # report everything; the parent fails the test
        q.put((rank, "error", traceback.format_exc()))


def _run(rank: int, dist_port: int, side_ports: dict, model_dir: str, names: tuple) -> dict:
    """{mode: what this rank saw in that mode}, every mode on one PCP group."""
    os.environ.update(
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        UCX_TLS="tcp,self,sm",
        UCX_NET_DEVICES="lo",
    )
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    name, module = names
    cfgs = {mode: _config(model_dir, name, module, mode) for mode in MODES}
    with set_current_vllm_config(cfgs[MODES[0]]):
        ps.init_distributed_environment(
            world_size=2,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
            local_rank=rank,
            backend="gloo",
        )
        ps.ensure_model_parallel_initialized(1, 1, prefill_context_model_parallel_size=2)
    results = {}
    for mode in MODES:
        # vLLM reads its env vars on use (the engine's env cache is not enabled here).
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_ports[mode])
        with set_current_vllm_config(cfgs[mode]):
            results[mode] = _run_mode(rank, cfgs[mode], request_id(mode), side_ports[mode])
    return results


def _run_mode(rank: int, cfg: Any, req: str, side_port: int) -> dict:
    import msgspec
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    out: dict[str, Any] = {}
    out["pcp_group_rank"] = ps.get_pcp_group().rank_in_group
    kv_cfg, caches = _kv_cache(cfg)
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cfg)
    out["class"] = type(conn).__name__
    conn.register_kv_caches(caches)

    # What the worker hands the engine core (gpu_worker: keyed by (pp, tp)).
    md = conn.get_handshake_metadata()
    own = conn.connector_worker.xfer_handshake_metadata
    enc = msgspec.msgpack.Encoder()
    published = None if md is None else {(0, 0): enc.encode(md)}
    out["published"] = published is not None
    out["own_metadata"] = enc.encode(own)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, published)

    # A request rank 0 must serve: lease expires quickly so rank 0 reports. Rank 1 (stock
    # pull worker) reports it at once; canonical mode suppresses that report.
    meta = NixlConnectorMetadata()
    meta.reqs_to_send = {req: time.perf_counter() + 1.0}
    meta.reqs_in_batch = {req}
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    conn.clear_connector_metadata()
    reports: list[set[str]] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        reports.append(set(conn.get_transfer_results(set()).finished_sending))
        if rank == 1 and len(reports) >= 3 or any(reports):
            break
        time.sleep(0.2)
    out["reports"] = [sorted(r) for r in reports]
    stats = conn.get_kv_connector_stats()
    out["stats_type"] = type(stats).__name__ if stats is not None else None
    out["dedup_totals"] = None if stats is None else stats.dedup_totals()
    all_stats: list[Any] = [None, None]
    dist.all_gather_object(all_stats, None if stats is None else stats.data)
    all_sent: list[Any] = [None, None]
    dist.all_gather_object(all_sent, set().union(*reports))

    if rank == 0:
        out.update(_engine_core_side(cfg, kv_cfg, gathered, all_stats, all_sent, side_port))
    dist.barrier()
    conn.shutdown()
    return out


def _engine_core_side(cfg, kv_cfg, gathered, all_stats, all_sent, side_port) -> dict:
    """What EngineCore + scheduler + API server do with the ranks' outputs."""
    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlHandshakePayload,
    )
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    out: dict[str, Any] = {}
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cfg)
    out["finished_count"] = sched.get_finished_count()
    # core.py: merge the non-None per-worker dicts keyed by (pp_rank, tp_rank).
    dec = msgspec.msgpack.Decoder(NixlHandshakePayload)
    content: dict = {}
    for worker_dict in gathered:
        if worker_dict is not None:
            content.update({k: dec.decode(v) for k, v in worker_dict.items()})
    out["published_keys"] = sorted(content)
    sched.set_xfer_handshake_metadata_pp_aware(content)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{side_port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        served, _ts = sock.recv_multipart()
        out["served"] = served
    finally:
        sock.close()
        ctx.term()
        sched.shutdown()

    # Executor: aggregate the ranks' reports and stats; API server: vLLM's Prometheus logger.
    from copy import copy

    agg = KVOutputAggregator.from_connector(sched, cfg.parallel_config.world_size)
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    outputs = []
    for data, sent in zip(all_stats, all_sent, strict=True):
        mro = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        mro.kv_connector_output = KVConnectorOutput(
            finished_sending=sent or None,
            kv_connector_stats=None if data is None else cls.build_kv_connector_stats(data),
        )
        outputs.append(mro)
    out["aggregator_expected"] = agg._expected_finished_count
    merged = agg.aggregate(outputs).kv_connector_output
    out["aggregated_finished_sending"] = sorted(merged.finished_sending or ())
    out["prom_text"] = _prometheus_text(cfg, merged.kv_connector_stats.data)
    return out


def _prometheus_text(cfg: Any, stats_data: dict) -> str:
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    logger = PrometheusStatLogger(cfg, engine_indexes=[0])
    before = prometheus_client.generate_latest().decode()
    logger.record(
        scheduler_stats=SchedulerStats(kv_connector_stats=stats_data),
        iteration_stats=None,
        engine_idx=0,
    )
    return before + "\n#--after--\n" + prometheus_client.generate_latest().decode()
