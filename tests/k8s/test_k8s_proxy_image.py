"""scripts/k8s_proxy_image.sh (`make k8s-proxy-image`): the documented path from this repository
to a pd-proxy image the cluster can pull. A fake `docker` records what it is asked to do; no image
is built here. The `images:` entry the script prints, put in an overlay, passes `make k8s-check`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from pcp_pd_kit import k8s_check as kc
from tests.k8s.manifests import BASE, OVERLAYS_DIR, find, render_overlay_plus
from tests.k8s.renders import needs_kubectl
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "k8s_proxy_image.sh"
FAKE_DOCKER = """#!/bin/sh
printf '%s\\n' "$*" >>"$FAKE_CALLS"
[ "$1" = push ] && [ -n "${FAKE_PUSH_FAILS:-}" ] && exit 1
exit 0
"""


def base_image() -> str:
    doc = yaml.safe_load((BASE / "proxy.yaml").read_text())
    return doc["spec"]["template"]["spec"]["containers"][0]["image"]


def run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "docker").write_text(FAKE_DOCKER)
    (bindir / "docker").chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    full = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_CALLS": str(calls),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    return proc, calls.read_text().splitlines()


def test_builds_the_compose_dockerfile_and_pushes_to_your_registry(tmp_path: Path) -> None:
    proc, calls = run(tmp_path, REGISTRY="registry.mycorp.example:5000/ml/", TAG="1.2.3")
    assert proc.returncode == 0, proc.stderr
    image = "registry.mycorp.example:5000/ml/pcp-pd-kit/pd-proxy:1.2.3"
    assert calls == [
        f"build -f compose/images/proxy.Dockerfile -t {image} .",
        f"push {image}",
    ]
    entries = yaml.safe_load(proc.stdout)["images"]
    want = {"newName": "registry.mycorp.example:5000/ml/pcp-pd-kit/pd-proxy", "newTag": "1.2.3"}
    assert entries == [
        {"name": "pcp-pd-kit/pd-proxy", **want},
        {"name": "registry.example.com/pcp-pd-kit/pd-proxy", **want},
    ]


def test_the_default_tag_is_the_manifests_and_push_can_wait(tmp_path: Path) -> None:
    proc, calls = run(tmp_path, REGISTRY="reg.example.org", PUSH="0")
    assert proc.returncode == 0, proc.stderr
    image = f"reg.example.org/{base_image()}"
    assert calls == [f"build -f compose/images/proxy.Dockerfile -t {image} ."]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "set REGISTRY to the registry your cluster pulls from"),
        ({"REGISTRY": "registry.example.com"}, "is the kit's placeholder"),
        ({"REGISTRY": "https://reg.example.org"}, "is not a registry host"),
        ({"REGISTRY": "reg.example.org", "TAG": "no/slash"}, "is not a valid image tag"),
        ({"REGISTRY": "reg.example.org", "PUSH": "yes"}, "PUSH must be 1"),
        ({"REGISTRY": "reg.example.org", "FAKE_PUSH_FAILS": "1"}, "docker login reg.example.org"),
    ],
)
def test_bad_input_is_refused_with_the_reason(tmp_path: Path, env: dict[str, str], message: str):
    proc, calls = run(tmp_path, **env)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""  # no images: entry to copy
    if "FAKE_PUSH_FAILS" not in env:
        assert calls == []  # refused before building anything


@needs_kubectl
def test_the_printed_entry_passes_the_check(tmp_path: Path) -> None:
    """In a copy of a kit overlay (its placeholder entry replaced, or kept above this one) and in
    an overlay on top of one, the printed entry names the pushed image."""
    proc, _ = run(tmp_path, REGISTRY="registry.mycorp.example/ml")
    entries = yaml.safe_load(proc.stdout)["images"]
    image = "registry.mycorp.example/ml/" + base_image()
    placeholder = yaml.safe_load((OVERLAYS_DIR / "1p1d" / "kustomization.yaml").read_text())
    copies = [entries, placeholder["images"] + entries]
    renders = [render_overlay_plus("1p1d", images=yaml.safe_dump(e)) for e in copies]
    folder = tmp_path / "mine"
    folder.mkdir()
    doc = {"resources": [os.path.relpath(OVERLAYS_DIR / "1p1d", folder)], "images": entries}
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    renders.append([d for d in yaml.safe_load_all(kc.render(folder)) if d])
    for objs in renders:
        assert kc.problems(objs) == []
        (proxy,) = find(objs, "Deployment", "pcp-pd-proxy")
        assert proxy["spec"]["template"]["spec"]["containers"][0]["image"] == image
