"""Canonical-replica NIXL connector for vLLM P/D with a replicated-PCP prefill.

Load it into stock vLLM with::

    --kv-transfer-config '{"kv_connector":"PcpCanonicalNixlConnector",
                           "kv_connector_module_path":"pcp_nixl_connector", ...}'

The metric names (``DEDUP_METRIC_NAMES``) and the pure modules import without vLLM; the
connector classes are loaded (and the vLLM version checked) on first access.
"""

from __future__ import annotations

from typing import Any

from .metric_names import (
    DEDUP_COUNTER_NAMES,
    DEDUP_METRIC_NAMES,
    EXPECTED_SUPPRESSED_PER_COMPLETION,
)

_LAZY = {
    "PcpCanonicalNixlConnector": "connector",
    "PcpCanonicalNixlPushConnector": "connector",
    "PcpNixlKVConnectorStats": "stats",
    "PcpNixlPromMetrics": "stats",
}

__all__ = [
    "DEDUP_COUNTER_NAMES",
    "DEDUP_METRIC_NAMES",
    "EXPECTED_SUPPRESSED_PER_COMPLETION",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from .version_guard import check_vllm

    check_vllm()
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value
