"""Params that Kubernetes cannot read from the environment (components/params copies them into
the side-channel container ports and the model cache's size), ENFORCE_EAGER reaching the vLLM
pods, and `make k8s-check` (pcp_pd_kit.k8s_check), which refuses what would only fail on the
cluster: the placeholder image, a port or cache size that disagrees with its param."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from pcp_pd_kit import k8s_check as kc
from tests.k8s import checks as ck
from tests.k8s import netpol
from tests.k8s import operations as op
from tests.k8s.manifests import (
    COMPONENTS_DIR,
    DEPLOY,
    OVERLAYS_DIR,
    container_env,
    find,
    params_file,
    render,
    render_overlay_plus,
    role_templates,
)
from tests.k8s.renders import ALL_RENDERS, OVERLAY_NAMES, needs_kubectl, rendered

pytestmark = needs_kubectl

PARAMS = params_file(DEPLOY / "base" / "params.env")
REGISTRY = "registry.mycorp.example/ml"
# What `make k8s-proxy-image` prints: the base's name and the kit overlays' placeholder.
IMAGES = [
    {"name": name, "newName": f"{REGISTRY}/pcp-pd-kit/pd-proxy", "newTag": "0.1.0"}
    for name in ("pcp-pd-kit/pd-proxy", f"{kc.PLACEHOLDER_REGISTRY}/pcp-pd-kit/pd-proxy")
]


def operator_overlay(
    folder: Path,
    on: str = "1p1d",
    literals: tuple[str, ...] = (),
    params: bool = True,
    images: list[dict[str, str]] | None = None,
) -> Path:
    """An operator's overlay on one of the kit's: its own param merges, images, and (as the docs
    say) components/params listed again."""
    folder.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAYS_DIR / on, folder)],
        "images": IMAGES if images is None else images,
    }
    if params:
        doc["components"] = [os.path.relpath(COMPONENTS_DIR / "params", folder)]
    if literals:
        doc["configMapGenerator"] = [
            {"name": "pcp-pd-params", "behavior": "merge", "literals": list(literals)}
        ]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def load(folder: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(kc.render(folder)) if doc]


# ------------------------------------------------------------------------ the placeholder image
@pytest.mark.parametrize("name", OVERLAY_NAMES)
def test_kit_overlays_are_refused_until_the_proxy_image_is_yours(name: str) -> None:
    found = kc.problems(rendered(name))
    assert len(found) == 1, found
    assert found[0].startswith("Deployment/pcp-pd-proxy: image ")
    assert (
        f"{kc.PLACEHOLDER_REGISTRY}/pcp-pd-kit/pd-proxy:0.1.0 is the kit's placeholder"
        in (found[0])
    )
    assert "make k8s-proxy-image REGISTRY=" in found[0]
    overlay = yaml.safe_load((OVERLAYS_DIR / name[8:] / "kustomization.yaml").read_text())
    assert [i["newName"].split("/")[0] for i in overlay["images"]] == [kc.PLACEHOLDER_REGISTRY]


@pytest.mark.parametrize("overlay", ["1p1d", "xpyd"])
def test_kit_overlays_pass_with_your_registry(overlay: str) -> None:
    objs = render_overlay_plus(overlay, images=yaml.safe_dump(IMAGES))
    assert kc.problems(objs) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_every_render_has_its_params_copied(name: str) -> None:
    assert kc.params_copies(rendered(name)) == []


def test_placeholder_check_sees_sidecars_and_lws_pods() -> None:
    objs = rendered("xpyd+router+lws")
    lws = find(objs, "LeaderWorkerSet")[0]["spec"]["leaderWorkerTemplate"]
    lws["workerTemplate"]["spec"]["containers"][0]["image"] = "registry.example.com/vllm:1"
    decode = find(objs, "Deployment", "pcp-pd-decode")[0]["spec"]["template"]["spec"]
    decode["initContainers"][0]["image"] = "registry.example.com/sidecar"
    found = kc.placeholder_images(objs)
    assert [p.split(":")[0] for p in found] == [
        "Deployment/pcp-pd-decode",
        "LeaderWorkerSet/pcp-pd-prefill-lws (workerTemplate)",
    ], found


# ------------------------------------------------------------------------ params copied in place
def test_param_merges_reach_the_ports_the_policies_and_the_cache(tmp_path: Path) -> None:
    """An operator's overlay changes the side-channel ports, the cache size and ENFORCE_EAGER:
    the container ports, the environment, the NetworkPolicies (which admit the port by name)
    and the volume and its request all follow, through one key each."""
    folder = operator_overlay(
        tmp_path / "mine",
        on="xpyd",
        literals=(
            "PREFILL_NIXL_SIDE_CHANNEL_PORT=5700",
            "DECODE_NIXL_SIDE_CHANNEL_PORT=5701",
            "HF_CACHE_SIZE=200Gi",
            "ENFORCE_EAGER=1",
        ),
    )
    objs = load(folder)
    assert kc.problems(objs) == []
    assert ck.check_side_channel(objs) == [] and op.check_network_policies(objs) == []
    policies = find(objs, "NetworkPolicy")
    (prefill,) = role_templates(objs, "prefill")
    (decode,) = role_templates(objs, "decode")
    for t, port, peer in ((prefill, 5700, decode), (decode, 5701, prefill)):
        c = t.container("vllm")
        env = container_env(c, objs, t.injected)
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
        assert ck.container_ports(t)["nixl-side"] == port
        assert netpol.admits(policies, op._pod(peer), op._pod(t), port)
        assert not netpol.admits(policies, op._pod(peer), op._pod(t), port - 100)  # the default
        assert ck.volume(t, "hf-cache") == {"name": "hf-cache", "emptyDir": {"sizeLimit": "200Gi"}}
        assert c["resources"]["requests"]["ephemeral-storage"] == "200Gi"
        assert env["KIT_ENFORCE_EAGER"] == "1"


def test_an_overlay_that_merges_without_the_component_is_refused(tmp_path: Path) -> None:
    """What went wrong before components/params: the param moves, the container port (and so the
    NetworkPolicy) stays. The check names the pod, both numbers, the param and the fix."""
    folder = operator_overlay(
        tmp_path / "forgot",
        literals=("PREFILL_NIXL_SIDE_CHANNEL_PORT=5700", "HF_CACHE_SIZE=100Gi"),
        params=False,
    )
    found = kc.problems(load(folder))
    side = [p for p in found if "side channel" in p]
    assert side == [
        "Deployment/pcp-pd-prefill: the side channel listens on 5700 "
        "(PREFILL_NIXL_SIDE_CHANNEL_PORT) but the nixl-side container port, which the "
        f"NetworkPolicies admit, is 5600: {kc.PARAMS_HINT}"
    ]
    cache = [p for p in found if "hf-cache" in p]
    assert len(cache) == 4 and all("is not HF_CACHE_SIZE 100Gi" in p for p in cache), cache
    assert len(found) == 5


def test_lws_gets_the_params_in_either_order() -> None:
    """components/params targets the LeaderWorkerSet too, so listing it before or after
    lws-prefill gives the same pods."""
    after = render_overlay_plus("xpyd", "lws-prefill", "params")
    assert kc.params_copies(after) == [] and ck.check_side_channel(after) == []
    assert find(after, "LeaderWorkerSet") and not find(after, "Deployment", "pcp-pd-prefill")


def test_hf_cache_is_bounded_and_requested() -> None:
    """Each vLLM pod's model cache: an emptyDir with a size limit, and that much node disk
    requested, both HF_CACHE_SIZE (the kubelet evicts the pod with a reason past the limit)."""
    size = PARAMS["HF_CACHE_SIZE"]
    assert ck.quantity_bytes(size) >= 32 * 10**9  # the default model's weights fit
    objs = rendered("base")
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            assert ck.volume(t, "hf-cache")["emptyDir"] == {"sizeLimit": size}
            assert t.container("vllm")["resources"]["requests"]["ephemeral-storage"] == size


def test_enforce_eager_comes_from_the_params() -> None:
    """KIT_ENFORCE_EAGER reaches every vLLM container from pcp-pd-params (envFrom, prefix KIT_);
    the entrypoint decides what it means, nothing in deploy/k8s adds --enforce-eager itself."""
    assert "ENFORCE_EAGER" in PARAMS
    for name in ("base", "lws", "router"):
        objs = rendered(name)
        templates = role_templates(objs, "prefill") + role_templates(objs, "decode")
        assert templates
        for t in templates:
            c = t.container("vllm")
            env = container_env(c, objs, t.injected)
            assert env["KIT_ENFORCE_EAGER"] == PARAMS["ENFORCE_EAGER"]
            assert not any(e["name"] == "KIT_ENFORCE_EAGER" for e in c.get("env", []))
    for path in DEPLOY.rglob("*"):
        if path.is_file() and "generated" not in path.parts:
            assert "--enforce-eager" not in path.read_text(), path


# ------------------------------------------------------------------------ the command
def test_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kc.main([str(OVERLAYS_DIR / "1p1d")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k8s-check: ERROR: Deployment/pcp-pd-proxy: image registry.example.com")
    mine = operator_overlay(tmp_path / "mine")
    assert kc.main(["--render", str(mine)]) == 0
    out = capsys.readouterr().out
    assert [d for d in yaml.safe_load_all(out) if d] == render(mine)
    assert kc.main([str(tmp_path / "nowhere")]) == 2
    assert "kubectl kustomize" in capsys.readouterr().err


def test_check_command_without_kubectl(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KUBECTL", "/nonexistent/kubectl")
    assert kc.main([str(OVERLAYS_DIR / "1p1d")]) == 2
    assert "kubectl not found" in capsys.readouterr().err
