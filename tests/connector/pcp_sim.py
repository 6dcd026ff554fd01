"""Drive vLLM's real Scheduler + KVOutputAggregator for one P-side request with PCP ranks.

Worker side: the connector facade's own ``get_transfer_results`` (stock or
ours) runs on each rank over a stand-in worker that follows the stock NIXL
pull worker's replicated-PCP contract (``pull_worker.py`` in vLLM 0.32):
PCP rank > 0 reports every ``reqs_to_send`` request as sent at once, PCP
rank 0 reports it when the decode side has read it.
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 32
NUM_BLOCKS = 64
EOS = 1


def make_config(
    model_dir: Path,
    connector: str,
    module_path: str | None,
    pcp: int,
    extra: dict[str, Any] | None = None,
) -> VllmConfig:
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32")
    cfg = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module_path,
            kv_role="kv_producer",
            kv_connector_extra_config=extra or {},
        ),
    )
    # The V1-runner check rejects PCP at build time on CPU; set it afterwards.
    cfg.parallel_config.prefill_context_parallel_size = pcp
    cfg.parallel_config.world_size = pcp
    return cfg


def make_kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )


def make_scheduler(cfg: VllmConfig) -> Scheduler:
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=make_kv_cache_config(),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK_SIZE,
    )


_hash_ready = False


def make_remote_decode_request(req_id: str, num_tokens: int = 80) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    req = Request(
        request_id=req_id,
        prompt_token_ids=[(i * 7 + len(req_id)) % 500 + 2 for i in range(num_tokens)],
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    req.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False}
    return req


@dataclass
class StubPcpWorker:
    """Stands in for NixlPullConnectorWorker on one PCP rank (no NIXL)."""

    pcp_rank: int
    xfer_stats: Any
    pcp_dcp_sharded: bool = False
    awaiting_read: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)

    def start_load_kv(self, reqs_to_send: dict[str, float]) -> None:
        if self.pcp_rank > 0:
            self.done.update(reqs_to_send)  # pull_worker.py: "report as sent" at once
        else:
            self.awaiting_read.update(reqs_to_send)

    def _read_blocks(self, *args: Any, **kwargs: Any) -> bool:
        raise AssertionError("a producer's worker never posts a read")

    def decode_read(self, req_id: str) -> None:
        self.awaiting_read.remove(req_id)
        self.done.add(req_id)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        done, self.done = self.done, set()
        return KVConnectorTransferResults(finished_sending=done)

    def get_kv_connector_stats(self) -> Any:
        return None if self.xfer_stats.is_empty() else self.xfer_stats.clone_and_reset()


def nixl_metadata(meta: Any) -> Any:
    """The NIXL connector's metadata of a step: ``meta`` itself, or, from a
    ``MultiConnector``, the child metadata that carries ``reqs_to_send``."""
    children = getattr(meta, "metadata", None)
    if isinstance(children, tuple):
        return next((m for m in children if hasattr(m, "reqs_to_send")), None)
    return meta


class PdProducerSim:
    """One producer engine: real scheduler, real aggregator, per-rank facades.

    ``multi``: the facades are real worker-side ``MultiConnector`` objects: each step binds
    their metadata and takes their (grouped) stats, as vLLM's worker does.
    """

    def __init__(
        self,
        cfg: VllmConfig,
        facades: list[Any],
        workers: list[StubPcpWorker],
        multi: bool = False,
    ):
        self.multi = multi
        self.scheduler = make_scheduler(cfg)
        self.aggregator = KVOutputAggregator.from_connector(
            self.scheduler.connector, cfg.parallel_config.world_size
        )
        self.facades = facades
        self.workers = workers
        self.stats: list[Any] = []

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    @property
    def usable_blocks(self) -> int:
        return NUM_BLOCKS - 1  # the null block is never free

    def step(self) -> set[str]:
        """One engine step; returns the req ids the aggregator reported finished_sending."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        reqs_to_send = dict(getattr(nixl_metadata(meta), "reqs_to_send", {}) or {})
        rank_outputs = []
        for facade, worker in zip(self.facades, self.workers, strict=True):
            if self.multi:
                facade.bind_connector_metadata(meta)
            worker.start_load_kv(reqs_to_send)
            results = facade.get_transfer_results(set())
            stats = facade.get_kv_connector_stats() if self.multi else None
            if self.multi:
                facade.clear_connector_metadata()
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                kv_connector_stats=stats if self.multi else worker.get_kv_connector_stats(),
            )
            if out.num_scheduled_tokens:
                ids = list(out.num_scheduled_tokens)
                mro = ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[7] for _ in ids],
                )
            else:
                mro = copy(EMPTY_MODEL_RUNNER_OUTPUT)
            mro.kv_connector_output = kv_out
            rank_outputs.append(mro)
        merged = self.aggregator.aggregate(rank_outputs)
        assert merged is not None
        kv = merged.kv_connector_output
        if kv is not None and kv.kv_connector_stats is not None:
            self.stats.append(kv.kv_connector_stats)
        self.scheduler.update_from_output(out, merged)
        return set(kv.finished_sending or ()) if kv else set()
