"""tests/k8s: the Kubernetes manifests in deploy/k8s, rendered and checked offline.

Needs `kubectl` (its built-in kustomize renders; no cluster), `kubernetes-validate` for schema
validation, and, for single comparisons, the Compose binary and `promtool`; each test that lacks a
tool skips with the reason. All tests carry the `k8s` marker (`pytest -m k8s`).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.k8s)
