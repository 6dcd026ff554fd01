"""``PcpCanonicalNixlConnector``: vLLM's pull NIXL connector with one canonical PCP replica.

Stock vLLM 0.32 to 0.34 leaks a replicated-PCP producer's KV blocks: PCP rank > 0
reports its requests as sent, the facade clears those reports, and the
scheduler still waits for world_size reports. Here the scheduler waits for
TP x PP reports (the canonical ranks, PCP rank 0) and non-canonical reports
are suppressed and counted - or, with ``pcp_completion_mode="world_size"``
(chosen by itself when vLLM's config shows the connector inside a wrapper such as
``MultiConnector``, see placement.py and topology.py), the scheduler waits for
world_size reports and every rank reports. All other layouts and roles behave as
stock vLLM. Importing this module registers the class with vLLM's connector factory
(a ``MultiConnector`` rebuilds its children's stats by class name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
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
from .amx import amx_problem, ensure_amx_permission
from .cpu_compat.plugin import verify_installed as verify_cpu_fixes
from .cpu_tuning import CpuKnobs, is_cpu_platform, tuned_worker_init
from .placement import (
    Placement,
    agreement_problem,
    engine_kv_transfer_config,
    placement_from_configs,
)
from .stats import PcpNixlKVConnectorStats, PcpNixlPromMetrics
from .topology import PcpLayout, layout_from_config, pcp_rank_from_global_rank

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so the lines reach vLLM's handler (a bare module name has none).
logger = init_logger(f"vllm.{__name__}")


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


@dataclass
class _Handover:
    """A decode request the handover breakdown follows from admission to its first token."""

    request: Request
    recv_done: bool = False
    tokens_at_recv: int = 0

    def first_token_out(self) -> bool:
        """The KV arrived and a token has been appended since: the first step really ran
        (under async scheduling a step is scheduled before the previous one's output is in,
        so being scheduled says nothing yet)."""
        return self.recv_done and self.request.num_output_tokens > self.tokens_at_recv


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
        self.placement: Placement = placement_from_configs(
            vllm_config.kv_transfer_config, engine_kv_transfer_config()
        )
        self.pcp_layout = layout_from_config(vllm_config, wrapper=self.placement.wrapper)
        # What the scheduler, which cannot see a wrapper, runs: the setting (canonical unset).
        self._scheduler_layout = layout_from_config(vllm_config)
        self.cpu_knobs = CpuKnobs.from_extra_config(
            self.kv_transfer_config.kv_connector_extra_config
        )
        self.pcp_rank = 0
        # Handover events the scheduler side stamps (the worker's go on its xfer_stats).
        self._init_handover_tracking()
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
                problem = amx_problem(ensure_amx_permission(), vllm_config.model_config.dtype)
                if problem:
                    raise RuntimeError(f"PcpCanonicalNixlConnector: {problem}")
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
            self._stamp_reads(worker)
            if self.cpu_knobs.early_kv_load:
                self._early_kv_load = is_cpu_platform()
                if not self._early_kv_load:
                    logger.warning("cpu_early_kv_load ignored: not the CPU platform")
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
        self._bind_rank(self.pcp_rank)
        if self.pcp_layout.replicated_pcp_producer:
            where = (
                f" (inside {self.placement.wrapper})"
                if self.placement.wrapped
                else ("" if self.placement.known else " (as configured: no wrapper visible here)")
            )
            logger.info(
                "PcpCanonicalNixlConnector: replicated PCP producer, mode=%s%s, pcp_rank=%d, "
                "ranks send %d reports per request",
                self.pcp_layout.mode.value,
                where,
                self.pcp_rank,
                self.pcp_layout.reporting_ranks(),
            )

    def _init_handover_tracking(self) -> None:
        self._sched_stats = PcpNixlKVConnectorStats()
        # Scheduler side, each entry removed when vLLM finishes (or aborts) the request, so
        # neither can outgrow the requests the scheduler holds: decode requests admitted for
        # remote KV until their first token, prefill requests held for decode until freed.
        self._awaiting_first_step: dict[str, _Handover] = {}
        self._held: set[str] = set()
        self._pending_shipped = 0

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
            self._awaiting_first_step[request.request_id] = _Handover(request)
            self._ship_pending()
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        # Inside a MultiConnector the output holds every child's requests: follow only ours.
        for request_id in connector_output.finished_recving or ():
            entry = self._awaiting_first_step.get(request_id)
            if entry is not None and not entry.recv_done:  # else aborted while KV was in flight
                self._stamp(request_id, handover.SCHEDULER_SEEN)
                entry.recv_done = True
                entry.tokens_at_recv = entry.request.num_output_tokens
        for request_id in connector_output.finished_sending or ():
            if request_id in self._held:
                self._held.discard(request_id)
                self._stamp(request_id, handover.BLOCKS_FREED)
        self._stamp_first_tokens()
        self._ship_pending()

    def _stamp_first_tokens(self) -> None:
        for request_id, entry in list(self._awaiting_first_step.items()):
            if entry.first_token_out():
                del self._awaiting_first_step[request_id]
                self._stamp(request_id, handover.FIRST_TOKEN)

    def _ship_pending(self) -> None:
        """Ship the number of requests followed when it changed (the gauge that shows the
        tables drain back to 0)."""
        pending = len(self._awaiting_first_step) + len(self._held)
        if pending != self._pending_shipped:
            self._sched_stats.record_handover_pending(pending)
            self._pending_shipped = pending

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self._stamp_first_tokens()
        self._ship_pending()
        return super().build_connector_meta(scheduler_output)

    def _finished(self, request: Request, delay_free: bool) -> None:
        request_id = request.request_id
        if delay_free and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._stamp(request_id, handover.PREFILL_DONE)
            self._sched_stats.record_held_request()
            self._held.add(request_id)
        entry = self._awaiting_first_step.pop(request_id, None)
        if entry is not None and entry.first_token_out():  # ended by its first token
            self._stamp(request_id, handover.FIRST_TOKEN)
        self._ship_pending()

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
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        # vLLM registers the caches through get_kv_transfer_group(), once the outermost
        # connector exists: check the placement read at construction, and the scheduler's count.
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        if has_kv_transfer_group():
            self.check_outermost(get_kv_transfer_group())

    def check_outermost(self, group: Any) -> None:
        """RuntimeError unless ``group`` (vLLM's outermost connector) is where the constructor
        saw this connector, and the scheduler inside it counts the reports the ranks send."""
        wrapped = group is not self
        if self.placement.known and wrapped != self.placement.wrapped:
            raise RuntimeError(
                "PcpCanonicalNixlConnector: vLLM's current config said the outermost KV "
                f"connector is {self.placement.wrapper or 'this one'}, but "
                f"get_kv_transfer_group() is {type(group).__name__}: the completion mode "
                "cannot be chosen safely"
            )
        if not wrapped:
            return
        children = getattr(group, "sub_connectors", None)
        if children is None:
            siblings: list[int | None] = [group.get_finished_count()]
        else:
            siblings = [c.get_finished_count() for c in children if c is not self]
        problem = agreement_problem(
            type(group).__name__,
            self.pcp_layout.finished_count(),
            self._scheduler_layout.finished_count(),
            siblings,
        )
        if problem:
            raise RuntimeError(f"PcpCanonicalNixlConnector: {problem}")

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

    def _stamp_reads(self, worker: NixlPullConnectorWorker) -> None:
        """Stamp a request's ``read_posted`` as its read is handed to NIXL (vLLM's worker posts
        each read through ``_read_blocks``, at once or once the peer's handshake is done), not
        after ``start_load_kv`` returns: with host memory UCX copies the blocks (cma) inside the
        post call, so that stamp put the copy itself in the wait before the read."""
        post = worker._read_blocks

        def stamped_post(*args: Any, **kwargs: Any) -> Any:
            request_id = kwargs["request_id"] if "request_id" in kwargs else args[2]
            self._stats().record_handover([handover.stamp(request_id, handover.READ_POSTED)])
            return post(*args, **kwargs)

        worker._read_blocks = stamped_post

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


def register_with_vllm() -> None:
    """Register the connector by name with vLLM's factory (idempotent).

    A connector loaded by ``kv_connector_module_path`` is enough to run, but vLLM's
    ``MultiConnector`` rebuilds each child's stats in the API server by class name
    (``KVConnectorFactory.get_connector_class_by_name``): unregistered, the first stats
    payload kills the API server's output handler. The entry loads this very module, so the
    name resolves to the class the engine runs and its metrics are built once.
    """
    name = PcpCanonicalNixlConnector.__name__
    try:
        KVConnectorFactory.register_connector(name, __name__, name)
    except ValueError:  # registered by an earlier import in this process: keep that entry
        if KVConnectorFactory.get_connector_class_by_name(name) is not PcpCanonicalNixlConnector:
            logger.warning(
                "vLLM's connector registry already maps %s to another class; a "
                "MultiConnector's stats for it are rebuilt with that one",
                name,
            )


register_with_vllm()
