"""``PcpCanonicalNixlConnector``: vLLM's pull NIXL connector with one canonical PCP replica.

Stock vLLM 0.32 to 0.34 leaks a replicated-PCP producer's KV blocks: PCP rank > 0
reports its requests as sent, the facade clears those reports, and the
scheduler still waits for world_size reports. Here the scheduler waits for
TP x PP reports (the canonical ranks, PCP rank 0) and non-canonical reports
are suppressed and counted - or, with ``pcp_completion_mode="world_size"``
(chosen by itself inside vLLM's ``MultiConnector``, see topology.py), the
scheduler waits for world_size reports and every rank reports. All other
layouts and roles behave as stock vLLM.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger

from . import handover
from .amx import ensure_amx_permission
from .cpu_compat.plugin import verify_installed as verify_cpu_fixes
from .cpu_tuning import CpuKnobs, is_cpu_platform, tuned_worker_init
from .nesting import inside_multiconnector
from .stats import PcpNixlKVConnectorStats, PcpNixlPromMetrics
from .topology import PcpLayout, layout_from_config, pcp_rank_from_global_rank

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def resolve_pcp_rank(layout: PcpLayout) -> int:
    """This worker's PCP rank: vLLM's PCP group, else the global rank layout."""
    if layout.pcp == 1:
        return 0
    from vllm.distributed import parallel_state

    # get_pcp_group() asserts the group exists; check the module global instead so the
    # fallback also works under ``python -O`` (where that assert is stripped).
    if getattr(parallel_state, "_PCP", None) is not None:
        return layout.check_pcp_rank(parallel_state.get_pcp_group().rank_in_group)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "PcpCanonicalNixlConnector: PCP > 1 but neither vLLM's PCP group nor "
            "torch.distributed is initialised, so the canonical replica is unknown"
        )
    return pcp_rank_from_global_rank(dist.get_rank(), layout.tp, layout.pp, layout.pcp)


class PcpCanonicalNixlConnector(NixlPullConnector):
    """Pull (READ) NIXL connector whose replicated-PCP producer frees every block."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        # NixlPullConnector.__init__ would build the stock worker; build ours.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.in_multiconnector = inside_multiconnector()
        self.pcp_layout = layout_from_config(vllm_config, in_multiconnector=self.in_multiconnector)
        self.cpu_knobs = CpuKnobs.from_extra_config(
            self.kv_transfer_config.kv_connector_extra_config
        )
        self.pcp_rank = 0
        # Handover events the scheduler side stamps (the worker's go on its xfer_stats).
        self._sched_stats = PcpNixlKVConnectorStats()
        self._awaiting_first_step: set[str] = set()
        self._in_first_step: set[str] = set()
        self._loads_posted = False  # this step's reads already posted (cpu_early_kv_load)
        self._early_kv_load = False
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            if is_cpu_platform():
                # Before the first attention step: a decode worker's first step is a 1-token
                # step that would run vLLM's AMX attention kernel without permission (SIGILL).
                ensure_amx_permission()
                # The CPU knobs on but the plugins not run (allowlist, PYTHONPATH, a load error
                # vLLM only logged) would silently bring the CPU defects back: stop instead.
                verify_cpu_fixes(os.environ)
            with tuned_worker_init(self.cpu_knobs):
                worker = NixlPullConnectorWorker(vllm_config, self.engine_id, kv_cache_config)
            worker.xfer_stats = PcpNixlKVConnectorStats()
            self.pcp_rank = resolve_pcp_rank(self.pcp_layout)
            if worker.pcp_rank != self.pcp_rank:
                raise RuntimeError(
                    f"PCP rank mismatch: vLLM's worker says {worker.pcp_rank}, the rank "
                    f"layout says {self.pcp_rank}"
                )
            self.connector_scheduler = None
            self.connector_worker = worker
            if self.cpu_knobs.early_kv_load:
                self._early_kv_load = is_cpu_platform()
                if not self._early_kv_load:
                    logger.warning("cpu_early_kv_load ignored: not the CPU platform")
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
        self._bind_rank(self.pcp_rank)
        if self.pcp_layout.replicated_pcp_producer:
            logger.info(
                "PcpCanonicalNixlConnector: replicated PCP producer, mode=%s%s, pcp_rank=%d, "
                "scheduler waits for %d reports per request",
                self.pcp_layout.mode.value,
                " (inside MultiConnector)" if self.in_multiconnector else "",
                self.pcp_rank,
                self.pcp_layout.expected_reports(),
            )

    def _bind_rank(self, pcp_rank: int) -> None:
        """Fix this instance's per-rank decisions (computed once, used every step)."""
        layout = self.pcp_layout
        self.pcp_rank = pcp_rank
        self._publishes_handshake = layout.publishes_handshake(pcp_rank)
        self._suppresses = layout.suppresses_finished_sending(pcp_rank)
        self._counts_completions = layout.is_canonical(pcp_rank) and layout.kv_role != "kv_consumer"

    # ---- scheduler side ---------------------------------------------------
    def get_finished_count(self) -> int | None:
        return self.pcp_layout.finished_count()

    def _stamp(self, request_id: str, event: str) -> None:
        self._sched_stats.record_handover([handover.stamp(request_id, event)])

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and params.get("do_remote_prefill"):
            self._stamp(request.request_id, handover.ADMITTED)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        for request_id in connector_output.finished_recving or ():
            self._stamp(request_id, handover.SCHEDULER_SEEN)
            self._awaiting_first_step.add(request_id)
        for request_id in connector_output.finished_sending or ():
            self._stamp(request_id, handover.BLOCKS_FREED)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        # A request's first step ran between the previous call and this one (the scheduler
        # builds the next step after processing the last one's output).
        for request_id in self._in_first_step:
            self._stamp(request_id, handover.FIRST_TOKEN)
        self._in_first_step.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in [r for r in self._awaiting_first_step if scheduled.get(r)]:
            self._awaiting_first_step.discard(request_id)
            self._in_first_step.add(request_id)
        return super().build_connector_meta(scheduler_output)

    def _finished(self, request: Request, delay_free: bool) -> None:
        request_id = request.request_id
        if delay_free and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._stamp(request_id, handover.PREFILL_DONE)
            self._sched_stats.record_held_request()
        if request_id in self._in_first_step:  # ended by its first step (one token)
            self._in_first_step.discard(request_id)
            self._stamp(request_id, handover.FIRST_TOKEN)
        self._awaiting_first_step.discard(request_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        self._finished(request, delay_free)
        return delay_free, params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        self._finished(request, delay_free)
        return delay_free, params

    def get_kv_connector_stats(self) -> PcpNixlKVConnectorStats | None:
        if self.connector_worker is not None:
            return cast(PcpNixlKVConnectorStats | None, super().get_kv_connector_stats())
        if self._sched_stats.is_empty():
            return None
        stats, self._sched_stats = self._sched_stats, PcpNixlKVConnectorStats()
        return stats

    # ---- worker side ------------------------------------------------------
    def _stats(self) -> PcpNixlKVConnectorStats:
        assert self.connector_worker is not None
        # Set to ours in __init__; vLLM never replaces it (clone_and_reset copies, keeps self).
        return cast(PcpNixlKVConnectorStats, self.connector_worker.xfer_stats)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """With ``cpu_early_kv_load``, post the step's reads now, before the forward: vLLM
        would post them after it (see cpu_tuning), one whole CPU forward later."""
        super().bind_connector_metadata(connector_metadata)
        self._loads_posted = False
        if self._early_kv_load and getattr(connector_metadata, "reqs_to_recv", None):
            self._post_loads(None)
            self._loads_posted = True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._loads_posted:
            return  # posted when the metadata was bound; posting twice would read twice
        self._post_loads(forward_context, **kwargs)

    def _post_loads(self, forward_context: ForwardContext | None, **kwargs: Any) -> None:
        # NixlPullConnector.start_load_kv reads only the bound metadata, never the context.
        super().start_load_kv(cast("ForwardContext", forward_context), **kwargs)
        metadata = self._connector_metadata
        to_recv = getattr(metadata, "reqs_to_recv", None)
        if to_recv:
            now = time.monotonic()
            events = [handover.stamp(rid, handover.READ_POSTED, now) for rid in to_recv]
            self._stats().record_handover(events)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        # The worker drains and cleans its own state (notifications, leases,
        # replicated-PCP bookkeeping) whatever happens to the reports.
        results = self.connector_worker.get_transfer_results()
        if results.finished_recving:
            self._stats().record_handover(
                [handover.stamp(rid, handover.TRANSFER_DONE) for rid in results.finished_recving]
            )
        sent = results.finished_sending
        if sent:
            if self._suppresses:
                self._stats().record_finished_sending_suppressed(len(sent))
                sent.clear()
            elif self._counts_completions:
                self._stats().record_canonical_completions(len(sent))
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self.connector_worker is not None
        if not self._publishes_handshake:
            self._stats().record_handshake_publication_skipped()
            return None
        return self.connector_worker.xfer_handshake_metadata

    # ---- stats / metrics (also used by the API server, without a worker) --
    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> PcpNixlKVConnectorStats:
        return PcpNixlKVConnectorStats(data=data) if data is not None else PcpNixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return PcpNixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class PcpCanonicalNixlPushConnector(NixlPushConnector):
    """Placeholder that refuses push mode with a clear error.

    Stock push mode returns early on PCP rank > 0 without any report, which
    leaks the same way; it is not covered by this kit's fix or tests.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        raise NotImplementedError(
            "pcp_nixl_connector supports pull (READ) mode only: use "
            "kv_connector='PcpCanonicalNixlConnector'. Push mode (NixlPushConnector) "
            "with replicated PCP is not supported by this kit."
        )
