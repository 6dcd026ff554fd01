"""tests/k8s: the Kubernetes manifests in deploy/k8s, rendered and checked offline.

Needs `kubectl` (its built-in kustomize renders; no cluster), `kubernetes-validate` for schema
validation, and, for single comparisons, the Compose binary and `promtool`; each test that lacks a
tool skips with the reason. All tests carry the `k8s` marker (`pytest -m k8s`). A run that
skipped some says how many, and why, in one line at its end (`make test` on a machine without
`kubectl` skips most of them).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.k8s)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if line := skipped_line(terminalreporter.stats):
        terminalreporter.write_line(line, yellow=True, bold=True)


def skipped_line(stats: dict[str, list]) -> str:
    """'k8s: N of M checks skipped: reason (n); ...' from the run's reports, or '' if none."""
    reports = [r for key in ("passed", "failed", "skipped") for r in stats.get(key, [])]
    k8s = {r.nodeid: r for r in reports if "k8s" in getattr(r, "keywords", {})}
    skipped = [r for r in k8s.values() if r.skipped]
    if not skipped:
        return ""
    reasons = Counter(_reason(r) for r in skipped)
    why = "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common())
    return f"k8s: {len(skipped)} of {len(k8s)} checks skipped: {why}"


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")
