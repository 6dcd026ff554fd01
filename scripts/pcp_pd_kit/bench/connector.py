"""Per-step overhead of PcpCanonicalNixlConnector against stock NixlPullConnector over simulated
steps of a PCP2 producer: median ns for ``get_transfer_results`` on both ranks (a stand-in worker:
rank 1 reports at once, rank 0 a step later), ``get_finished`` and the stats path (aggregation,
``build_kv_connector_stats``, Prometheus ``observe``). Not a timed test: the machine's load counts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pcp_pd_kit.bench.kinds import add_flags
from pcp_pd_kit.bench.results import Outcome, knobs
from pcp_pd_kit.bench.tables import markdown_table

HELP = "per-step overhead of the kit's NIXL connector vs vLLM's stock one (no servers)"


class _Worker:
    """Stand-in for NixlPullConnectorWorker's reporting on one PCP rank."""

    def __init__(self, pcp_rank: int, stats: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        self._results = KVConnectorTransferResults
        self.pcp_rank = pcp_rank
        self.pcp_dcp_sharded = False
        self.xfer_stats = stats
        self.step = 0

    def get_transfer_results(self) -> Any:
        self.step += 1
        return self._results(finished_sending={f"r{self.step}-{i}" for i in range(4)})

    def get_finished(self) -> tuple[set[str], set[str]]:
        r = self.get_transfer_results()
        return r.finished_sending, r.finished_recving

    def get_kv_connector_stats(self) -> Any:
        return None if self.xfer_stats.is_empty() else self.xfer_stats.clone_and_reset()


def _facades(kind: str, cls: Any, cfg: Any) -> list[Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from pcp_nixl_connector.connector import layout_from_config
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats

    out = []
    stock = kind == "stock"
    for rank in (0, 1):
        facade = object.__new__(cls)
        stats = NixlKVConnectorStats() if stock else PcpNixlKVConnectorStats()
        facade.connector_worker = _Worker(rank, stats)
        facade.kv_transfer_config = cfg.kv_transfer_config
        if not stock:
            facade.pcp_layout = layout_from_config(cfg)
            facade._bind_rank(rank)
        out.append(facade)
    return out


def _prom(cls: Any, cfg: Any) -> Any:
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram

    registry = prometheus_client.CollectorRegistry()  # its own: the metrics are made twice
    types = {t: functools.partial(t, registry=registry) for t in (Gauge, Counter, Histogram)}
    return cls.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})


def _median_ns(fn: Callable[[], None], steps: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            fn()
        samples.append((time.perf_counter_ns() - t0) / steps)
    return statistics.median(samples)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_flags(ap, [("--steps", int, 5000, "simulated steps per repeat"),
                   ("--repeats", int, 7, "repeats; the median is reported")])  # fmt: skip


def check(args: argparse.Namespace) -> str | None:
    return "--steps and --repeats must be >= 1" if min(args.steps, args.repeats) < 1 else None


def format_table(rows: dict[str, dict[str, float]], steps: int, repeats: int) -> str:
    """Markdown: median ns per simulated step, stock and ours side by side with the ratio."""
    body = [
        [name, f"{s:.0f}", f"{rows['ours'][name]:.0f}", f"{rows['ours'][name] / s:.2f}"]
        for name, s in rows["stock"].items()
    ]
    title = f"median ns per simulated step ({steps} steps x {repeats} repeats)"
    return title + "\n\n" + markdown_table(["path", "stock", "ours", "ours/stock"], body)


def run(args: argparse.Namespace, out: Path) -> Outcome:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from pcp_nixl_connector import PcpCanonicalNixlConnector

    kv = KVTransferConfig(
        kv_connector="PcpCanonicalNixlConnector",
        kv_connector_module_path="pcp_nixl_connector",
        kv_role="kv_producer",
    )
    cfg = VllmConfig(kv_transfer_config=kv)  # a PCP2 producer's
    cfg.parallel_config.prefill_context_parallel_size = cfg.parallel_config.world_size = 2
    classes = {"stock": NixlPullConnector, "ours": PcpCanonicalNixlConnector}
    rows: dict[str, dict[str, float]] = {}
    for kind, cls in classes.items():
        facades = _facades(kind, cls, cfg)
        prom = _prom(cls, cfg)

        def transfer(facades: list[Any] = facades) -> None:
            for f in facades:
                f.get_transfer_results(set())

        def finished(facades: list[Any] = facades) -> None:
            for f in facades:
                f.get_finished(set())

        def stats_path(facades: list[Any] = facades, cls: Any = cls, prom: Any = prom) -> None:
            for f in facades:
                f.get_transfer_results(set())  # generate the step's events
            merged = None
            for f in facades:
                s = f.get_kv_connector_stats()
                if s is not None:
                    merged = s if merged is None else merged.aggregate(s)
            if merged is not None and not merged.is_empty():
                prom.observe(cls.build_kv_connector_stats(merged.data).data, 0)

        rows[kind] = {
            "get_transfer_results x2 ranks": _median_ns(transfer, args.steps, args.repeats),
            "get_finished x2 ranks": _median_ns(finished, args.steps, args.repeats),
            "results + stats + prometheus": _median_ns(stats_path, args.steps, args.repeats),
        }
    table = format_table(rows, args.steps, args.repeats)
    used = knobs(args, "steps", "repeats")
    return Outcome({"median_ns_per_step": rows, **used}, table, {"bench": used})
