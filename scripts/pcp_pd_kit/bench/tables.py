"""The one Markdown table printer and the number formats every bench kind shares. No I/O."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(headers)} headers")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def value(result: Mapping[str, Any] | None, key: str) -> float | None:
    """A finite number from a result, or None (missing run, missing key, NaN)."""
    raw = (result or {}).get(key)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    return float(raw) if math.isfinite(raw) else None


def ratio(top: float | None, bottom: float | None) -> float | None:
    """top / bottom; None when either is missing or bottom is 0."""
    return None if top is None or bottom is None or bottom == 0 else top / bottom


def fmt_num(number: float | None) -> str:
    """Three significant figures or so: 1234 -> 1234, 12.34 -> 12.3, 1.234 -> 1.23."""
    if number is None:
        return "n/a"
    decimals = 0 if abs(number) >= 100 else 1 if abs(number) >= 10 else 2
    return f"{number:.{decimals}f}"


def fmt_ratio(number: float | None) -> str:
    return "n/a" if number is None else f"{number:.2f}x"


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[int(max(1, -(-len(ordered) * q // 100))) - 1]


VERDICT = {True: "met", False: "NOT MET", None: "n/a"}  # a goal met, not met, not measured
Num = float | None


def versus(
    a: Num, b: Num, high: float, low: Num = None, why: str | None = None
) -> tuple[str, bool | None, Num]:
    """A `low <= a / b <= high` goal's (measured, met, ratio); `why` (not run...) leaves it open."""
    r = ratio(a, b)
    met = None if r is None or why else (low is None or r >= low) and r <= high
    return why or f"{fmt_num(a)} / {fmt_num(b)} ms = {fmt_ratio(r)}", met, r
