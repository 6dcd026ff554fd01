"""`kubectl apply -k <overlay> --dry-run=client` works for both overlays, with kustomize's default
load restrictions, against an API server that answers only discovery (tests/k8s/fake_discovery.py;
no cluster here). Schema validation is test_k8s_render's (kubernetes-validate, offline)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.k8s.fake_discovery import discovery_server
from tests.k8s.manifests import OVERLAYS_DIR, kubectl, overlays, render
from tests.k8s.renders import needs_kubectl

pytestmark = needs_kubectl
NAMESPACE = "pcp-pd"


def apply_dry_run(overlay: Path, server: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    exe = kubectl()
    assert exe is not None
    kubeconfig = tmp_path / "kubeconfig"  # empty: nothing of the user's config is used
    kubeconfig.write_text("")
    return subprocess.run(
        [exe, "apply", "-k", str(overlay), "--dry-run=client", "--validate=false",
         "--server", server, "--namespace", NAMESPACE, "--kubeconfig", str(kubeconfig)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def created(stdout: str) -> set[tuple[str, str]]:
    """(kind resource, name) of every `<resource>/<name> created (dry run)` line."""
    return set(re.findall(r"^([a-z0-9.]+)/(\S+) created \(dry run\)$", stdout, re.M))


@pytest.mark.parametrize("overlay", [p.name for p in overlays()])
def test_apply_k_dry_run_works(overlay: str, tmp_path: Path) -> None:
    objs = render(OVERLAYS_DIR / overlay)
    with discovery_server() as (server, gets):
        proc = apply_dry_run(OVERLAYS_DIR / overlay, server, tmp_path)
    assert proc.returncode == 0, proc.stderr
    names = {name for _, name in created(proc.stdout)}
    assert names == {o["metadata"]["name"] for o in objs}
    assert len(created(proc.stdout)) == len(objs)
    # Every object was looked up in the namespace given on the command line (kubectl also asks
    # for the namespace itself).
    objects = [g for g in gets if g != f"/api/v1/namespaces/{NAMESPACE}"]
    assert len(objects) == len(objs)
    assert all(f"/namespaces/{NAMESPACE}/" in g for g in objects)


def test_apply_fails_on_a_kind_the_cluster_lacks(tmp_path: Path) -> None:
    """The dry run is not a rubber stamp: without the Prometheus Operator's CRD the xpyd overlay
    (PodMonitors) is refused, as a real cluster would refuse it."""
    with discovery_server(with_crds=False) as (server, _):
        proc = apply_dry_run(OVERLAYS_DIR / "xpyd", server, tmp_path)
    assert proc.returncode != 0
    assert "PodMonitor" in proc.stderr
