"""What the servers say about themselves, for the run manifest.

Read, not assumed: the manifest should show the topology that actually produced the score. vLLM
exposes /version, /v1/models (served name, root, max_model_len) and /metrics (cache config info,
connector counters); the proxy exposes /v1/models and /metrics. Every probe is best-effort and
records its error instead of raising: a missing direct URL must not lose a finished eval.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

_PER_ENGINE = ("engine", "model_name")
# Counters worth a line in the manifest: proof that KV crossed NIXL, failures, and the kit's dedup.
INTERESTING = (
    "vllm:prompt_tokens_by_source_total",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_pcp_handshake_publications_skipped_total",
    "vllm:nixl_pcp_finished_sending_suppressed_total",
    "vllm:nixl_pcp_canonical_completions_total",
    "vllm:nixl_pcp_expected_suppressed_per_completion",
    "pd_proxy_requests_total",
    "pd_proxy_backend_errors_total",
)


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) samples, via prometheus_client's parser.

    A page the parser rejects as a whole is parsed line by line and the bad lines skipped: the
    manifest is best-effort. Imported here so the rest of the helper runs without the package.
    """
    from prometheus_client.parser import text_string_to_metric_families

    def samples(chunk: str) -> list[tuple[str, dict[str, str], float]]:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(chunk)
            for s in family.samples
        ]

    try:
        return samples(text)
    except ValueError:
        pass
    out = []
    for line in text.splitlines():
        try:
            out += samples(line + "\n")
        except ValueError:
            continue
    return out


def summarize_metrics(text: str) -> dict[str, Any]:
    """Config info labels plus summed interesting counters (by their non-engine labels)."""
    out: dict[str, Any] = {"counters": {}}
    for name, labels, value in parse_metrics(text):
        if name == "vllm:cache_config_info":
            out["cache_config"] = labels
        elif name in INTERESTING:
            key_labels = {k: v for k, v in sorted(labels.items()) if k not in _PER_ENGINE}
            rendered = ",".join(f'{k}="{v}"' for k, v in key_labels.items())
            key = f"{name}{{{rendered}}}" if rendered else name
            out["counters"][key] = out["counters"].get(key, 0.0) + value
    return out


def _get(url: str, timeout: float) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode("utf-8", "replace")


def probe_server(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """One server's self-description; each failed endpoint becomes an ``errors`` entry."""
    base = base_url.rstrip("/")
    info: dict[str, Any] = {"url": base, "errors": {}}
    for path in ("/version", "/v1/models", "/metrics"):
        try:
            _, body = _get(base + path, timeout)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            info["errors"][path] = str(getattr(exc, "reason", exc))
            continue
        if path == "/metrics":
            try:
                info["metrics"] = summarize_metrics(body)
            except ImportError as exc:
                info["errors"][path] = f"cannot parse: {exc}"
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
