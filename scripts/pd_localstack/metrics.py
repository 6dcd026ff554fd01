"""Parse Prometheus text exposition into samples and sum them by name and labels."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a /metrics page (counter samples keep their _total suffix)."""
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def select(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples with this exact name whose labels include the given ones."""
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum over matching samples; None when the metric is absent (distinct from 0)."""
    found = select(samples, name, **labels)
    return sum(s.value for s in found) if found else None
