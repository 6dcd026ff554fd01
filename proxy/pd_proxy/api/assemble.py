"""The composition root of the completions path: its parts built once, when the app starts
(pd_proxy.api.app's ``start``), from explicit arguments, each given only what it uses.

No part builds another or reaches into one for the settings, the pools, the backend key or the
upstream client: the exchange, the legs, the planner, the gate, the modes and the pipeline get
them here, and the canary gets the same legs and exchange as the client requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pd_proxy.admission.setup import build_gate
from pd_proxy.api.canary import Canary
from pd_proxy.backends.pool import BackendPool
from pd_proxy.config import ProxyConfig
from pd_proxy.config.key_files import BackendKey
from pd_proxy.http.exchange import Exchange
from pd_proxy.http.upstream import Upstream
from pd_proxy.legs import Legs, Mode
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.modes.decode_alone import DecodeAloneMode
from pd_proxy.modes.fanout import FanoutMode
from pd_proxy.modes.first_token import FirstTokenMode
from pd_proxy.modes.normal import NormalMode
from pd_proxy.pipeline import Pipeline
from pd_proxy.routing.block_size import BlockSizes
from pd_proxy.routing.planner import build_planner
from pd_proxy.tracing import Tracing


@dataclass(frozen=True, eq=False)
class Flow:
    """The completions path of one app; its ``legs`` and ``exchange`` also carry the canary's
    requests."""

    exchange: Exchange
    legs: Legs
    pipeline: Pipeline


def build_flow(
    config: ProxyConfig,
    metrics: ProxyMetrics,
    *,
    pools: tuple[BackendPool, BackendPool],
    upstream: Upstream,
    backend_key: BackendKey | None,
    tracing: Tracing | None,
) -> Flow:
    """The exchange, the legs, the planner, the modes, the gate and the pipeline, in that order
    (``pools``: prefill, decode; ``upstream``: the running app's client)."""
    prefill, decode = pools
    exchange = Exchange(metrics, upstream)
    legs = Legs(
        exchange,
        prefill,
        decode,
        metrics=metrics,
        backend_key=backend_key,
        prefill_timeout=config.prefill_timeout,
        decode_timeout=config.decode_timeout,
    )
    planner = build_planner(
        config,
        metrics.registry,
        pools=pools,
        upstream=upstream,
        exchange=exchange,
        backend_key=backend_key,
    )
    local = DecodeAloneMode(legs)
    fanout = FanoutMode(legs, backend_key=backend_key, metrics=metrics)
    normal = NormalMode(legs)
    pd: Mode = normal
    if config.first_token_from_prefill:
        pd = FirstTokenMode(
            legs,
            normal=normal,
            block_sizes=BlockSizes(upstream, backend_key, config.health_timeout),
            prefill=prefill,
            metrics=metrics,
        )
    gate = build_gate(config, prefill, decode, metrics) if config.admission else None
    pipeline = Pipeline(
        planner=planner,
        gate=gate,
        local=local,
        pd=pd,
        fanout=fanout,
        metrics=metrics,
        tracing=tracing,
        backend_key=backend_key,
        max_body_bytes=config.max_body_bytes,
        flow_header=config.flow_header,
        client_priority=config.client_priority,
    )
    return Flow(exchange, legs, pipeline)


def build_canary(
    config: ProxyConfig,
    registry: CollectorRegistry,
    flow: Flow,
    *,
    prefill: BackendPool,
    backend_key: BackendKey | None,
    interval_s: float,
) -> Canary:
    """The canary on ``flow``'s legs and exchange, every ``interval_s``."""
    return Canary(
        flow.legs,
        flow.exchange,
        prefill,
        backend_key=backend_key,
        prefill_timeout=config.prefill_timeout,
        registry=registry,
        interval_s=interval_s,
        timeout_s=config.canary_timeout,
    )
