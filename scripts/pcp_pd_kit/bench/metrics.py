"""Prometheus histograms and counters from parsed /metrics samples, and their deltas. No I/O. A
metric sums its label sets, or those a selector names (`name{phase="admitted_to_first_token"}`)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pcp_pd_kit.localstack.report import Sample


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets (upper bound, count) sorted by bound and ending at +Inf, sum, count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        """sum/count: exact, whatever the buckets; None with no observation."""
        return self.sum / self.count if self.count > 0 else None

    def bucket_of(self, q: float) -> tuple[float, float] | None:
        """(lower, upper] bounds of the bucket holding rank q: all a histogram really knows."""
        if self.count <= 0 or not self.buckets:
            return None
        lower = 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= q * self.count and cumulative > 0:
                return lower, bound
            lower = bound
        return lower, math.inf


REQUESTS_COUNTER = "pd_proxy_requests_total"  # pd-proxy's, by path: pd, or local (decode alone)
_SELECTOR = re.compile(r"^([^{]+)(?:\{(.*)\})?$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"\s*,?')


def selector(name: str, labels: Mapping[str, str] | None = None) -> str:
    """One key for a metric restricted to some label values: 'name{k="v",...}' (sorted)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_selector(key: str) -> tuple[str, dict[str, str]]:
    """'name{k="v"}' -> ('name', {'k': 'v'}); the inverse of selector()."""
    match = _SELECTOR.match(key.strip())
    if match is None:
        raise ValueError(f"not a metric selector: {key!r}")
    return match.group(1), dict(_LABEL.findall(match.group(2) or ""))


def series(counts: Mapping[str, float] | None, name: str) -> list[tuple[dict[str, str], float]]:
    """A counter's (labels, value) pairs from values keyed by selector (counter_values)."""
    parsed = [(*parse_selector(key), count) for key, count in (counts or {}).items()]
    return [(labels, count) for metric, labels, count in parsed if metric == name]


def paths(counts: Mapping[str, float] | None) -> dict[str, float]:
    """pd-proxy's requests per path, local and pd, from its counters keyed by selector."""
    found = series(counts, REQUESTS_COUNTER)
    return {p: sum((n for lb, n in found if lb.get("path") == p), 0.0) for p in ("local", "pd")}


def histogram(samples: Iterable[Sample], name: str) -> Histogram | None:
    """The histogram `name` (or selector) summed over its label sets; None when absent."""
    name, wanted = parse_selector(name)
    totals = {f"{name}_{part}": 0.0 for part in ("sum", "count")}
    buckets: dict[float, float] = {}
    found = False
    for s in samples:
        if any(s.labels.get(k) != v for k, v in wanted.items()):
            continue
        if s.name == f"{name}_bucket" and "le" in s.labels:
            bound = float(s.labels["le"])  # "+Inf" included
            buckets[bound] = buckets.get(bound, 0.0) + s.value
        elif s.name in totals:
            totals[s.name] += s.value
        else:
            continue
        found = True
    return Histogram(tuple(sorted(buckets.items())), *totals.values()) if found else None


def delta(after: Histogram | None, before: Histogram | None) -> Histogram | None:
    """Observations between two scrapes; None when missing after or reset, zero before."""
    if after is None or before is None:
        return after
    if after.count < before.count:
        return None
    earlier = dict(before.buckets)
    buckets = tuple((bound, count - earlier.get(bound, 0.0)) for bound, count in after.buckets)
    return Histogram(buckets, after.sum - before.sum, after.count - before.count)


def counter_values(
    samples: Iterable[Sample], name: str, keep: Sequence[str] = ()
) -> dict[str, float] | None:
    """A counter's values summed per combination of the `keep` labels, by selector; None: absent."""
    found: dict[str, float] = {}
    for s in samples:
        if s.name == name:
            key = selector(name, {k: s.labels.get(k, "") for k in keep})
            found[key] = found.get(key, 0.0) + s.value
    return found or None


def gauge_max(samples: Iterable[Sample], name: str) -> float | None:
    """The largest value of a gauge over its label sets (one per engine); None when absent."""
    return max((s.value for s in samples if s.name == name), default=None)


def counter_delta(
    after: Mapping[str, float] | None, before: Mapping[str, float] | None
) -> dict[str, float] | None:
    """Per label set: after - before (after alone when absent before or reset)."""
    if after is None:
        return None
    prior = {k: (before or {}).get(k, 0.0) for k in after}
    return {k: v - prior[k] if v >= prior[k] else v for k, v in after.items()}
