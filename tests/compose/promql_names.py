"""Which metric names exist: harvested from the installed vLLM source plus the kit's name tuples.

Why harvest instead of listing: a dashboard or alert naming a metric vLLM does not export shows an
empty panel or never fires, silently. Names are compared on their base (without the _total,
_bucket, _sum, _count, _created suffixes prometheus_client adds).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")
_QUOTED = re.compile(r"""["'](vllm:[a-zA-Z0-9_]+)["']""")
_METRIC_IN_QUERY = re.compile(r"(?<![\w:\"'{=])([a-zA-Z_:][a-zA-Z0-9_:]*)(?=\s*(?:\{|\[|\)|$|\s))")
PROMQL_WORDS = {
    "sum", "rate", "increase", "histogram_quantile", "by", "without", "on", "ignoring",
    "group_left", "group_right", "or", "and", "unless", "abs", "max", "min", "avg", "count",
    "le", "bool", "offset", "irate", "delta", "vector", "scalar", "topk", "bottomk", "up",
}  # fmt: skip


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def vllm_metric_bases() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not installed: cannot harvest its metric names")
    root = Path(next(iter(spec.submodule_search_locations)))
    names: set[str] = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "vllm:" in text:
            names.update(base_name(n) for n in _QUOTED.findall(text))
    return names


def kit_metric_bases() -> set[str]:
    from pcp_nixl_connector.metric_names import DEDUP_METRIC_NAMES, HANDOVER_METRIC_NAMES
    from pd_proxy.api.canary import METRIC_NAMES as CANARY_METRIC_NAMES
    from pd_proxy.metrics import METRIC_NAMES
    from pd_proxy.routing.cache.metrics import METRIC_NAMES as CACHE_METRIC_NAMES

    names = (
        *DEDUP_METRIC_NAMES,
        *HANDOVER_METRIC_NAMES,
        *METRIC_NAMES,
        *CANARY_METRIC_NAMES,
        *CACHE_METRIC_NAMES,
    )
    return {base_name(n) for n in names} | admission_metric_bases()


def admission_metric_bases() -> set[str]:
    """pd-proxy admission's series, as its metrics class registers them."""
    from prometheus_client import CollectorRegistry

    from pd_proxy.admission.metrics import AdmissionMetrics

    registry = CollectorRegistry()
    AdmissionMetrics(registry)
    return {base_name(family.name) for family in registry.collect()}


def metrics_in_query(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label names, functions and keywords removed)."""
    without_labels = re.sub(r"\{[^}]*\}", "{}", expr)
    without_strings = re.sub(r'"[^"]*"', '""', without_labels)
    without_by = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_strings
    )
    found = set()
    for name in _METRIC_IN_QUERY.findall(without_by):
        if name in PROMQL_WORDS or name.startswith("$"):
            continue
        found.add(name)
    return found
