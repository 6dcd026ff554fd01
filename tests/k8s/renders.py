"""The renders the k8s tests share: overlays and component sets, and the kubectl gate."""

from __future__ import annotations

import copy

import pytest

from tests.k8s.manifests import Obj, kubectl, overlays, render, render_overlay_plus, render_with
from tests.support.paths import REPO

needs_kubectl = pytest.mark.skipif(
    kubectl() is None,
    reason="kubectl not found: these tests render deploy/k8s with `kubectl kustomize` "
    "(kubectl >= 1.27, kustomize v5; no cluster needed)",
)

# The operator's RDMA resource (an input, not part of transport-rdma); its template lives in the
# xpyd overlay.
RDMA_INPUT = "overlays/xpyd/rdma-resource"

# Component sets rendered on top of the base (which always carries network-policy), besides the
# overlays; together they use every component (test_k8s_render checks), in the order
# docs/kubernetes.md prescribes.
COMBOS: dict[str, tuple[str, ...]] = {
    "base": (),
    "tcp": ("transport-tcp",),
    "rdma": ("transport-rdma", RDMA_INPUT),
    "monitoring": ("monitoring",),
    "standalone-prometheus": ("monitoring-standalone",),
    "lws": ("transport-rdma", RDMA_INPUT, "lws-prefill"),
    "router": ("transport-tcp", "llm-d-router"),
    "router-standalone": ("transport-tcp", "monitoring-standalone", "llm-d-router"),
    "router-lws-monitoring": (
        "transport-rdma",
        RDMA_INPUT,
        "monitoring",
        "llm-d-router",
        "lws-prefill",
    ),
}
# Overlays with the extra components their comments offer.
OVERLAY_PLUS: dict[str, tuple[str, tuple[str, ...]]] = {
    "xpyd+lws": ("xpyd", ("lws-prefill",)),
    "xpyd+router+lws": ("xpyd", ("llm-d-router", "lws-prefill")),
}


def rendered(name: str) -> list[Obj]:
    """An overlay (overlay:<name>), an OVERLAY_PLUS or a COMBOS set, freshly copied."""
    if name.startswith("overlay:"):
        return render(REPO / "deploy/k8s/overlays" / name[8:])
    if name in OVERLAY_PLUS:
        overlay, extra = OVERLAY_PLUS[name]
        return copy.deepcopy(render_overlay_plus(overlay, *extra))
    return copy.deepcopy(render_with(*COMBOS[name]))


OVERLAY_NAMES = [f"overlay:{p.name}" for p in overlays()]
ALL_RENDERS = OVERLAY_NAMES + list(OVERLAY_PLUS) + list(COMBOS)
