"""What the servers say about themselves, for the run manifest.

Read, not assumed: the manifest should show the topology that actually produced the score. vLLM
exposes /version, /v1/models (served name, root, max_model_len) and /metrics (cache config info,
connector counters); the proxy exposes /v1/models and /metrics. Every probe is best-effort and
records its error instead of raising: a missing direct URL must not lose a finished eval.
"""

from __future__ import annotations

import json
from typing import Any

from pcp_nixl_connector.metric_names import DEDUP_METRIC_NAMES
from pcp_pd_kit.localstack.live import HttpError, get_text
from pcp_pd_kit.localstack.report import (
    NIXL_FAILED,
    NIXL_XFER_COUNT,
    PROMPT_TOKENS_BY_SOURCE,
    Sample,
    parse_metrics,
)
from pd_proxy.metrics import BACKEND_ERRORS_TOTAL, REQUESTS_TOTAL

_PER_ENGINE = ("engine", "model_name")
# Counters worth a line in the manifest: proof that KV crossed NIXL, failures, and the kit's dedup.
INTERESTING = (
    PROMPT_TOKENS_BY_SOURCE,
    NIXL_XFER_COUNT,
    NIXL_FAILED,
    *DEDUP_METRIC_NAMES,
    REQUESTS_TOTAL,
    BACKEND_ERRORS_TOTAL,
)


def lenient_samples(text: str) -> list[Sample]:
    """Every parsable sample: a page the parser rejects as a whole is read line by line, its bad
    lines skipped (the manifest is best-effort; a finished eval must not be lost over it)."""
    try:
        return parse_metrics(text)
    except ValueError:
        pass
    out: list[Sample] = []
    for line in text.splitlines():
        try:
            out += parse_metrics(line + "\n")
        except ValueError:
            continue
    return out


def summarize_metrics(text: str) -> dict[str, Any]:
    """Config info labels plus summed interesting counters (by their non-engine labels)."""
    out: dict[str, Any] = {"counters": {}}
    for sample in lenient_samples(text):
        name, labels, value = sample.name, sample.labels, sample.value
        if name == "vllm:cache_config_info":
            out["cache_config"] = labels
        elif name in INTERESTING:
            key_labels = {k: v for k, v in sorted(labels.items()) if k not in _PER_ENGINE}
            rendered = ",".join(f'{k}="{v}"' for k, v in key_labels.items())
            key = f"{name}{{{rendered}}}" if rendered else name
            out["counters"][key] = out["counters"].get(key, 0.0) + value
    return out


def probe_server(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """One server's self-description; each failed endpoint becomes an ``errors`` entry."""
    base = base_url.rstrip("/")
    info: dict[str, Any] = {"url": base, "errors": {}}
    for path in ("/version", "/v1/models", "/metrics"):
        try:
            body = get_text(base + path, timeout)
        except HttpError as exc:
            info["errors"][path] = str(exc)
            continue
        if path == "/metrics":
            info["metrics"] = summarize_metrics(body)
            continue
        try:
            data = json.loads(body)
        except ValueError:
            info["errors"][path] = "not JSON"
            continue
        if path == "/version":
            info["version"] = data.get("version") if isinstance(data, dict) else None
        else:
            info["models"] = [
                {k: m.get(k) for k in ("id", "root", "max_model_len") if k in m}
                for m in data.get("data", [])
                if isinstance(m, dict)
            ]
    if not info["errors"]:
        del info["errors"]
    return info
