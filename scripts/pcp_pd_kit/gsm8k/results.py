"""Find lm-eval's results file in an output folder and read the strict-match score from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRIC = "exact_match,strict-match"


class ResultsError(RuntimeError):
    """lm-eval left no usable results."""


def find_results_file(output_dir: Path) -> Path:
    """The newest ``results_*.json`` lm-eval wrote under ``output_dir`` (it nests by model)."""
    found = sorted(output_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ResultsError(f"lm-eval wrote no results_*.json under {output_dir}")
    return found[-1]


def strict_match(results: dict[str, Any], task: str) -> tuple[float, float | None, int | None]:
    """(score, stderr, number of samples) for ``task``."""
    try:
        entry = results["results"][task]
        score = float(entry[METRIC])
    except (KeyError, TypeError, ValueError) as exc:
        raise ResultsError(f"no {METRIC!r} for task {task!r} in lm-eval results") from exc
    stderr_raw = entry.get("exact_match_stderr,strict-match")
    try:
        stderr = float(stderr_raw)
    except (TypeError, ValueError):
        stderr = None
    samples = results.get("n-samples", {}).get(task, {}).get("effective")
    return score, stderr, samples


def load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ResultsError(f"{path} is not valid JSON") from exc
