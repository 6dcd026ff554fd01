"""Fail early, naming the supported vLLM versions, when vLLM's APIs moved.

The connector subclasses vLLM's NIXL facade and reaches into a few of its
internals (the worker's ``pcp_rank``/``xfer_stats``, the stats and Prometheus
classes); a silent mismatch would reintroduce the KV leak, so refuse to load.
"""

from __future__ import annotations

import importlib
import os

from .releases import OVERRIDE_ENV, SUPPORTED_TEXT, parse_minor
from .releases import SUPPORTED_MINORS as SUPPORTED_VLLM_MINORS

# module -> attribute names the connector relies on.
REQUIRED_APIS: dict[str, tuple[str, ...]] = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector": (
        "NixlBaseConnector",
        "NixlPullConnector",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker": ("NixlPullConnectorWorker",),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler": (
        "NixlPullConnectorScheduler",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats": (
        "NixlKVConnectorStats",
        "NixlPromMetrics",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.base": ("KVConnectorTransferResults",),
    "vllm.distributed.parallel_state": ("get_pcp_group",),
    "vllm.v1.metrics.utils": ("create_metric_per_engine",),
}
REQUIRED_METHODS: tuple[str, ...] = (
    "get_finished_count",
    "get_transfer_results",
    "get_handshake_metadata",
    "build_kv_connector_stats",
    "build_prom_metrics",
)
# Class -> members the connector reads or sets on vLLM objects, instance attributes included
# (which hasattr on a class cannot see): checked statically, against each supported release's
# sources, by tests/connector/test_vllm_api_surface.py.
REQUIRED_MEMBERS: dict[str, tuple[str, ...]] = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlPullConnector": (
        *REQUIRED_METHODS,
        "kv_transfer_config",
        "engine_id",
        "connector_scheduler",
        "connector_worker",
        "_connector_metadata",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker": (
        "pcp_rank",
        "xfer_stats",
        "xfer_handshake_metadata",
        "get_transfer_results",
        "get_kv_connector_stats",
        "_read_blocks",
    ),
}


class UnsupportedVllmError(ImportError):
    """vLLM is not a version this connector was written against."""


def parse_version(version: str) -> tuple[int, int] | None:
    return parse_minor(version)


def missing_apis() -> list[str]:
    """Dotted names of required vLLM APIs that cannot be found."""
    missing: list[str] = []
    for module_name, attrs in REQUIRED_APIS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing.extend(f"{module_name}.{a}" for a in attrs if not hasattr(module, a))
    if not missing:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPullConnector,
        )

        missing.extend(
            f"NixlPullConnector.{m}" for m in REQUIRED_METHODS if not hasattr(NixlPullConnector, m)
        )
    return missing


def check_vllm(version: str | None = None, *, allow_override: bool | None = None) -> str:
    """Return the vLLM version, or raise ``UnsupportedVllmError`` saying what is supported."""
    if version is None:
        try:
            from vllm.version import __version__ as installed
        except ImportError as e:
            raise UnsupportedVllmError(
                f"pcp_nixl_connector needs vLLM ({SUPPORTED_TEXT}); vLLM is not importable: {e}"
            ) from e
        version = str(installed)
    if allow_override is None:
        allow_override = os.environ.get(OVERRIDE_ENV, "") == "1"
    minor = parse_version(version)
    if minor not in SUPPORTED_VLLM_MINORS and not allow_override:
        raise UnsupportedVllmError(
            f"pcp_nixl_connector supports {SUPPORTED_TEXT}; found vLLM {version}. "
            f"Set {OVERRIDE_ENV}=1 to try it anyway (the API check still applies)."
        )
    missing = missing_apis()
    if missing:
        raise UnsupportedVllmError(
            f"pcp_nixl_connector supports {SUPPORTED_TEXT}; vLLM {version} lacks: "
            + ", ".join(missing)
        )
    return version
