"""The renders the k8s tests share: overlays and component sets, and the kubectl gate."""

from __future__ import annotations

import copy

import pytest

from tests.k8s.manifests import Obj, kubectl, overlays, render, render_with
from tests.support.paths import REPO

needs_kubectl = pytest.mark.skipif(
    kubectl() is None,
    reason="kubectl not found: these tests render deploy/k8s with `kubectl kustomize` "
    "(kubectl >= 1.27, kustomize v5; no cluster needed)",
)

# Component sets rendered on top of the base, besides the overlays; together they use every
# component (test_k8s_render checks), in the order docs/kubernetes.md prescribes.
COMBOS: dict[str, tuple[str, ...]] = {
    "base": (),
    "tcp": ("transport-tcp",),
    "rdma": ("transport-rdma",),
    "monitoring": ("monitoring",),
    "standalone-prometheus": ("monitoring-standalone",),
    "lws": ("transport-rdma", "lws-prefill"),
    "router": ("transport-tcp", "llm-d-router"),
    "router-lws-monitoring": ("transport-rdma", "monitoring", "llm-d-router", "lws-prefill"),
}


def rendered(name: str) -> list[Obj]:
    """An overlay (overlay:<name>) or a component set of COMBOS, freshly copied."""
    if name.startswith("overlay:"):
        return render(REPO / "deploy/k8s/overlays" / name[8:])
    return copy.deepcopy(render_with(*COMBOS[name]))


OVERLAY_NAMES = [f"overlay:{p.name}" for p in overlays()]
ALL_RENDERS = OVERLAY_NAMES + list(COMBOS)
